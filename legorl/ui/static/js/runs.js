// The runs list, and the comparison of two or more runs.

import { get } from './api.js';
import { lineChart } from './charts.js';
import { PALETTE, card, conditionChip, h, interval, link, note, num, phaseBadge, runRoute, secs, table } from './dom.js';

export async function runsView() {
  const data = await get('api/runs');
  const selected = new Set();
  const compare = h('button', { class: 'btn', disabled: true }, 'Compare selected');
  compare.addEventListener('click', () => {
    location.hash = `#/compare/${[...selected].map(encodeURIComponent).join(',')}`;
  });
  const columns = [
    {
      label: '',
      value: (r) =>
        h('input', {
          type: 'checkbox',
          title: 'select to compare',
          dataset: { run: r.id },
          onchange: (ev) => {
            if (ev.target.checked) selected.add(r.id);
            else selected.delete(r.id);
            compare.disabled = selected.size < 2;
          },
        }),
    },
    { label: 'Run', value: (r) => h('span', null, link(r.name, runRoute(r.id)), r.namespace ? h('small', null, ` ${r.namespace}`) : null) },
    { label: 'Phase', value: (r) => phaseBadge(r.phase) },
    { label: 'Conditions', value: (r) => h('span', { class: 'chips' }, (r.conditions || []).map(conditionChip)) },
    { label: 'Step', class: 'n', value: (r) => `${r.step ?? '–'}${r.max_steps ? ` / ${r.max_steps}` : ''}` },
    { label: 'Reward', class: 'n', value: (r) => num(r.reward_mean) },
    { label: 'Held-out', class: 'n', value: (r) => `${num(r.held_out)}${interval(r.held_out_interval)}` },
    { label: 'Fidelity', class: 'n', value: (r) => num(r.fidelity, 4) },
    { label: 'Trials/min', class: 'n', value: (r) => num(r.trials_per_minute, 1) },
    { label: 'Updated', value: (r) => (r.updated_seconds_ago !== null && r.updated_seconds_ago !== undefined ? `${secs(r.updated_seconds_ago)} ago` : '–') },
  ];
  return h(
    'div',
    { class: 'view', dataset: { view: 'runs' } },
    h('div', { class: 'toolbar' }, h('h2', null, 'Runs'), compare),
    data.cluster_note ? note(`cluster: ${data.cluster_note}`, 'warn') : null,
    table(columns, data.runs, {
      empty: 'No runs yet: start one with `legorl run FILE`, or point the UI at a store (--store) or a cluster (--kube).',
      onRow: (r) => {
        location.hash = runRoute(r.id);
      },
    }),
    data.runs.some((r) => r.store_note)
      ? card('Stores the UI cannot read', h('ul', null, data.runs.filter((r) => r.store_note).map((r) => h('li', null, `${r.name}: ${r.store_note}`))))
      : null,
  );
}

export async function compareView(ids) {
  const data = await get('api/compare', { runs: ids.join(',') });
  const runs = data.runs;
  const color = (i) => PALETTE[i % PALETTE.length];
  const summary = table(
    [
      { label: 'Run', value: (r) => h('span', null, h('i', { class: 'swatch', style: { background: color(runs.indexOf(r)) } }), link(r.run.name, runRoute(r.run.id))) },
      { label: 'Phase', value: (r) => phaseBadge(r.run.phase) },
      { label: 'Step', class: 'n', value: (r) => String(r.run.step ?? '–') },
      { label: 'Reward', class: 'n', value: (r) => num(r.run.reward_mean) },
      { label: 'Held-out', class: 'n', value: (r) => `${num(r.run.held_out)}${interval(r.run.held_out_interval)}` },
      { label: 'Baseline', class: 'n', value: (r) => num(r.run.baseline) },
      { label: 'Fidelity', class: 'n', value: (r) => num(r.run.fidelity, 4) },
      { label: 'Trials/min', class: 'n', value: (r) => num(r.run.trials_per_minute, 1) },
    ],
    runs,
  );
  const keys = [];
  const labels = {};
  const groups = {};
  for (const r of runs) {
    for (const s of (r.curves || { series: [] }).series) {
      if (!keys.includes(s.key)) keys.push(s.key);
      labels[s.key] = s.label;
      groups[s.key] = s.group;
    }
  }
  const overlay = (key) =>
    lineChart({
      title: labels[key],
      series: runs.map((r, i) => {
        const s = ((r.curves && r.curves.series) || []).find((x) => x.key === key);
        return { name: r.run.name, color: color(i), points: s ? s.points : [] };
      }),
    });
  const charts = [
    lineChart({
      title: 'Held-out solve rate',
      series: runs.map((r, i) => ({
        name: r.run.name,
        color: color(i),
        points: ((r.curves && r.curves.held_out) || []).filter((e) => e.rate !== null).map((e) => [e.step, e.rate]),
      })),
      yDomain: [0, 1],
    }),
    ...keys.filter((k) => groups[k] !== 'other').map(overlay),
  ];
  const others = keys.filter((k) => groups[k] === 'other');
  return h(
    'div',
    { class: 'view', dataset: { view: 'compare' } },
    h('h2', null, `Compare ${runs.length} runs`),
    card('Summary', summary),
    h('div', { class: 'charts' }, charts),
    others.length
      ? h('details', { class: 'card' }, h('summary', null, `Other trainer figures (${others.length})`), h('div', { class: 'charts' }, others.map(overlay)))
      : null,
  );
}
