// One run's views: overview, curves, outcomes, task grid, fleet, sandboxes, diagnostics.

import { STATIC, get, post, runPath } from './api.js';
import { lineChart, proportionBar, stackedBars } from './charts.js';
import {
  PALETTE,
  REASON_COLORS,
  badge,
  card,
  conditionChip,
  h,
  interval,
  link,
  note,
  num,
  pct,
  phaseBadge,
  reasonColor,
  rewardColor,
  runRoute,
  secs,
  table,
  when,
} from './dom.js';

function kv(pairs) {
  return h(
    'dl',
    { class: 'kv' },
    pairs.filter(Boolean).map(([k, v]) => [h('dt', null, k), h('dd', null, v === null || v === undefined ? '–' : v)]),
  );
}

function actionBar(ctx, data) {
  if (STATIC || !ctx.info.actions_enabled || data.run.source !== 'cluster') return null;
  const out = h('span', { class: 'status-line' });
  const act = (name) =>
    h(
      'button',
      {
        class: 'btn',
        dataset: { action: name },
        onclick: async () => {
          out.textContent = `${name}…`;
          try {
            await post(runPath(data.run.id, `actions/${name}`), ctx.token());
            out.textContent = `${name}: done`;
          } catch (err) {
            out.textContent = `${name}: ${err.message}`;
          }
        },
      },
      name[0].toUpperCase() + name.slice(1),
    );
  return h('div', { class: 'actions' }, act('pause'), act('resume'), act('validate'), out);
}

function conditionTimeline(conditions) {
  if (!conditions.length) return note('no conditions reported', 'muted');
  const sorted = conditions.slice().sort((a, b) => String(b.lastTransitionTime || '').localeCompare(String(a.lastTransitionTime || '')));
  return h(
    'ol',
    { class: 'timeline' },
    sorted.map((c) =>
      h(
        'li',
        { class: `t-${c.status === 'True' ? (['Degraded', 'Failed'].includes(c.type) ? 'bad' : 'ok') : c.status === 'False' ? 'off' : 'unknown'}` },
        h('time', null, when(c.lastTransitionTime)),
        h('div', null, conditionChip(c), ' ', h('strong', null, c.reason || ''), c.source === 'store' ? h('small', null, ' (from the run store)') : null),
        c.message ? h('p', null, c.message) : null,
      ),
    ),
  );
}

function resultBadge(result) {
  const kind = { Passed: 'ok', Warning: 'warn', Failed: 'bad' }[result] || 'muted';
  return badge(result || '–', kind);
}

function validationCard(run, v) {
  const how =
    run.source === 'cluster'
      ? 'no canary yet: the Validate action (or `kubectl annotate rlrun NAME legorl.dev/validate-requested=$(date -u +%FT%TZ)`) runs one'
      : 'no canary yet: `legorl run FILE --canary` runs one';
  if (!v) return card('Validation (canary)', h('p', { class: 'muted' }, how));
  return card(
    'Validation (canary)',
    h(
      'div',
      { dataset: { validation: v.state || '' } },
      kv([
        ['Result', resultBadge(v.state)],
        v.requested ? ['Requested', v.requested] : null,
        ['When', when(v.time)],
        v.trial ? ['Trial', v.trial] : null,
        v.message ? ['Message', v.message] : null,
      ]),
      table(
        [
          { label: 'Check', value: (r) => r.check },
          { label: 'Result', value: (r) => resultBadge(r.result) },
          { label: 'Message', value: (r) => r.message || '' },
        ],
        v.checks || [],
        { empty: v.state === 'Pending' || v.state === 'Running' ? 'checks appear when it ends' : 'no checks recorded' },
      ),
    ),
  );
}

export async function overviewView(ctx, runId) {
  const data = await get(runPath(runId));
  const run = data.run;
  const p = data.progress || {};
  const conditions = data.conditions || run.conditions || [];
  const batches = data.batches || [];
  const evals = data.evals || [];
  const spec = data.spec;
  return h(
    'div',
    { class: 'view', dataset: { view: 'overview' } },
    actionBar(ctx, data),
    h(
      'div',
      { class: 'grid2' },
      card(
        'Status',
        kv([
          ['Phase', phaseBadge(run.phase)],
          ['Step', `${run.step ?? '–'}${run.max_steps ? ` of ${run.max_steps}` : ''}`],
          ['Policy version', run.policy_version || '–'],
          ['Reward (last step)', num(run.reward_mean)],
          ['Held-out solve rate', `${num(run.held_out)}${interval(run.held_out_interval)}`],
          ['Held-out at start', num(run.baseline)],
          ['Fidelity (Pearson)', num(run.fidelity, 5)],
          ['Trials', `${run.trials_total ?? '–'} done, ${run.trials_running ?? 0} running`],
          ['Trials/min', num(run.trials_per_minute, 2)],
          ['Elapsed', secs(p.elapsed_seconds)],
          ['Store', data.store || run.store_note || '–'],
          run.message ? ['Message', run.message] : null,
        ]),
      ),
      card('Conditions', conditionTimeline(conditions)),
    ),
    card(
      'Preflight',
      table(
        [
          { label: 'Check', value: (r) => r.check },
          { label: 'Result', value: (r) => badge(r.result, r.result === 'Passed' ? 'ok' : r.result === 'Warning' ? 'warn' : 'bad') },
          { label: 'Message', value: (r) => r.message || '' },
        ],
        data.preflight || [],
        { empty: run.source === 'cluster' ? 'no preflight results reported yet' : 'preflight results are reported on RLRun status (cluster runs); `legorl validate FILE` runs them locally' },
      ),
    ),
    validationCard(run, data.validation),
    card(
      'Training steps',
      table(
        [
          { label: 'Step', class: 'n', value: (b) => link(String(b.step), runRoute(runId, 'trials', `split=train&step=${b.step}`)) },
          { label: 'From policy', value: (b) => b.policy_version },
          { label: 'Trials', class: 'n', value: (b) => String(b.num_trials) },
          { label: 'Kept', class: 'n', value: (b) => String(b.meta.kept ?? '–') },
          { label: 'Reward', class: 'n', value: (b) => num(b.meta.reward_mean) },
          { label: 'Zero-var groups', class: 'n', value: (b) => `${b.meta.zero_variance_groups ?? '–'} / ${b.meta.groups ?? '–'}` },
          { label: 'Infra failures', class: 'n', value: (b) => String(b.meta.infra_failures ?? 0) },
          { label: 'Committed', value: (b) => when(b.created_at) },
        ],
        batches,
        { empty: 'no committed step yet' },
      ),
    ),
    card(
      'Held-out evaluations',
      table(
        [
          { label: 'Policy', value: (e) => link(e.policy_version || `v${e.step}`, runRoute(runId, 'trials', `split=validation&step=${e.step}`)) },
          { label: 'Solve rate', class: 'n', value: (e) => `${num(e.solve_rate)}${interval(e.interval95)}` },
          { label: 'Solved / scored', class: 'n', value: (e) => `${e.solved ?? '–'} / ${e.scored ?? '–'}` },
          { label: 'Infra failures', class: 'n', value: (e) => String(e.infra_failures ?? 0) },
        ],
        evals,
        { empty: 'no evaluation finished yet' },
      ),
    ),
    run.source === 'cluster'
      ? card(
          'Events',
          table(
            [
              { label: 'Time', value: (e) => when(e.time) },
              { label: 'Object', value: (e) => `${e.kind}/${e.object}` },
              { label: 'Type', value: (e) => badge(e.type || '', e.type === 'Warning' ? 'warn' : 'muted') },
              { label: 'Reason', value: (e) => e.reason || '' },
              { label: 'Message', value: (e) => e.message || '' },
            ],
            data.events || [],
            { empty: 'no events' },
          ),
        )
      : null,
    card(
      'Resolved spec',
      spec
        ? h('details', null, h('summary', null, 'show the RLRun as recorded'), h('pre', { class: 'code' }, JSON.stringify(spec, null, 2)))
        : note('the store has no run.json', 'muted'),
    ),
  );
}

export async function curvesView(ctx, runId) {
  const data = await get(runPath(runId, 'curves'));
  const charts = [];
  const held = data.held_out || [];
  charts.push(
    lineChart({
      title: 'Held-out solve rate',
      series: [{ name: 'solve rate', points: held.filter((e) => e.rate !== null).map((e) => [e.step, e.rate]), color: PALETTE[2] }],
      band: held.map((e) => ({ x: e.step, low: e.low, high: e.high })),
      yDomain: [0, 1],
    }),
  );
  const groups = {};
  for (const s of data.series) (groups[s.group] = groups[s.group] || []).push(s);
  const order = ['reward', 'policy', 'fidelity', 'optimizer', 'throughput', 'other'];
  const sections = [];
  for (const g of order) {
    if (!groups[g]) continue;
    const items = groups[g].map((s, i) => lineChart({ title: s.label, series: [{ name: s.label, points: s.points, color: PALETTE[(i + order.indexOf(g)) % PALETTE.length] }] }));
    if (g === 'reward') items.unshift(charts.pop());
    sections.push(
      g === 'other'
        ? h('details', { class: 'card' }, h('summary', null, `Other trainer figures (${items.length})`), h('div', { class: 'charts' }, items))
        : card(g[0].toUpperCase() + g.slice(1), h('div', { class: 'charts' }, items)),
    );
  }
  if (charts.length) sections.unshift(card('Held-out', h('div', { class: 'charts' }, charts)));
  return h('div', { class: 'view', dataset: { view: 'curves' } }, data.series.length || held.length ? sections : note('no trainer metrics or evaluations yet', 'muted'));
}

export async function outcomesView(ctx, runId) {
  const data = await get(runPath(runId, 'outcomes'));
  const steps = data.steps;
  const values = {};
  for (const s of steps) values[s.step] = s.by_reason;
  const evalValues = {};
  for (const e of data.evals) evalValues[e.step] = e.by_reason;
  return h(
    'div',
    { class: 'view', dataset: { view: 'outcomes' } },
    card(
      'Termination reasons per training step',
      stackedBars({ title: 'Trials by termination reason', xs: steps.map((s) => s.step), keys: data.reasons, values, colors: reasonColor }),
      h(
        'div',
        { class: 'charts' },
        lineChart({ title: 'Dropped share (filtered out of the loss)', series: [{ name: 'dropped', points: steps.filter((s) => s.dropped_share !== null).map((s) => [s.step, s.dropped_share]) }], yDomain: [0, 1] }),
        lineChart({
          title: 'Zero-variance groups',
          series: [{ name: 'zero-variance', points: steps.filter((s) => s.zero_variance_groups !== null).map((s) => [s.step, s.zero_variance_groups]), color: PALETTE[4] }],
        }),
      ),
      note(`Dropped from the loss: ${data.drop_reasons.join(', ')} (spec.filter.dropReasons). Infra failures never train the policy; they stay in the store for this page.`, 'muted'),
    ),
    card(
      'Per step',
      table(
        [
          { label: 'Step', class: 'n', value: (s) => link(String(s.step), runRoute(runId, 'trials', `split=train&step=${s.step}`)) },
          { label: 'Trials', class: 'n', value: (s) => String(s.trials) },
          { label: 'By reason', value: (s) => h('span', { class: 'chips' }, Object.entries(s.by_reason).map(([k, v]) => h('span', { class: 'chip', style: { 'border-color': REASON_COLORS[k] || '#888' } }, `${k} ${v}`))) },
          { label: 'Dropped', class: 'n', value: (s) => pct(s.dropped_share) },
          { label: 'Zero-var groups', class: 'n', value: (s) => `${s.zero_variance_groups ?? '–'} / ${s.groups ?? '–'}` },
          { label: 'State', value: (s) => (s.committed ? badge('committed', 'ok') : badge('in progress', 'muted')) },
        ],
        steps,
        { empty: 'no training trials yet' },
      ),
    ),
    card(
      'Held-out evaluations',
      stackedBars({ title: 'Held-out trials by termination reason', xs: data.evals.map((e) => e.step), keys: data.reasons, values: evalValues, colors: reasonColor, xLabel: 'policy version' }),
    ),
  );
}

function grid(runId, split, g) {
  if (!g.tasks.length) return note(`no ${split} trials yet`, 'muted');
  const head = h('tr', null, h('th', null, 'Task'), g.steps.map((s) => h('th', { class: 'n' }, split === 'validation' ? `v${s}` : String(s))), h('th', { class: 'n' }, 'Mean'));
  const rows = g.tasks.map((t) =>
    h(
      'tr',
      null,
      h('td', { class: 'task' }, link(t.task, runRoute(runId, 'trials', `task=${encodeURIComponent(t.task)}&split=${split}`))),
      g.steps.map((s) => {
        const c = t.cells[String(s)];
        if (!c) return h('td', { class: 'cell empty' }, '');
        return h(
          'td',
          { class: 'cell', style: { background: rewardColor(c.mean) }, title: `${t.task} @ ${s}: mean reward ${num(c.mean)} over ${c.scored}/${c.n} scored trials (${c.solved} solved)` },
          link(c.mean === null ? '–' : num(c.mean, 2), runRoute(runId, 'trials', `task=${encodeURIComponent(t.task)}&split=${split}&step=${s}`)),
        );
      }),
      h('td', { class: 'n' }, num(t.mean, 2)),
    ),
  );
  return h('div', { class: 'table-wrap' }, h('table', { class: 'grid' }, h('thead', null, head), h('tbody', null, rows)));
}

export async function tasksView(ctx, runId) {
  const data = await get(runPath(runId, 'tasks'));
  return h(
    'div',
    { class: 'view', dataset: { view: 'tasks' } },
    card('Held-out tasks: solve rate by policy version', grid(runId, 'validation', data.validation)),
    card('Training tasks: mean reward by step', grid(runId, 'train', data.train)),
  );
}

export async function fleetView(ctx, runId) {
  const data = await get(runPath(runId, 'fleet'));
  const facts = kv([
    ['Served policy version', data.served_policy_version || '–'],
    ['Trainer at', data.trainer_policy_version || '–'],
    ['Published versions', (data.published_versions || []).join(', ') || '–'],
    data.spec_replicas !== undefined ? ['Replicas (ready / desired)', `${data.ready_replicas ?? 0} / ${data.spec_replicas}`] : null,
  ]);
  return h(
    'div',
    { class: 'view', dataset: { view: 'fleet' } },
    data.available ? null : note(data.note || 'fleet status not available', 'info'),
    card(data.name ? `RolloutFleet ${data.name}` : 'Policy versions', facts, data.conditions ? h('div', { class: 'chips' }, data.conditions.map(conditionChip)) : null),
    data.available
      ? card(
          'Replicas',
          table(
            [
              { label: 'Replica', value: (r) => r.name || '–' },
              { label: 'Ready', value: (r) => (r.ready === null || r.ready === undefined ? '–' : r.ready ? badge('ready', 'ok') : badge('not ready', 'bad')) },
              { label: 'Policy version', value: (r) => r.policy_version || '–' },
              { label: 'Running', class: 'n', value: (r) => num(r.running, 0) },
              { label: 'Queued', class: 'n', value: (r) => num(r.waiting, 0) },
              { label: 'KV cache', class: 'n', value: (r) => pct(r.kv_usage) },
              { label: 'Node', value: (r) => r.node || '–' },
              { label: 'Restarts', class: 'n', value: (r) => String(r.restarts ?? '–') },
              { label: 'Note', value: (r) => r.metrics_note || '' },
            ],
            data.replicas,
            { empty: 'no replicas' },
          ),
        )
      : null,
  );
}

export async function sandboxesView(ctx, runId) {
  const data = await get(runPath(runId, 'sandboxes'));
  const stats = data.stage_stats || {};
  const stageOrder = ['setup', 'proxy_start', 'agent_start', 'agent', 'verify'];
  const names = Object.keys(stats).sort((a, b) => (stageOrder.indexOf(a) + 99 * (stageOrder.indexOf(a) < 0)) - (stageOrder.indexOf(b) + 99 * (stageOrder.indexOf(b) < 0)));
  const parts = [];
  if (data.available) {
    const pool = data.pool;
    const stageColors = { scheduling: '#9aa0a6', setup: '#c7a72a', agent: '#3d6fb6', verify: '#a8629e', done: '#2e9d57', failed: '#b3261e' };
    parts.push(
      card(
        'Trial pods by stage',
        proportionBar(Object.entries(data.stages || {}).map(([k, v]) => ({ label: `${k} ${v}`, value: v, color: stageColors[k] || '#888' })), { unit: (v) => `${v} pods` }),
        kv(Object.entries(data.stages || {}).map(([k, v]) => [k, String(v)])),
      ),
    );
    if (pool) {
      const ratio = pool.images_desired ? pool.images_cached / pool.images_desired : null;
      parts.push(
        card(
          `SandboxPool ${pool.name}`,
          h('div', { class: 'chips' }, pool.conditions.map(conditionChip)),
          kv([
            ['Images cached', `${pool.images_cached} / ${pool.images_desired}`],
            ['Pre-pull progress', ratio === null ? '–' : h('progress', { value: String(pool.images_cached), max: String(pool.images_desired) })],
            ['Warm sandboxes (ready / leased / desired)', `${pool.ready_replicas} / ${pool.leased_replicas} / ${pool.replicas}`],
            ['Defense self-test', badge(pool.self_test.result || 'Pending', pool.self_test.result === 'Passed' ? 'ok' : pool.self_test.result === 'Failed' ? 'bad' : 'muted')],
          ]),
          table(
            [
              { label: 'Check', value: (c) => c.name },
              { label: 'Result', value: (c) => badge(c.result, c.result === 'Passed' ? 'ok' : 'bad') },
              { label: 'Message', value: (c) => c.message || '' },
            ],
            (pool.self_test.checks || []).slice().sort((a, b) => (a.result === 'Failed' ? -1 : 0) - (b.result === 'Failed' ? -1 : 0)),
            { empty: 'no self-test checks reported yet' },
          ),
        ),
        card(
          'Images per node',
          table(
            [
              { label: 'Node', value: (n) => n.name },
              { label: 'Cached', class: 'n', value: (n) => `${n.pulled} / ${n.desired}` },
              { label: 'Progress', value: (n) => h('progress', { value: String(n.pulled), max: String(Math.max(1, n.desired)) }) },
              { label: 'Failed', class: 'n', value: (n) => String(n.failed || 0) },
              { label: 'Failures', value: (n) => (n.failures || []).map((f) => `${f.image}: ${f.reason}`).join('; ') },
            ],
            pool.nodes,
            { empty: 'no node reports yet' },
          ),
        ),
      );
    } else if (data.pool_note) {
      parts.push(note(data.pool_note, 'warn'));
    }
    parts.push(
      card(
        'Trial pods',
        table(
          [
            { label: 'Pod', value: (p) => p.name },
            { label: 'Trial', value: (p) => (p.trial ? link(p.trial, runRoute(runId, `trial/${encodeURIComponent(p.trial)}`)) : '–') },
            { label: 'Stage', value: (p) => p.stage },
            { label: 'Node', value: (p) => p.node || '–' },
            { label: 'Started', value: (p) => when(p.started) },
          ],
          data.pods || [],
          { empty: 'no trial pods right now' },
        ),
      ),
    );
  } else {
    parts.push(note(data.note, 'info'));
  }
  parts.push(
    card(
      'Sandbox stage timings (all trials in the store)',
      table(
        [
          { label: 'Stage', value: (s) => s },
          { label: 'Trials', class: 'n', value: (s) => String(stats[s].n) },
          { label: 'p50', class: 'n', value: (s) => secs(stats[s].p50) },
          { label: 'p95', class: 'n', value: (s) => secs(stats[s].p95) },
          { label: 'max', class: 'n', value: (s) => secs(stats[s].max) },
        ],
        names,
        { empty: 'no stage timings recorded' },
      ),
    ),
  );
  return h('div', { class: 'view', dataset: { view: 'sandboxes' } }, parts);
}

export async function diagnosticsView(ctx, runId) {
  const data = await get(runPath(runId, 'diagnostics'));
  const sevKind = { critical: 'bad', warning: 'warn', info: 'muted' };
  const findings = data.findings || [];
  const parts = [];
  if (!data.available) parts.push(note(data.note || 'diagnostics not available', 'warn'));
  if (data.store_note) parts.push(note(`store: ${data.store_note}`, 'warn'));
  if (data.available && !findings.length) parts.push(note('No findings: every diagnostic rule passed on this run.', 'ok'));
  for (const f of findings) {
    parts.push(
      h(
        'section',
        { class: `card finding sev-${f.severity}`, dataset: { rule: f.rule } },
        h('h3', null, badge(f.severity, sevKind[f.severity] || 'muted'), ' ', f.title, h('small', null, ` ${f.rule}`)),
        h('p', null, f.summary),
        f.causes && f.causes.length ? h('div', null, h('h4', null, 'Plausible causes'), h('ul', null, f.causes.map((c) => h('li', null, c)))) : null,
        f.evidence && Object.keys(f.evidence).length
          ? h(
              'details',
              null,
              h('summary', null, 'Evidence'),
              h('dl', { class: 'kv' }, Object.entries(f.evidence).map(([k, v]) => [h('dt', null, k), h('dd', null, typeof v === 'string' ? v : JSON.stringify(v))])),
            )
          : null,
        f.steps && f.steps.length ? h('p', null, 'Steps: ', f.steps.map((s) => [link(String(s), runRoute(runId, 'trials', `step=${s}`)), ' '])) : null,
        f.trials && f.trials.length ? h('p', null, 'Trials: ', f.trials.slice(0, 30).map((t) => [link(t, runRoute(runId, `trial/${encodeURIComponent(t)}`)), ' '])) : null,
        f.next_step ? h('p', { class: 'next' }, h('strong', null, 'Next step: '), f.next_step) : null,
      ),
    );
  }
  return h('div', { class: 'view', dataset: { view: 'diagnostics' } }, parts);
}
