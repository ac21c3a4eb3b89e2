// Inline SVG charts (no library): line charts with an optional interval band, stacked bars.

import { PALETTE, h, num, svg } from './dom.js';

const W = 360;
const H = 200;
const M = { left: 60, right: 12, top: 12, bottom: 28 };

function niceTicks(lo, hi, count = 4) {
  if (!(hi > lo)) {
    const pad = Math.abs(lo) > 0 ? Math.abs(lo) * 0.1 : 1;
    lo -= pad;
    hi += pad;
  }
  const raw = (hi - lo) / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const first = Math.floor(lo / step) * step;
  const ticks = [];
  for (let v = first; v <= hi + step * 0.5; v += step) ticks.push(Number(v.toPrecision(12)));
  return ticks;
}

// Tick labels with as many decimals as the tick spacing needs (so 0.99998 and 1.00000 differ).
function tickLabel(t, ticks) {
  const step = ticks.length > 1 ? Math.abs(ticks[1] - ticks[0]) : 1;
  const big = Math.max(...ticks.map(Math.abs));
  if (big !== 0 && (big < 1e-3 || big >= 1e6)) return t.toExponential(Math.min(6, Math.max(1, Math.ceil(Math.log10(big / step)))));
  const decimals = Math.min(8, Math.max(0, -Math.floor(Math.log10(step)) + (Math.abs(step / 10 ** Math.floor(Math.log10(step)) - 2.5) < 1e-9 ? 1 : 0)));
  return t.toFixed(decimals);
}

// Widen a degenerate range so a flat series is drawn as a flat line, not as noise at 1e-12 scale.
function widen(lo, hi) {
  if (lo === 0 && hi === 0) return [0, 1];
  const span = Math.max(Math.abs(lo), Math.abs(hi), 1e-12) * 1e-4;
  if (hi - lo >= span) return [lo, hi];
  const mid = (lo + hi) / 2;
  return [mid - span / 2, mid + span / 2];
}

function extent(values) {
  let lo = Infinity;
  let hi = -Infinity;
  for (const v of values) {
    if (v === null || v === undefined || !Number.isFinite(v)) continue;
    lo = Math.min(lo, v);
    hi = Math.max(hi, v);
  }
  return lo === Infinity ? [0, 1] : [lo, hi];
}

// series: [{name, points: [[x, y], ...], color?, dashed?}]; band: [{x, low, high}] (drawn first).
export function lineChart({ title, series, band = null, yDomain = null, xLabel = 'step', height = H, width = W }) {
  const xs = [];
  const ys = [];
  for (const s of series) for (const [x, y] of s.points) {
    xs.push(x);
    ys.push(y);
  }
  if (band) for (const b of band) {
    xs.push(b.x);
    if (b.low !== null) ys.push(b.low);
    if (b.high !== null) ys.push(b.high);
  }
  const box = h('figure', { class: 'chart', dataset: { chart: title } }, h('figcaption', null, title));
  if (!xs.length) {
    box.appendChild(h('p', { class: 'note muted' }, 'no data yet'));
    return box;
  }
  let [x0, x1] = extent(xs);
  if (x0 === x1) {
    x0 -= 1;
    x1 += 1;
  }
  const [ylo, yhi] = yDomain || widen(...extent(ys));
  const yt = niceTicks(ylo, yhi);
  const y0 = Math.min(yt[0], ylo);
  const y1 = Math.max(yt[yt.length - 1], yhi);
  const px = (x) => M.left + ((x - x0) / (x1 - x0)) * (width - M.left - M.right);
  const py = (y) => height - M.bottom - ((y - y0) / (y1 - y0 || 1)) * (height - M.top - M.bottom);
  const root = svg('svg', { viewBox: `0 0 ${width} ${height}`, class: 'chart-svg', role: 'img' });
  for (const t of yt) {
    if (t < y0 || t > y1) continue;
    root.appendChild(svg('line', { x1: M.left, x2: width - M.right, y1: py(t), y2: py(t), class: 'grid' }));
    root.appendChild(svg('text', { x: M.left - 6, y: py(t) + 4, class: 'tick', 'text-anchor': 'end' }, tickLabel(t, yt)));
  }
  const xt = niceTicks(x0, x1, Math.min(6, Math.max(1, Math.round(x1 - x0)))).filter(
    (t) => t >= x0 && t <= x1 && Number.isInteger(t),
  );
  for (const t of xt) {
    root.appendChild(svg('text', { x: px(t), y: height - M.bottom + 16, class: 'tick', 'text-anchor': 'middle' }, String(t)));
  }
  root.appendChild(svg('text', { x: width - M.right, y: height - 2, class: 'axis-label', 'text-anchor': 'end' }, xLabel));
  root.appendChild(svg('line', { x1: M.left, x2: M.left, y1: M.top, y2: height - M.bottom, class: 'axis' }));
  root.appendChild(
    svg('line', { x1: M.left, x2: width - M.right, y1: height - M.bottom, y2: height - M.bottom, class: 'axis' }),
  );
  if (band && band.length) {
    const pts = band.filter((b) => b.low !== null && b.high !== null);
    if (pts.length === 1) {
      const b = pts[0];
      root.appendChild(svg('line', { x1: px(b.x), x2: px(b.x), y1: py(b.low), y2: py(b.high), class: 'band-line' }));
    } else if (pts.length > 1) {
      const upper = pts.map((b) => `${px(b.x)},${py(b.high)}`);
      const lower = pts.slice().reverse().map((b) => `${px(b.x)},${py(b.low)}`);
      root.appendChild(svg('polygon', { points: upper.concat(lower).join(' '), class: 'band' }));
    }
    for (const b of pts) {
      root.appendChild(svg('line', { x1: px(b.x) - 3, x2: px(b.x) + 3, y1: py(b.low), y2: py(b.low), class: 'band-line' }));
      root.appendChild(svg('line', { x1: px(b.x) - 3, x2: px(b.x) + 3, y1: py(b.high), y2: py(b.high), class: 'band-line' }));
    }
  }
  series.forEach((s, i) => {
    const color = s.color || PALETTE[i % PALETTE.length];
    const pts = s.points.filter(([, y]) => y !== null && Number.isFinite(y));
    if (pts.length > 1) {
      root.appendChild(
        svg('polyline', {
          points: pts.map(([x, y]) => `${px(x)},${py(y)}`).join(' '),
          class: s.dashed ? 'line dashed' : 'line',
          stroke: color,
        }),
      );
    }
    for (const [x, y] of pts) {
      root.appendChild(
        svg('circle', { cx: px(x), cy: py(y), r: 3, fill: color, class: 'dot' }, svg('title', null, `${s.name} @ ${xLabel} ${x}: ${num(y, 5)}`)),
      );
    }
  });
  box.appendChild(root);
  if (series.length > 1 || band) {
    box.appendChild(
      h(
        'div',
        { class: 'legend' },
        series.map((s, i) =>
          h('span', null, h('i', { style: { background: s.color || PALETTE[i % PALETTE.length] } }), s.name),
        ),
        band ? h('span', null, h('i', { class: 'band-key' }), '95% interval') : null,
      ),
    );
  }
  return box;
}

// Stacked bars: one bar per x, segments by key. values: {x: {key: count}}.
export function stackedBars({ title, xs, keys, values, colors, width = 1100, height = 240, xLabel = 'step' }) {
  const box = h('figure', { class: 'chart wide', dataset: { chart: title } }, h('figcaption', null, title));
  if (!xs.length) {
    box.appendChild(h('p', { class: 'note muted' }, 'no data yet'));
    return box;
  }
  const totals = xs.map((x) => keys.reduce((acc, k) => acc + ((values[x] || {})[k] || 0), 0));
  const max = Math.max(1, ...totals);
  const yt = niceTicks(0, max);
  const top = yt[yt.length - 1];
  const root = svg('svg', { viewBox: `0 0 ${width} ${height}`, class: 'chart-svg', role: 'img' });
  const plotW = width - M.left - M.right;
  const bw = Math.max(2, Math.min(40, (plotW / xs.length) * 0.7));
  const py = (y) => height - M.bottom - (y / top) * (height - M.top - M.bottom);
  for (const t of yt) {
    root.appendChild(svg('line', { x1: M.left, x2: width - M.right, y1: py(t), y2: py(t), class: 'grid' }));
    root.appendChild(svg('text', { x: M.left - 6, y: py(t) + 4, class: 'tick', 'text-anchor': 'end' }, String(t)));
  }
  xs.forEach((x, i) => {
    const cx = M.left + ((i + 0.5) / xs.length) * plotW;
    let acc = 0;
    for (const k of keys) {
      const v = (values[x] || {})[k] || 0;
      if (!v) continue;
      root.appendChild(
        svg(
          'rect',
          { x: cx - bw / 2, y: py(acc + v), width: bw, height: py(acc) - py(acc + v), fill: colors(k), class: 'bar' },
          svg('title', null, `${xLabel} ${x}: ${k} ${v}`),
        ),
      );
      acc += v;
    }
    if (xs.length <= 30 || i % Math.ceil(xs.length / 30) === 0) {
      root.appendChild(svg('text', { x: cx, y: height - M.bottom + 16, class: 'tick', 'text-anchor': 'middle' }, String(x)));
    }
  });
  root.appendChild(svg('text', { x: width - M.right, y: height - 2, class: 'axis-label', 'text-anchor': 'end' }, xLabel));
  box.appendChild(root);
  const used = keys.filter((k) => xs.some((x) => (values[x] || {})[k]));
  box.appendChild(h('div', { class: 'legend' }, used.map((k) => h('span', null, h('i', { style: { background: colors(k) } }), k))));
  return box;
}

// A horizontal proportion bar (e.g. stage timings): parts [{label, value, color}].
export function proportionBar(parts, { unit = (v) => num(v) } = {}) {
  const total = parts.reduce((a, p) => a + (p.value || 0), 0) || 1;
  return h(
    'div',
    { class: 'pbar' },
    parts
      .filter((p) => p.value > 0)
      .map((p) =>
        h(
          'span',
          { style: { width: `${(100 * p.value) / total}%`, background: p.color }, title: `${p.label}: ${unit(p.value)}` },
          (100 * p.value) / total > 12 ? p.label : '',
        ),
      ),
  );
}
