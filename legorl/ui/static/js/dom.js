// DOM helpers: every element is built from text nodes, never from HTML strings. Trajectories and
// messages are untrusted (model output, API server messages), so nothing here parses markup.

const SVG_NS = 'http://www.w3.org/2000/svg';

function appendChildren(el, children) {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    if (Array.isArray(child)) {
      appendChildren(el, child);
    } else if (child instanceof Node) {
      el.appendChild(child);
    } else {
      el.appendChild(document.createTextNode(String(child)));
    }
  }
}

function setAttrs(el, attrs) {
  if (!attrs) return;
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith('on') && typeof value === 'function') {
      el.addEventListener(key.slice(2), value);
    } else if (key === 'dataset') {
      for (const [k, v] of Object.entries(value)) el.dataset[k] = String(v);
    } else if (key === 'style') {
      for (const [k, v] of Object.entries(value)) el.style.setProperty(k, String(v));
    } else if (key === 'href') {
      const text = String(value);
      // Only in-page routes and relative links: never javascript: or data: URLs.
      el.setAttribute('href', /^(#|\.\/|[a-z0-9_-]+\/)/i.test(text) ? text : '#');
    } else if (value === true) {
      el.setAttribute(key, '');
    } else {
      el.setAttribute(key, String(value));
    }
  }
}

export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  setAttrs(el, attrs);
  appendChildren(el, children);
  return el;
}

export function svg(tag, attrs, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  setAttrs(el, attrs);
  appendChildren(el, children);
  return el;
}

export function clear(el) {
  while (el.firstChild) el.removeChild(el.firstChild);
  return el;
}

export function num(value, digits = 3) {
  if (value === null || value === undefined || Number.isNaN(value)) return '–';
  if (typeof value !== 'number') return String(value);
  if (value !== 0 && (Math.abs(value) < 1e-3 || Math.abs(value) >= 1e6)) return value.toExponential(2);
  return Number(value.toFixed(digits)).toString();
}

export function pct(value) {
  if (value === null || value === undefined) return '–';
  return `${(value * 100).toFixed(1)}%`;
}

export function secs(value) {
  if (value === null || value === undefined) return '–';
  if (value < 1) return `${(value * 1000).toFixed(0)} ms`;
  if (value < 120) return `${value.toFixed(1)} s`;
  const m = Math.floor(value / 60);
  if (m < 120) return `${m} min ${Math.round(value % 60)} s`;
  return `${Math.floor(m / 60)} h ${m % 60} min`;
}

export function when(iso) {
  if (!iso) return '–';
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return String(iso);
  return d.toISOString().replace('T', ' ').replace(/\.\d+Z$/, 'Z');
}

export function interval(pair) {
  if (!pair || pair.length !== 2 || pair[0] === null || pair[0] === undefined) return '';
  return ` [${num(pair[0], 2)}–${num(pair[1], 2)}]`;
}

export const REASON_COLORS = {
  completed: '#2e9d57',
  agent_error: '#d9822b',
  turn_limit: '#c7a72a',
  context_overflow: '#a8629e',
  agent_timeout: '#e0604f',
  sandbox_error: '#6b7a8f',
  engine_error: '#3d6fb6',
  proxy_error: '#5aa2c9',
  verifier_error: '#8a6d3b',
  defense_failed: '#b3261e',
  cancelled: '#9aa0a6',
};

export const PALETTE = ['#3d6fb6', '#e0604f', '#2e9d57', '#a8629e', '#d9822b', '#5aa2c9', '#8a6d3b', '#6b7a8f'];

export function reasonColor(reason) {
  return REASON_COLORS[reason] || '#888';
}

export function badge(text, kind = '') {
  return h('span', { class: `badge ${kind}` }, text);
}

export function phaseBadge(phase) {
  const kind =
    {
      Running: 'ok',
      Succeeded: 'ok',
      Degraded: 'warn',
      Failed: 'bad',
      Invalid: 'bad',
      Suspended: 'muted',
      Pending: 'muted',
    }[phase] || 'muted';
  return badge(phase || 'Unknown', kind);
}

export function conditionChip(c) {
  const good = c.status === 'True' ? !['Degraded', 'Failed'].includes(c.type) : c.type === 'Degraded';
  const kind = c.status === 'Unknown' ? 'muted' : good ? 'ok' : c.type === 'Degraded' || c.type === 'Failed' ? 'bad' : 'warn';
  return h(
    'span',
    { class: `chip ${kind}`, title: `${c.type}=${c.status} (${c.reason || ''}): ${c.message || ''}` },
    `${c.type}${c.status === 'True' ? '' : c.status === 'False' ? ' ✗' : ' ?'}`,
  );
}

export function card(title, ...children) {
  return h('section', { class: 'card' }, title ? h('h3', null, title) : null, ...children);
}

export function note(text, kind = 'info') {
  return h('p', { class: `note ${kind}` }, text);
}

// A table from column definitions: {label, value(row) → Node|string, class?, sort?}.
export function table(columns, rows, { onRow, empty = 'nothing to show', sort, onSort } = {}) {
  if (!rows.length) return note(empty, 'muted');
  const head = h(
    'tr',
    null,
    columns.map((col) => {
      const th = h('th', { class: col.class || '' }, col.label);
      if (col.sort && onSort) {
        th.classList.add('sortable');
        if (sort && sort.key === col.sort) th.classList.add(sort.order === 'desc' ? 'desc' : 'asc');
        th.addEventListener('click', () => onSort(col.sort));
      }
      return th;
    }),
  );
  const body = rows.map((row) => {
    const tr = h('tr', null, columns.map((col) => h('td', { class: col.class || '' }, col.value(row))));
    if (onRow) {
      tr.classList.add('clickable');
      tr.addEventListener('click', (ev) => {
        if (ev.target.closest('a, input, button')) return;
        onRow(row);
      });
    }
    return tr;
  });
  return h('div', { class: 'table-wrap' }, h('table', null, h('thead', null, head), h('tbody', null, body)));
}

export function link(text, route) {
  return h('a', { href: route }, text);
}

export function runRoute(runId, view = '', query = '') {
  const base = `#/run/${encodeURIComponent(runId)}`;
  return (view ? `${base}/${view}` : base) + (query ? `?${query}` : '');
}

// Interpolate between two hex colours (t in [0, 1]).
export function mix(a, b, t) {
  const pa = [1, 3, 5].map((i) => parseInt(a.slice(i, i + 2), 16));
  const pb = [1, 3, 5].map((i) => parseInt(b.slice(i, i + 2), 16));
  const c = pa.map((x, i) => Math.round(x + (pb[i] - x) * Math.max(0, Math.min(1, t))));
  return `rgb(${c[0]}, ${c[1]}, ${c[2]})`;
}

export function rewardColor(value) {
  if (value === null || value === undefined) return '#eceff1';
  return value < 0.5 ? mix('#f4c7c3', '#fdf1c4', value * 2) : mix('#fdf1c4', '#b7e1c1', (value - 0.5) * 2);
}
