// @ts-check
// What a chart draws, decided without the DOM: from lines and envelopes and the chart settings
// (x axis, smoothing, log scale, hidden labels) to uPlot's tables, series and bands, plus the
// marks drawn over them (restarts, gaps, non-finite values).
//
// A part is what one source contributes: {lines, envelope, t0, color, prefix}. The run page has
// one part (its labels, each in its own colour); the compare page one part per run, in the run's
// colour. Each Line becomes its own table [x, y, ...]: joined by uPlot.join, a value a table does
// not have is `undefined` (the line goes on), and a null is a hole (the line stops).

import { ENVELOPE, labelColor, withAlpha } from './colors.js';
import { ema, gapsIn } from './series.js';

export const X_KINDS = ['step', 'wall', 'relative'];

/**
 * @typedef {import('./series.js').Line} Line
 * @typedef {import('./series.js').Envelope} Envelope
 * @typedef {{label: string, kind: string, step: number|null, ts: number}} NonFinite
 * @typedef {{lines: Line[], envelope?: Envelope|Envelope[], t0?: number|null, color?: string,
 *   prefix?: string, outliers?: string[], nonFinite?: NonFinite[]}} Part
 */

function xsOf(source, kind, t0) {
  if (kind === 'step') return source.step;
  if (!source.ts) return null;
  return kind === 'wall' ? source.ts : source.ts.map((t) => t - t0);
}

// A part's envelope segments: one per generation of the run (an elastic restart of every label
// begins a new one), or one.
/** @param {Part} part @returns {Envelope[]} */
export function envelopesOf(part) {
  if (!part.envelope) return [];
  return Array.isArray(part.envelope) ? part.envelope : [part.envelope];
}

// The x the chart can draw: the one asked for if every line has it, else steps, else wall time.
/** @param {Part[]} parts @param {string} wanted @returns {string} */
export function xKindFor(parts, wanted) {
  const sources = parts.flatMap((part) => [...part.lines, ...envelopesOf(part)]);
  const has = (kind) => sources.every((s) => (kind === 'step' ? s.step : s.ts));
  if (has(wanted)) return wanted;
  return has('step') ? 'step' : 'wall';
}

function cleanY(y, log) {
  if (!Number.isFinite(y)) return null;
  return log && y <= 0 ? null : y;
}

/**
 * @param {Part[]} parts
 * @param {{xMode?: string, smoothing?: number, log?: boolean, hidden?: Set<string>}} [settings]
 */
export function plan(parts, { xMode = 'step', smoothing = 0, log = false, hidden = new Set() } = {}) {
  const xKind = xKindFor(parts, xMode);
  const out = {
    xKind, series: [], tables: [], bands: [],
    marks: { restarts: [], gaps: [], nonFinite: [] },
  };
  const smooth = smoothing > 0;

  function addTable(xs, columns) {
    out.tables.push([xs, ...columns.map((c) => c.values)]);
    const first = out.series.length + 1;  // uPlot's index: 0 is x
    columns.forEach((c) => out.series.push(c.series));
    return first;
  }

  for (const part of parts) {
    const t0 = part.t0 ?? 0;
    const prefix = part.prefix ? part.prefix + ' · ' : '';
    for (const envelope of envelopesOf(part)) addEnvelope(envelope, part, t0, prefix);
    const firstEpoch = new Map();
    for (const line of part.lines) {
      if (!firstEpoch.has(line.label) || line.epoch < firstEpoch.get(line.label)) firstEpoch.set(line.label, line.epoch);
    }
    for (const line of part.lines) {
      if (hidden.has(line.label)) continue;
      addLine(line, part, t0, prefix, line.epoch !== firstEpoch.get(line.label));
    }
    addNonFinite(part, t0, new Set(firstEpoch.keys()));
  }
  return out;

  // A band's labels that went NaN or inf, named on the chart (a label drawn as a line marks its
  // own values).
  function addNonFinite(part, t0, drawn) {
    for (const found of part.nonFinite || []) {
      if (drawn.has(found.label) || hidden.has(found.label)) continue;
      const x = xKind === 'step' ? found.step : xKind === 'wall' ? found.ts : found.ts - t0;
      if (x === null || x === undefined) continue;
      const what = found.kind === 'nan' ? 'NaN' : 'inf';
      out.marks.nonFinite.push({
        x, label: found.label, what, color: part.color || labelColor(found.label),
        text: found.label + ' ' + what + (found.step === null ? '' : ' @' + found.step),
      });
    }
  }

  function addLine(line, part, t0, prefix, restarted) {
    const xs = xsOf(line, xKind, t0);
    if (!xs || !xs.length) return;
    const color = part.color || labelColor(line.label);
    const name = prefix + line.name;
    const X = [];
    const Y = [];
    const LO = [];
    const HI = [];
    const gaps = new Set(gapsIn(xs));
    for (let i = 0; i < xs.length; i += 1) {
      if (gaps.has(i)) {
        X.push((xs[i - 1] + xs[i]) / 2);
        Y.push(null);
        LO.push(null);
        HI.push(null);
        out.marks.gaps.push({ x0: xs[i - 1], x1: xs[i], label: line.label, color });
      }
      const y = line.y[i];
      if (!Number.isFinite(y)) out.marks.nonFinite.push({ x: xs[i], label: line.label, what: String(y), color });
      X.push(xs[i]);
      Y.push(cleanY(y, log));
      LO.push(cleanY(line.lo[i], log));
      HI.push(cleanY(line.hi[i], log));
    }
    if (restarted) out.marks.restarts.push({ x: xs[0], label: line.label, epoch: line.epoch, text: line.label + ' restarted', color });
    const meta = { label: line.label, epoch: line.epoch, name, color };
    const columns = [];
    if (smooth) {
      columns.push({ values: Y, series: { ...meta, role: 'raw', stroke: withAlpha(color, 0.22), width: 1 } });
      columns.push({ values: ema(Y, smoothing), series: { ...meta, role: 'line', stroke: color, width: 1.6 } });
    } else {
      columns.push({ values: Y, series: { ...meta, role: 'line', stroke: color, width: 1.6 } });
    }
    const band = line.downsampled && !smooth;
    if (band) {
      columns.push({ values: HI, series: { ...meta, role: 'hi', stroke: 'transparent', width: 0 } });
      columns.push({ values: LO, series: { ...meta, role: 'lo', stroke: 'transparent', width: 0 } });
    }
    const first = addTable(X, columns);
    if (band) out.bands.push({ series: [first + columns.length - 2, first + columns.length - 1], fill: withAlpha(color, 0.12) });
  }

  function addEnvelope(env, part, t0, prefix) {
    const xs = xsOf(env, xKind, t0);
    if (!xs || !xs.length) return;
    const color = part.color || ENVELOPE;
    const shift = xKind === 'relative' ? t0 : 0;
    for (const [x0, x1] of env.gaps || []) out.marks.gaps.push({ x0: x0 - shift, x1: x1 - shift, label: null, color });
    // A later generation: every label of the run restarted.
    if (env.generation > 1) {
      out.marks.restarts.push({ x: xs[0], label: null, epoch: null, text: prefix + 'restart ' + (env.generation - 1), color });
    }
    const clean = (values) => values.map((v) => cleanY(v, log));
    const median = clean(env.median);
    const meta = (role, name) => ({ label: null, epoch: null, name: prefix + name, color, role });
    const columns = [
      { values: clean(env.max), series: { ...meta('max', 'max'), stroke: 'transparent', width: 0 } },
      { values: clean(env.min), series: { ...meta('min', 'min'), stroke: 'transparent', width: 0 } },
      { values: clean(env.p90), series: { ...meta('p90', 'p90'), stroke: withAlpha(color, 0.35), width: 0.6 } },
      { values: clean(env.p10), series: { ...meta('p10', 'p10'), stroke: withAlpha(color, 0.35), width: 0.6 } },
    ];
    if (smooth) {
      columns.push({ values: median, series: { ...meta('median-raw', 'median (raw)'), stroke: withAlpha(color, 0.25), width: 1 } });
      columns.push({ values: ema(median, smoothing), series: { ...meta('median', 'median'), stroke: color, width: 2 } });
    } else {
      columns.push({ values: median, series: { ...meta('median', 'median'), stroke: color, width: 2 } });
    }
    const first = addTable(xs, columns);
    out.bands.push({ series: [first, first + 1], fill: withAlpha(color, 0.09) });
    out.bands.push({ series: [first + 2, first + 3], fill: withAlpha(color, 0.2) });
  }
}
