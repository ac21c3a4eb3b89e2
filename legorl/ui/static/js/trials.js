// The trial list (filters, sorting, pages) and the trajectory viewer (turn by turn, token by token).
// Token text is model output: it only ever becomes text nodes.

import { get, runPath } from './api.js';
import { proportionBar } from './charts.js';
import { PALETTE, badge, card, clear, h, link, mix, note, num, reasonColor, runRoute, secs, table, when } from './dom.js';

const FILTERS = ['split', 'step', 'task', 'reason', 'tampered', 'min_reward', 'max_reward', 'q', 'sort', 'order', 'offset', 'limit'];

export async function trialsView(ctx, runId, params) {
  const state = {};
  for (const k of FILTERS) if (params.get(k) !== null) state[k] = params.get(k);
  state.limit = state.limit || '50';
  const go = (changes) => {
    const next = { ...state, ...changes };
    if (!('offset' in changes)) next.offset = '0';
    const q = Object.entries(next)
      .filter(([, v]) => v !== '' && v !== null && v !== undefined)
      .map(([k, v]) => `${encodeURIComponent(k)}=${encodeURIComponent(v)}`)
      .join('&');
    location.hash = runRoute(runId, 'trials', q);
  };
  const data = await get(runPath(runId, 'trials'), state);
  const reasons = ctx.info.reasons || [];
  const select = (name, options, label) =>
    h(
      'label',
      null,
      label,
      h(
        'select',
        { name, onchange: (ev) => go({ [name]: ev.target.value }) },
        options.map(([value, text]) => h('option', { value, selected: (state[name] || '') === value }, text)),
      ),
    );
  const input = (name, label, attrs = {}) => {
    const el = h('input', { name, value: state[name] || '', ...attrs });
    el.addEventListener('change', () => go({ [name]: el.value }));
    return h('label', null, label, el);
  };
  const filters = h(
    'form',
    { class: 'filters', onsubmit: (ev) => ev.preventDefault() },
    select('split', [['', 'all'], ['train', 'train'], ['validation', 'held-out']], 'Split '),
    input('step', 'Step ', { type: 'number', min: '0', class: 'short' }),
    input('task', 'Task ', { placeholder: 'task id' }),
    select('reason', [['', 'any']].concat(reasons.map((r) => [r, r])), 'Reason '),
    select('tampered', [['', 'any'], ['true', 'with findings'], ['false', 'clean']], 'Tamper '),
    input('min_reward', 'Reward ≥ ', { type: 'number', step: 'any', class: 'short' }),
    input('max_reward', '≤ ', { type: 'number', step: 'any', class: 'short' }),
    input('q', 'Search ', { placeholder: 'trial or task' }),
    h('button', { type: 'button', class: 'btn', onclick: () => (location.hash = runRoute(runId, 'trials')) }, 'Clear'),
  );
  const sort = { key: state.sort || 'step', order: state.order || 'asc' };
  const onSort = (key) => go({ sort: key, order: sort.key === key && sort.order === 'asc' ? 'desc' : 'asc' });
  const columns = [
    { label: 'Trial', sort: 'trial', value: (r) => link(r.trial, runRoute(runId, `trial/${encodeURIComponent(r.trial)}`)) },
    { label: 'Split', value: (r) => (r.split === 'train' ? 'train' : 'held-out') },
    { label: 'Step', sort: 'step', class: 'n', value: (r) => String(r.step) },
    { label: 'Task', sort: 'task_id', value: (r) => r.task_id },
    { label: 'Reason', sort: 'termination_reason', value: (r) => h('span', { class: 'reason', style: { 'border-color': reasonColor(r.termination_reason) } }, r.termination_reason) },
    { label: 'Reward', sort: 'reward', class: 'n', value: (r) => num(r.reward) },
    { label: 'Turns', sort: 'num_turns', class: 'n', value: (r) => String(r.num_turns) },
    { label: 'Duration', sort: 'duration', class: 'n', value: (r) => secs(r.duration) },
    { label: 'Policy', value: (r) => r.policy_versions.join(', ') },
    { label: 'Tamper', value: (r) => (r.tamper_findings.length ? badge(`${r.tamper_findings.length} finding(s)`, 'bad') : '') },
  ];
  const offset = data.offset;
  const end = Math.min(data.total, offset + data.items.length);
  const pager = h(
    'div',
    { class: 'pager' },
    h('button', { class: 'btn', disabled: offset <= 0, onclick: () => go({ offset: String(Math.max(0, offset - data.limit)) }) }, '← Previous'),
    h('span', { class: 'count' }, data.total ? `${offset + 1}–${end} of ${data.total}` : '0 trials'),
    h('button', { class: 'btn', disabled: end >= data.total, onclick: () => go({ offset: String(offset + data.limit) }) }, 'Next →'),
  );
  return h(
    'div',
    { class: 'view', dataset: { view: 'trials' } },
    filters,
    pager,
    table(columns, data.items, {
      empty: 'no trial matches these filters',
      sort,
      onSort,
      onRow: (r) => {
        location.hash = runRoute(runId, `trial/${encodeURIComponent(r.trial)}`);
      },
    }),
  );
}

// --- trajectory -------------------------------------------------------------------------------------

const MODES = {
  mask: 'Loss mask (sampled by the policy)',
  logprob: 'Behaviour log-prob',
  delta: 'Training − rollout log-prob',
  experts: 'Routed expert (layer 0, top-1)',
};

function tokenColor(mode, t) {
  if (mode === 'mask') return t.mask ? '#dcebfb' : null;
  if (mode === 'logprob') {
    if (!t.mask) return null;
    const p = Math.exp(t.lp);
    return p >= 0.5 ? mix('#fdf1c4', '#b7e1c1', (p - 0.5) * 2) : mix('#f4a9a3', '#fdf1c4', p * 2);
  }
  if (mode === 'delta') {
    if (t.train === null || t.train === undefined || !t.mask) return null;
    return mix('#ffffff', '#e0604f', Math.min(1, Math.abs(t.train - t.lp) * 2));
  }
  if (mode === 'experts') {
    if (!t.experts || !t.experts.length) return null;
    return mix('#ffffff', PALETTE[t.experts[0][0] % PALETTE.length], 0.45);
  }
  return null;
}

function inspectorFor(tok) {
  const rows = [
    ['index', String(tok.i)],
    ['token id', String(tok.id)],
    ['text', JSON.stringify(tok.text)],
    ['sampled', tok.mask ? 'yes (in the loss)' : 'no (context)'],
  ];
  if (tok.mask) {
    rows.push(['behaviour log-prob', num(tok.lp, 5)]);
    rows.push(['probability', num(Math.exp(tok.lp), 4)]);
  }
  if (tok.train !== null && tok.train !== undefined) rows.push(['training log-prob', num(tok.train, 5)]);
  if (tok.experts) tok.experts.forEach((e, l) => rows.push([`layer ${l} experts`, e.join(', ')]));
  return h('dl', { class: 'kv' }, rows.map(([k, v]) => [h('dt', null, k), h('dd', null, v)]));
}

function renderTokens(part, mode, tokens, collapsedLimit) {
  const box = h('div', { class: `tokens ${part.kind}` });
  const n = part.ids.length;
  const shown = collapsedLimit && n > collapsedLimit ? collapsedLimit : n;
  const frag = document.createDocumentFragment();
  const start = part.kind === 'context' && shown < n ? n - shown : 0;
  if (start > 0) {
    const more = h('button', { class: 'btn small more' }, `show ${start} earlier context tokens`);
    more.addEventListener('click', () => box.replaceWith(renderTokens(part, mode, tokens, 0)));
    frag.appendChild(more);
  }
  for (let j = start; j < n; j++) {
    const tok = {
      i: part.start + j,
      id: part.ids[j],
      text: part.text ? part.text[j] : `⟨${part.ids[j]}⟩`,
      mask: part.mask[j],
      lp: part.logprobs[j],
      train: part.train ? part.train[j] : null,
      experts: part.experts ? part.experts[j] : null,
    };
    const idx = tokens.push(tok) - 1;
    const span = document.createElement('span');
    span.className = tok.mask ? 'tok s' : 'tok';
    span.dataset.t = String(idx);
    span.textContent = tok.text;
    const color = tokenColor(mode, tok);
    if (color) span.style.backgroundColor = color;
    frag.appendChild(span);
  }
  box.appendChild(frag);
  return box;
}

export async function trajectoryView(ctx, runId, trialId) {
  const data = await get(runPath(runId, `trials/${encodeURIComponent(trialId)}`));
  const t = data.trial;
  const hasRouting = data.segments.some((s) => s.routing);
  const hasTrain = data.segments.some((s) => s.training_logprobs);
  let mode = 'mask';
  const inspector = h('aside', { class: 'inspector' }, note('hover a token to inspect it', 'muted'));
  const body = h('div', { class: 'turns' });
  const tokens = [];
  const stageColors = ['#c7a72a', '#5aa2c9', '#a8629e', '#3d6fb6', '#2e9d57', '#8a6d3b'];
  const draw = () => {
    clear(body);
    tokens.length = 0;
    for (const seg of data.segments) {
      body.appendChild(
        h('h4', { class: 'segment' }, `Segment ${seg.index}: ${seg.tokens} tokens, ${seg.sampled} sampled, policy ${seg.policy_versions.join(', ')}`, seg.routing ? ` · routing ${seg.routing.layers} layers × top-${seg.routing.top_k}` : ''),
      );
      seg.turns.forEach((turn, k) => {
        const head = h(
          'header',
          null,
          h('strong', null, turn.turn === null ? 'Trailing context' : `Turn ${turn.turn}`),
          turn.tokens ? h('small', null, ` ${turn.tokens} sampled tokens, mean log-prob ${num(turn.mean_logprob, 3)}`) : null,
        );
        const calls = turn.tool_calls.length
          ? h(
              'div',
              { class: 'toolcalls' },
              turn.tool_calls.map((c) =>
                h('details', { class: 'toolcall' }, h('summary', null, badge(c.name || 'unparsed tool call', c.valid ? 'info' : 'warn')), h('pre', { class: 'code' }, c.arguments || '')),
              ),
            )
          : null;
        body.appendChild(
          h(
            'article',
            { class: 'turn', dataset: { turn: String(turn.turn ?? k) } },
            head,
            turn.parts.map((p) => h('div', { class: 'part' }, h('span', { class: 'part-label' }, p.kind === 'context' ? 'context (shown to the model)' : 'completion (sampled)'), renderTokens(p, mode, tokens, p.kind === 'context' ? 400 : 0))),
            calls,
          ),
        );
      });
    }
    if (!data.segments.length) body.appendChild(note('this trial recorded no model turns (it ended before the first call)', 'muted'));
  };
  body.addEventListener('mouseover', (ev) => {
    const span = ev.target.closest('.tok');
    if (!span) return;
    const tok = tokens[Number(span.dataset.t)];
    if (tok) {
      clear(inspector).appendChild(inspectorFor(tok));
    }
  });
  const modeSelect = h(
    'select',
    {
      name: 'mode',
      onchange: (ev) => {
        mode = ev.target.value;
        draw();
      },
    },
    Object.entries(MODES).map(([k, label]) =>
      h('option', { value: k, disabled: (k === 'delta' && !hasTrain) || (k === 'experts' && !hasRouting) }, label),
    ),
  );
  const stages = Object.entries(t.stage_seconds || {});
  const header = card(
    `Trial ${t.trial}`,
    h(
      'dl',
      { class: 'kv wide' },
      [
        ['Task', link(t.task_id, runRoute(runId, 'trials', `task=${encodeURIComponent(t.task_id)}`))],
        ['Split / step', `${t.split === 'train' ? 'train' : 'held-out'} / ${t.step}`],
        ['Group', t.group_id],
        ['Reason', h('span', { class: 'reason', style: { 'border-color': reasonColor(t.termination_reason) } }, t.termination_reason)],
        ['Reward', num(t.reward)],
        ['Turns', String(t.num_turns)],
        ['Merged turn share', num(t.merged_turn_share)],
        ['Policy versions', t.policy_versions.join(', ') || '–'],
        ['Harness', t.harness],
        ['Started', when(t.started_at)],
        ['Duration', secs(t.duration)],
        ['Tokenizer', data.tokenizer || 'none found: token ids shown'],
      ].map(([k, v]) => [h('dt', null, k), h('dd', null, v)]),
    ),
    t.error ? h('pre', { class: 'code error' }, t.error) : null,
  );
  const stageCard = card(
    'Sandbox stage timings',
    stages.length
      ? [
          proportionBar(stages.map(([k, v], i) => ({ label: k, value: v, color: stageColors[i % stageColors.length] })), { unit: secs }),
          h('dl', { class: 'kv' }, stages.map(([k, v]) => [h('dt', null, k), h('dd', null, secs(v))])),
        ]
      : note('no stage timings recorded', 'muted'),
  );
  const tamperCard = card(
    'Tamper findings',
    t.tamper_findings.length
      ? table(
          [
            { label: 'Kind', value: (f) => badge(f.kind, 'bad') },
            { label: 'Path', value: (f) => f.path || '–' },
            { label: 'Detail', value: (f) => f.detail },
          ],
          t.tamper_findings,
        )
      : note('none: the verifier saw no attempt to game the reward', 'ok'),
  );
  draw();
  return h(
    'div',
    { class: 'view', dataset: { view: 'trajectory' } },
    header,
    h('div', { class: 'grid2' }, stageCard, tamperCard),
    card(
      'Trajectory',
      h(
        'div',
        { class: 'toolbar' },
        h('label', null, 'Colour tokens by ', modeSelect),
        h('span', { class: 'legend' }, h('span', null, h('i', { class: 'key-s' }), 'sampled'), h('span', null, h('i', { class: 'key-c' }), 'context')),
      ),
      data.training_logprobs_note ? note(data.training_logprobs_note, 'muted') : null,
      data.truncated ? note('very long trajectory: only the first 200,000 tokens are shown', 'warn') : null,
      h('div', { class: 'traj' }, body, inspector),
    ),
  );
}
