// Where the data comes from: the UI's JSON API (relative URLs, so any path prefix works), or the JSON
// embedded in a static export (`legorl ui export`), answered here with the server's own semantics.

export class ApiError extends Error {
  constructor(message, status, param) {
    super(message);
    this.status = status;
    this.param = param;
  }
}

function embedded() {
  const node = document.getElementById('legorl-data');
  if (!node) return null;
  return JSON.parse(node.textContent);
}

export const STATIC = embedded();

function query(params) {
  const parts = [];
  for (const [k, v] of Object.entries(params || {})) {
    if (v === null || v === undefined || v === '') continue;
    parts.push(`${encodeURIComponent(k)}=${encodeURIComponent(v)}`);
  }
  return parts.length ? `?${parts.join('&')}` : '';
}

function staticTrials(runId, p) {
  const rows = (STATIC.trials || {})[runId];
  if (!rows) throw new ApiError(`no trials of ${runId} in this export`, 404, null);
  const reasons = p.reason ? String(p.reason).split(',') : [];
  const q = p.q ? String(p.q).toLowerCase() : null;
  let out = rows.filter((r) => {
    if (p.split && r.split !== p.split) return false;
    if (p.step !== undefined && p.step !== '' && p.step !== null && r.step !== Number(p.step)) return false;
    if (p.task && r.task_id !== p.task) return false;
    if (p.group && r.group_id !== p.group) return false;
    if (reasons.length && !reasons.includes(r.termination_reason)) return false;
    if (p.tampered === 'true' && !r.tamper_findings.length) return false;
    if (p.tampered === 'false' && r.tamper_findings.length) return false;
    if (p.min_reward !== undefined && p.min_reward !== '' && (r.reward === null || r.reward < Number(p.min_reward))) return false;
    if (p.max_reward !== undefined && p.max_reward !== '' && (r.reward === null || r.reward > Number(p.max_reward))) return false;
    if (q && !r.trial.toLowerCase().includes(q) && !r.task_id.toLowerCase().includes(q)) return false;
    return true;
  });
  const sort = p.sort || 'step';
  const order = p.order || 'asc';
  if (sort !== 'step' || order !== 'asc') {
    const present = out.filter((r) => r[sort] !== null && r[sort] !== undefined);
    const missing = out.filter((r) => r[sort] === null || r[sort] === undefined);
    present.sort((a, b) => {
      const x = a[sort];
      const y = b[sort];
      const c = x < y ? -1 : x > y ? 1 : a.step - b.step || (a.trial < b.trial ? -1 : 1);
      return order === 'desc' ? -c : c;
    });
    out = present.concat(missing);
  }
  const offset = Number(p.offset || 0);
  const limit = Number(p.limit || 50);
  return { total: out.length, offset, limit, items: out.slice(offset, offset + limit) };
}

export async function get(path, params = {}) {
  if (STATIC) {
    const m = path.match(/^api\/runs\/([^/]+)\/trials$/);
    if (m) return staticTrials(decodeURIComponent(m[1]), params);
    const key = path + query(params);
    if (key in STATIC.responses) return STATIC.responses[key];
    if (path in STATIC.responses && !Object.keys(params).length) return STATIC.responses[path];
    throw new ApiError(
      'not included in this static export (exports hold the run\'s summaries and a sample of trajectories)',
      404,
      null,
    );
  }
  const response = await fetch(path + query(params), { headers: { Accept: 'application/json' } });
  let body = null;
  try {
    body = await response.json();
  } catch (err) {
    throw new ApiError(`${path}: HTTP ${response.status} (not JSON)`, response.status, null);
  }
  if (!response.ok) {
    const e = (body && body.error) || {};
    throw new ApiError(e.message || `HTTP ${response.status}`, response.status, e.param || null);
  }
  return body;
}

export async function post(path, token) {
  if (STATIC) throw new ApiError('a static export cannot act on runs', 405, null);
  const headers = { Accept: 'application/json' };
  if (token) headers.Authorization = `Bearer ${token}`;
  const response = await fetch(path, { method: 'POST', headers });
  let body = null;
  try {
    body = await response.json();
  } catch (err) {
    body = null;
  }
  if (!response.ok) {
    const e = (body && body.error) || {};
    throw new ApiError(e.message || `HTTP ${response.status}`, response.status, e.param || null);
  }
  return body;
}

export function runPath(runId, rest = '') {
  return `api/runs/${encodeURIComponent(runId)}${rest ? `/${rest}` : ''}`;
}
