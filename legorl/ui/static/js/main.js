// The UI's shell: hash routes (work behind any path prefix and from file://), the header, run tabs.

import { STATIC, get, runPath } from './api.js';
import { clear, h, note, phaseBadge, runRoute } from './dom.js';
import {
  curvesView,
  diagnosticsView,
  fleetView,
  outcomesView,
  overviewView,
  sandboxesView,
  tasksView,
} from './run.js';
import { compareView, runsView } from './runs.js';
import { trajectoryView, trialsView } from './trials.js';

const TABS = [
  ['', 'Overview'],
  ['curves', 'Curves'],
  ['outcomes', 'Outcomes'],
  ['tasks', 'Tasks'],
  ['trials', 'Trials'],
  ['fleet', 'Fleet'],
  ['sandboxes', 'Sandboxes'],
  ['diagnostics', 'Diagnostics'],
];
const VIEWS = {
  '': overviewView,
  curves: curvesView,
  outcomes: outcomesView,
  tasks: tasksView,
  fleet: fleetView,
  sandboxes: sandboxesView,
  diagnostics: diagnosticsView,
};
const REFRESH_MS = 15000;

const ctx = {
  info: { actions_enabled: false, reasons: [] },
  token: () => sessionStorage.getItem('legorl-action-token') || '',
};

function parseRoute() {
  const raw = location.hash.replace(/^#\/?/, '');
  const [path, query = ''] = raw.split('?');
  const parts = path.split('/').filter(Boolean).map(decodeURIComponent);
  return { parts, params: new URLSearchParams(query) };
}

function header() {
  const right = h('div', { class: 'header-right' });
  if (STATIC) {
    right.appendChild(h('span', { class: 'badge muted', title: `exported ${STATIC.generated_at}` }, 'static export'));
  } else if (ctx.info.actions_enabled) {
    const field = h('input', { type: 'password', placeholder: 'action token', autocomplete: 'off', value: ctx.token(), name: 'token' });
    field.addEventListener('change', () => sessionStorage.setItem('legorl-action-token', field.value));
    right.appendChild(h('label', { title: 'pause, resume and validate need the token configured on the UI server' }, 'Actions ', field));
  } else {
    right.appendChild(h('span', { class: 'badge muted', title: 'no action token configured: the UI is read-only' }, 'read-only'));
  }
  return h('header', { class: 'top' }, h('a', { href: '#/', class: 'brand' }, 'legorl'), h('nav', { class: 'crumbs', id: 'crumbs' }), right);
}

function tabs(runId, active) {
  return h(
    'nav',
    { class: 'tabs' },
    TABS.map(([key, label]) => h('a', { href: runRoute(runId, key), class: key === active ? 'active' : '', dataset: { tab: key || 'overview' } }, label)),
  );
}

async function crumbs(parts) {
  const el = document.getElementById('crumbs');
  clear(el);
  el.appendChild(h('a', { href: '#/' }, 'Runs'));
  if (parts[0] === 'run' && parts[1]) {
    el.appendChild(document.createTextNode(' / '));
    el.appendChild(h('a', { href: runRoute(parts[1]) }, parts[1]));
    try {
      const overview = await get(runPath(parts[1]));
      el.appendChild(document.createTextNode(' '));
      el.appendChild(phaseBadge(overview.run.phase));
    } catch (err) {
      // the view shows the error
    }
  }
}

let timer = null;
let rendering = 0;

async function render() {
  const main = document.getElementById('main');
  const { parts, params } = parseRoute();
  const ticket = ++rendering;
  let view;
  let refreshes = false;
  try {
    if (!parts.length) {
      view = await runsView();
      refreshes = true;
    } else if (parts[0] === 'compare') {
      view = await compareView((parts[1] || '').split(',').filter(Boolean));
    } else if (parts[0] === 'run' && parts[1]) {
      const runId = parts[1];
      const sub = parts[2] || '';
      let inner;
      let active = sub;
      if (sub === 'trial' && parts[3]) {
        inner = await trajectoryView(ctx, runId, parts[3]);
        active = 'trials';
      } else if (sub === 'trials') {
        inner = await trialsView(ctx, runId, params);
      } else if (sub in VIEWS) {
        inner = await VIEWS[sub](ctx, runId);
        refreshes = sub === '' || sub === 'fleet' || sub === 'sandboxes';
      } else {
        inner = note(`unknown view ${sub}`, 'warn');
      }
      view = h('div', null, tabs(runId, active), inner);
    } else {
      view = note('unknown page', 'warn');
    }
  } catch (err) {
    view = h('div', { class: 'view error-view' }, note(`${err.status ? `HTTP ${err.status}: ` : ''}${err.message}`, 'error'));
  }
  if (ticket !== rendering) return; // a newer navigation won
  clear(main).appendChild(view);
  main.dataset.ready = location.hash || '#/';
  crumbs(parts);
  clearTimeout(timer);
  if (refreshes && !STATIC) {
    timer = setTimeout(() => {
      if (document.visibilityState === 'visible' && !document.querySelector('#main :focus')) render();
      else timer = setTimeout(render, REFRESH_MS);
    }, REFRESH_MS);
  }
}

async function start() {
  try {
    ctx.info = await get('api/info');
  } catch (err) {
    ctx.info = { actions_enabled: false, reasons: [] };
  }
  const app = document.getElementById('app');
  clear(app).appendChild(header());
  app.appendChild(h('main', { id: 'main' }));
  window.addEventListener('hashchange', () => {
    window.scrollTo(0, 0);
    render();
  });
  render();
}

start();
