// @ts-check
// Where the charts' data comes from: the one module that knows the API's routes for it, and
// turns the server's documents into the shapes the charts draw (js/series.js). Every function
// here costs a fixed number of requests, whatever the run's size:
//
//   keyPage       GET /metrics/keys (a page), or /metrics (every key) for a regular expression
//   metricChart   GET /metrics/envelope: every label's line up to MAX_LINES labels, else the band,
//                 its outlying labels and the labels the user turned on (`label=`, each once)
//   systemFigures GET /system/keys: the system figures (GPU indices together), from the rollups
//   systemChart   GET /system/envelope: a figure's lines up to MAX_LINES, else its band and
//                 outlying lines, across every label or one host's
//   stragglers    GET /stragglers: step times per label and step bucket, slowest labels first
//   labelHardware GET /labels: each label's host, hardware, command line and git state (redacted)
//   compare*      the same, once per run compared
//   compareConfig GET /api/compare/config: the config keys on which the runs differ (redacted)

import { ApiError, api, runPath } from './api.js';
import { num } from './dom.js';
import { byName, linesFromSeriesDoc, MAX_LINES, OUTLIERS } from './series.js';

export const KEYS_PER_PAGE = 60;
const SERIES_POINTS = 2000;
const HEAT_BUCKETS = 120;
const MIN_DISTANCE = 0.05;    // band widths from the median: closer is no outlier
const MAX_SHOWN = 64;         // labels turned on that a chart asks for (the API's bound)
const LABELS_PAGE = 1000;
const LITERAL = /^[^.*+?()[\]{}|\\^$]*$/;

export function run(runId) {
  return api(runPath(runId));
}

// A regular expression from what the user typed; text that is not one is matched literally.
export function searchPattern(query) {
  if (!query) return { test: () => true, error: null };
  try {
    const re = new RegExp(query, 'i');
    return { test: (text) => re.test(text), error: null };
  } catch (error) {
    const needle = query.toLowerCase();
    return { test: (text) => text.toLowerCase().includes(needle), error: 'not a regular expression: matched as text' };
  }
}

// How the server can answer a search: plain text (`q`, any case), `^text` (a prefix), else the
// whole key list filtered here.
function serverSearch(query) {
  if (!query) return {};
  if (LITERAL.test(query)) return { q: query };
  if (query.startsWith('^') && LITERAL.test(query.slice(1)) && query.length > 1 && query.toLowerCase() === query) {
    return { prefix: query.slice(1) };
  }
  return null;
}

// One page of a run's metric keys matching `query`: {keys, total, all, offset, error}. One
// request (two for a search: the page, and the count of all keys).
export async function keyPage(runId, { query = '', offset = 0, limit = KEYS_PER_PAGE } = {}) {
  const server = serverSearch(query);
  if (server) {
    const [page, all] = await Promise.all([
      api(runPath(runId, '/metrics/keys'), { ...server, offset, limit }),
      query ? api(runPath(runId, '/metrics/keys'), { limit: 1 }) : null,
    ]);
    return { keys: page.keys, total: page.total, all: all ? all.total : page.total, offset: page.offset, error: null };
  }
  const { keys } = await api(runPath(runId, '/metrics'));
  const pattern = searchPattern(query);
  const matching = keys.filter(pattern.test);
  const start = Math.min(offset, Math.max(0, matching.length - 1));
  return { keys: matching.slice(start, start + limit), total: matching.length, all: keys.length, offset: start, error: pattern.error };
}

// -- the envelope document ------------------------------------------------------------------------

function columns(names) {
  return Object.fromEntries(names.map((name, index) => [name, index]));
}

// A band segment (one generation of the run) as an Envelope.
function envelopeFromBand(doc, segment) {
  const col = columns(doc.band_columns);
  const rows = segment.rows;
  const pick = (name) => rows.map((row) => num(row[col[name]]));
  const xs = rows.map((row) => row[col.x1]);
  return {
    step: doc.x === 'step' ? xs : null,
    ts: doc.x === 'ts' ? xs : null,
    count: rows.map((row) => row[col.n]),
    min: pick('min'), p10: pick('p10'), median: pick('p50'), p90: pick('p90'), max: pick('max'), mean: pick('mean'),
    gaps: segment.gaps || [],
    generation: segment.generation,
    labels: doc.labels,
  };
}

// The document's lines as Lines, a segment per epoch.
function linesFromEnvelope(doc) {
  const col = columns(doc.line_columns);
  const lines = [];
  for (const line of doc.lines) {
    for (const segment of line.segments) {
      const xs = segment.rows.map((row) => row[col.x]);
      lines.push({
        label: line.label, name: line.label, epoch: segment.epoch, distance: line.distance,
        step: doc.x === 'step' ? xs : null,
        ts: doc.x === 'ts' ? xs : null,
        y: segment.rows.map((row) => num(row[col.value])),
        lo: segment.rows.map((row) => num(row[col.min])),
        hi: segment.rows.map((row) => num(row[col.max])),
        downsampled: segment.rows.some((row) => row[col.n] > 1),
        outlier: Boolean(line.outlier),
      });
    }
  }
  return lines;
}

// The x range to ask for: the page's zoom, when it is of the x this chart asks for.
function bounds(range, xMode, t0) {
  if (!range || range.kind !== xMode) return {};
  const shift = xMode === 'relative' ? t0 ?? 0 : 0;
  return { start: range.range[0] + shift, end: range.range[1] + shift };
}

async function envelopeDoc(runId, key, { xMode = 'step', range = null, t0 = null, lines = MAX_LINES, outliers = OUTLIERS, labels = [] } = {}) {
  return api(runPath(runId, '/metrics/envelope'), {
    key, x: xMode === 'step' ? 'step' : 'ts', lines, outliers, ...bounds(range, xMode, t0), label: labels,
  });
}

function describeDoc(doc) {
  const buckets = doc.exact ? '' : ' · ' + doc.width.toLocaleString('en-US') + (doc.x === 'step' ? '-step' : '-second') + ' buckets';
  return doc.labels.toLocaleString('en-US') + (doc.labels === 1 ? ' label' : ' labels') + buckets;
}

// The drawing of one metric key: every label a line up to MAX_LINES labels, else the envelope
// (median, p10-p90, min-max) with its outlier labels and the labels the user turned on, all in
// one request. Returns {parts, info}.
/**
 * @param {string} runId
 * @param {string} key
 * @param {{run?: {started_ts?: number|null}|null, shown?: Set<string>, xMode?: string, range?: {kind: string, range: number[]}|null}} [options]
 */
export async function metricChart(runId, key, { run: runDoc, shown = new Set(), xMode = 'step', range = null } = {}) {
  const t0 = runDoc?.started_ts ?? null;
  const labels = [...shown].sort(byName).slice(0, MAX_SHOWN);
  const doc = await envelopeDoc(runId, key, { xMode, range, t0, labels });
  const lines = linesFromEnvelope(doc);
  if (doc.all_lines) return { parts: [{ lines, t0 }], info: describeDoc(doc) };
  // An outlier as close to the median as the rest (every line alike) is none.
  const outliers = [...new Set(lines.filter((line) => line.outlier && line.distance > MIN_DISTANCE).map((line) => line.label))];
  const drawn = lines.filter((line) => outliers.includes(line.label) || shown.has(line.label));
  return {
    parts: [{
      lines: drawn,
      envelope: doc.band.map((segment) => envelopeFromBand(doc, segment)),
      outliers,
      t0,
      // Each label's first NaN or inf in view: marked whether or not the label is a line.
      nonFinite: doc.non_finite || [],
    }],
    info: describeDoc(doc) + ' · envelope',
  };
}

// The system figures a run sampled (GPU figures of every index together). One request.
export async function systemFigures(runId) {
  const doc = await api(runPath(runId, '/system/keys'));
  return doc.keys;
}

// One system figure over time, across every label's GPUs (or those of `host`, '' for all):
// every line up to MAX_LINES, else the envelope and its outlying lines. A line is one label's
// key: `rank3`, or `rank3 · gpu0` in a GPU figure. One request.
/**
 * @param {string} runId
 * @param {string} figure
 * @param {{run?: {started_ts?: number|null}|null, host?: string}} [options]
 */
export async function systemChart(runId, figure, { run: runDoc, host = '' } = {}) {
  const doc = await api(runPath(runId, '/system/envelope'), { key: figure, host, lines: MAX_LINES, outliers: OUTLIERS });
  const t0 = runDoc?.started_ts ?? null;
  // Labels hold no space: the label is the name's first word.
  const lines = linesFromEnvelope(doc).map((line) => ({ ...line, label: line.name.split(' ')[0] }));
  const buckets = doc.exact ? '' : ' · ' + doc.width.toLocaleString('en-US') + '-second buckets';
  const info = doc.labels.toLocaleString('en-US') + ' series' + buckets;
  if (doc.all_lines) return { parts: [{ lines, t0 }], info };
  const outliers = lines.filter((line) => line.distance !== null && line.distance !== undefined && line.distance > MIN_DISTANCE);
  return {
    parts: [{
      lines: outliers,
      envelope: doc.band.map((segment) => envelopeFromBand(doc, segment)),
      outliers: [...new Set(outliers.map((line) => line.label))],
      t0,
    }],
    info: info + ' · envelope',
  };
}

// Seconds per step of every label and step bucket, from when `key` was logged (or, with
// `timeKey`, from its values: a key of step times), the slowest labels first. One request.
/**
 * @param {string} runId
 * @param {{key?: string, timeKey?: boolean}} [options]
 */
export async function stragglers(runId, { key, timeKey = false } = {}) {
  const doc = await api(runPath(runId, '/stragglers'), { [timeKey ? 'time_key' : 'key']: key, buckets: HEAT_BUCKETS });
  const buckets = doc.buckets.map(([from, to]) => ({ from, to }));
  const median = doc.median.map(num);
  const times = new Map(doc.labels.map((s) => [s.label, s.step_time.map(num)]));
  const labels = [...times.keys()].sort(byName);
  const slowest = doc.labels.map((s) => {
    const row = times.get(s.label);
    let worstSteps = null;
    let worst = 0;
    row.forEach((seconds, b) => {
      if (median[b] > 0 && seconds / median[b] > worst) {
        worst = seconds / median[b];
        worstSteps = buckets[b];
      }
    });
    return {
      label: s.label, behind: num(s.mean_ratio) - 1, worst: num(s.worst_ratio), worstSteps,
      kind: s.kind === 'normal' ? '' : s.kind, secondsBehind: num(s.seconds_behind),
    };
  });
  return {
    labels, buckets, median, slowest, total: doc.total,
    cells: labels.map((label) => times.get(label)),
    source: doc.source,
  };
}

// What each label runs on: {labels: [{label, rank, host, hardware...}], groups: the distinct
// hardware with how many labels have it, total}. One request.
export async function labelHardware(runId) {
  const doc = await api(runPath(runId, '/labels'), { limit: LABELS_PAGE });
  const row = (lab) => {
    const hw = lab.hardware || {};
    return {
      label: lab.label, rank: lab.rank ?? null, host: hw.host ?? lab.host ?? null,
      gpus: Array.isArray(hw.gpus) ? hw.gpus : null,
      driver: hw.driver_version ?? null, cuda: hw.cuda_version ?? null, torch: hw.torch_version ?? null,
      python: hw.python_version ?? null, cpus: hw.cpu_count ?? null, memory: hw.memory_total_mb ?? null,
      argv: Array.isArray(hw.argv) ? hw.argv : null,
      git: lab.git && typeof lab.git === 'object' ? lab.git : null,
    };
  };
  // Alike hardware, whichever GPU indices a label was given: counted together.
  const groups = new Map();
  for (const group of doc.hardware || []) {
    const gpus = Array.isArray(group.gpus) ? group.gpus.map((gpu) => ({ name: gpu.name, memory_total_mb: gpu.memory_total_mb })) : null;
    const shown = {
      gpus, driver: group.driver_version ?? null, cuda: group.cuda_version ?? null, torch: group.torch_version ?? null,
      python: group.python_version ?? null, cpus: group.cpu_count ?? null,
    };
    const id = JSON.stringify(shown);
    if (groups.has(id)) groups.get(id).count += group.count;
    else groups.set(id, { count: group.count, ...shown });
  }
  return {
    labels: doc.labels.map(row).sort((a, b) => byName(a.label, b.label)),
    total: doc.total,
    groups: [...groups.values()].sort((a, b) => b.count - a.count),
  };
}

// -- comparing runs ---------------------------------------------------------------------------

// The union of the runs' keys matching `query`, paged like keyPage, with the runs that logged
// each (`owners`: key -> Set of run ids). One request per run.
export async function compareKeyPage(runIds, { query = '', offset = 0, limit = KEYS_PER_PAGE } = {}) {
  const lists = await Promise.all(runIds.map((id) => api(runPath(id, '/metrics')).then((doc) => doc.keys, () => [])));
  const pattern = searchPattern(query);
  const owners = new Map();
  lists.forEach((keys, i) => {
    for (const key of keys) {
      if (!pattern.test(key)) continue;
      if (!owners.has(key)) owners.set(key, new Set());
      owners.get(key).add(runIds[i]);
    }
  });
  const keys = [...owners.keys()].sort();
  const start = Math.min(offset, Math.max(0, keys.length - 1));
  const page = keys.slice(start, start + limit);
  return { keys: page, total: keys.length, offset: start, error: pattern.error, owners: new Map(page.map((key) => [key, owners.get(key)])) };
}

// The config keys whose values differ between the runs, each run's value (one request).
export function compareConfig(runIds) {
  return api('/api/compare/config', { run: runIds });
}

// One key across runs, each run in its colour: its envelope (the line of a one-label run) or
// its primary label's line. One request per run that logged the key (`owners`).
export async function compareChart(runs, key, { mode = 'envelope', xMode = 'step', range = null, owners = null } = {}) {
  const logged = owners ? runs.filter((r) => owners.has(r.run_id)) : runs;
  const parts = await Promise.all(logged.map(async (runDoc) => {
    const base = { color: runDoc.color, prefix: runDoc.run_id, t0: runDoc.started_ts };
    try {
      if (mode === 'primary') {
        if (!runDoc.primary) return null;
        const doc = await api(runPath(runDoc.run_id, '/metrics/series'), { key, label: runDoc.primary, points: SERIES_POINTS });
        const lines = linesFromSeriesDoc(doc);
        return lines.length ? { ...base, lines } : null;
      }
      const doc = await envelopeDoc(runDoc.run_id, key, { xMode, range, t0: runDoc.started_ts, lines: 1, outliers: 0 });
      if (doc.labels === 1) return { ...base, lines: linesFromEnvelope(doc) };
      return { ...base, lines: [], envelope: doc.band.map((segment) => envelopeFromBand(doc, segment)) };
    } catch (error) {
      if (error instanceof ApiError && error.status === 404) return null;  // a run without this key
      throw error;
    }
  }));
  const present = parts.filter(Boolean);
  return { parts: present, info: present.length + ' of ' + runs.length + ' runs' };
}
