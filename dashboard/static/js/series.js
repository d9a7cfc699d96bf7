// @ts-check
// Pure work on series, no DOM: the API's series documents as lines, EMA smoothing, the envelope
// of many lines (system figures; the server sends metric envelopes), gaps. Shapes:
//
//   Line     {label, name, epoch, step: number[]|null, ts: number[]|null, y, lo, hi, downsampled}
//            one label in one epoch (an elastic restart starts a new epoch: a new segment);
//            step/ts null when the API did not send that x; y/lo/hi numbers (NaN, ±Infinity kept).
//   Envelope {step, ts, count, min, p10, median, p90, max, mean, outliers: [label], labels: n}
//            one value per step bucket, across labels.

import { num } from './dom.js';

/**
 * @typedef {{label: string, name: string, epoch: number, host?: string|null, step: number[]|null,
 *   ts: number[]|null, y: number[], lo: number[], hi: number[], downsampled: boolean,
 *   distance?: number|null, outlier?: boolean}} Line
 * @typedef {{step: number[]|null, ts: number[]|null, count: number[], min: number[], p10: number[],
 *   median: number[], p90: number[], max: number[], mean: number[], outliers?: string[], labels: number,
 *   gaps?: number[][], generation?: number}} Envelope
 */

export const MAX_LINES = 16;
export const OUTLIERS = 3;
const GAP_FACTOR = 5;

// The rows of a series document (`columns` names them) as Lines, one per label and epoch. An
// `epoch` column (or a series' own `epoch`) splits a label; `ts`/`step` columns give the other x.
/**
 * @param {{columns?: string[], x?: string, series?: Array<{label: string, data: any[][], epoch?: number, host?: string, downsampled?: boolean}>}} doc
 * @param {(label: string, series: object) => string} [named] a line's name from its label and series
 */
export function linesFromSeriesDoc(doc, named = (label) => label) {
  const col = Object.fromEntries((doc.columns || []).map((name, index) => [name, index]));
  const xIsStep = doc.x === 'step';
  const lines = [];
  for (const series of doc.series || []) {
    const segments = new Map();
    for (const row of series.data) {
      const epoch = series.epoch ?? (col.epoch === undefined ? 1 : row[col.epoch]);
      let line = segments.get(epoch);
      if (!line) {
        line = {
          label: series.label, name: named(series.label, series), epoch, host: series.host ?? null,
          step: [], ts: [], y: [], lo: [], hi: [], downsampled: Boolean(series.downsampled),
        };
        segments.set(epoch, line);
      }
      const x = row[col.x ?? 0];
      line.step.push(xIsStep ? x : col.step === undefined ? null : row[col.step]);
      line.ts.push(!xIsStep ? x : col.ts === undefined ? null : row[col.ts]);
      line.y.push(num(row[col.value ?? 1]));
      line.lo.push(num(row[col.min ?? 3]));
      line.hi.push(num(row[col.max ?? 4]));
    }
    for (const epoch of [...segments.keys()].sort((a, b) => a - b)) {
      const line = segments.get(epoch);
      if (line.step.some((s) => s === null || s === undefined)) line.step = null;
      if (line.ts.some((t) => t === null || t === undefined)) line.ts = null;
      lines.push(line);
    }
  }
  return lines;
}

// Names in their natural order: rank2 before rank10.
/** @param {string} a @param {string} b */
export function byName(a, b) {
  return a.localeCompare(b, 'en', { numeric: true });
}

// TensorBoard's smoothing: an exponential moving average, debiased so the start is not pulled
// towards zero. Non-finite and missing values are skipped (and stay missing).
/**
 * @param {Array<number|null|undefined>} values
 * @param {number} weight in [0, 1)
 * @returns {Array<number|null|undefined>}
 */
export function ema(values, weight) {
  const out = new Array(values.length);
  let last = 0;
  let seen = 0;
  for (let i = 0; i < values.length; i += 1) {
    const v = values[i];
    if (v === null || v === undefined || !Number.isFinite(v)) {
      out[i] = v === undefined ? undefined : null;
      continue;
    }
    last = last * weight + (1 - weight) * v;
    seen += 1;
    out[i] = last / (1 - weight ** seen);
  }
  return out;
}

// Where a line has a hole: indices i with x[i] - x[i-1] far above the line's usual spacing.
/** @param {number[]} xs @returns {number[]} */
export function gapsIn(xs) {
  if (xs.length < 4) return [];
  const deltas = [];
  for (let i = 1; i < xs.length; i += 1) if (xs[i] > xs[i - 1]) deltas.push(xs[i] - xs[i - 1]);
  if (!deltas.length) return [];
  deltas.sort((a, b) => a - b);
  const usual = deltas[deltas.length >> 1];
  const gaps = [];
  for (let i = 1; i < xs.length; i += 1) if (xs[i] - xs[i - 1] > usual * GAP_FACTOR) gaps.push(i);
  return gaps;
}

/** @param {number[]} sorted ascending @param {number} q in [0, 1] */
export function quantile(sorted, q) {
  if (!sorted.length) return NaN;
  const at = (sorted.length - 1) * q;
  const lo = Math.floor(at);
  const hi = Math.ceil(at);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (at - lo);
}

// The value of each line (by name: a label may have one per GPU) at each x (the latest epoch wins where a restart replayed steps), in
// at most `bins` buckets of x: Map label -> Map(bucket -> {y, ts}), with the buckets' x and ts.
function bucketed(lines, bins) {
  const byStep = lines.every((line) => line.step);
  if (!byStep) {
    // Times differ from label to label: a bucket per point of a typical line, so most buckets
    // hold a point of most labels.
    const sizes = lines.map((line) => line.y.length).sort((a, b) => a - b);
    bins = Math.min(bins, Math.max(4, sizes[sizes.length >> 1] || 4));
  }
  const perLabel = new Map();
  for (const line of [...lines].sort((a, b) => a.epoch - b.epoch)) {
    const xs = byStep ? line.step : line.ts;
    if (!xs) continue;
    let points = perLabel.get(line.name);
    if (!points) perLabel.set(line.name, (points = new Map()));
    for (let i = 0; i < xs.length; i += 1) points.set(xs[i], { y: line.y[i], ts: line.ts ? line.ts[i] : null });
  }
  const distinct = new Set();
  for (const points of perLabel.values()) for (const x of points.keys()) distinct.add(x);
  const xs = [...distinct].sort((a, b) => a - b);
  const low = xs[0];
  const width = xs.length > bins ? (xs[xs.length - 1] - low) / bins : 0;
  const bucketOf = width ? (x) => Math.min(bins - 1, Math.floor((x - low) / width)) : null;
  const index = new Map(xs.map((x, i) => [x, i]));
  const size = width ? bins : xs.length;
  const bucketX = new Array(size).fill(null);
  const cells = new Map();
  for (const [label, points] of perLabel) {
    const mine = new Map();
    for (const [x, point] of points) {
      const b = width ? bucketOf(x) : index.get(x);
      if (bucketX[b] === null || x > bucketX[b]) bucketX[b] = x;
      const held = mine.get(b);
      if (!held || held.x < x) mine.set(b, { x, y: point.y, ts: point.ts });
    }
    cells.set(label, mine);
  }
  const used = bucketX.map((x, b) => (x === null ? -1 : b)).filter((b) => b >= 0);
  return { byStep, used, bucketX, cells };
}

// The envelope of one key across labels, computed here from every label's series; the server's
// envelope (when it sends one) has the same shape.
/**
 * @param {Line[]} lines
 * @param {{bins?: number, outliers?: number}} [options]
 * @returns {Envelope}
 */
export function envelopeOf(lines, { bins = 400, outliers = OUTLIERS } = {}) {
  const { byStep, used, bucketX, cells } = bucketed(lines, bins);
  const stats = { count: [], min: [], p10: [], median: [], p90: [], max: [], mean: [] };
  const tsOut = [];
  let haveTs = true;
  for (const b of used) {
    const values = [];
    const real = [];
    const times = [];
    for (const mine of cells.values()) {
      const cell = mine.get(b);
      if (!cell) continue;
      if (!Number.isNaN(cell.y)) real.push(cell.y);
      if (Number.isFinite(cell.y)) values.push(cell.y);
      if (cell.ts !== null && cell.ts !== undefined) times.push(cell.ts);
    }
    values.sort((a, b2) => a - b2);
    times.sort((a, b2) => a - b2);
    stats.count.push(real.length);
    stats.min.push(real.length ? Math.min(...real) : NaN);
    stats.max.push(real.length ? Math.max(...real) : NaN);
    stats.p10.push(quantile(values, 0.1));
    stats.median.push(quantile(values, 0.5));
    stats.p90.push(quantile(values, 0.9));
    stats.mean.push(values.length ? values.reduce((s, v) => s + v, 0) / values.length : NaN);
    if (!times.length) haveTs = false;
    tsOut.push(times.length ? quantile(times, 0.5) : null);
  }
  const xs = used.map((b) => bucketX[b]);
  // The labels furthest from the median: mean distance, in units of the p10-p90 spread.
  const scores = [];
  for (const [label, mine] of cells) {
    let total = 0;
    let n = 0;
    used.forEach((b, i) => {
      const cell = mine.get(b);
      if (!cell || !Number.isFinite(cell.y) || !Number.isFinite(stats.median[i])) return;
      const spread = stats.p90[i] - stats.p10[i] || Math.abs(stats.median[i]) * 1e-6 || 1e-12;
      total += Math.abs(cell.y - stats.median[i]) / spread;
      n += 1;
    });
    if (n) scores.push({ label, score: total / n });
  }
  scores.sort((a, b) => b.score - a.score || (a.label < b.label ? -1 : 1));
  return {
    step: byStep ? xs : null,
    ts: byStep ? (haveTs ? tsOut : null) : xs,
    ...stats,
    // Line names; a line as close to the median as the rest is no outlier, however it ranks.
    outliers: scores.filter((s) => s.score > 0.05).slice(0, outliers).map((s) => s.label),
    labels: cells.size,
  };
}
