// @ts-check
// One chart panel drawn by uPlot (vendor/uplot): its header and buttons, the plot, a tooltip, a
// legend, and its exports (CSV of the data, PNG of the picture). What to draw comes from plan.js;
// the page's settings (x axis, smoothing, hidden and shown labels) and its zoom are shared by
// every panel of the page through `page`.

import { clock, count, dateTime, download, el, elapsed, compact, printable, swatch, value } from './dom.js';
import { envelopesOf, plan } from './plan.js';

const HEIGHT = 210;
const FONT = '11px system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", Arial, sans-serif';
const AXIS = { stroke: '#7a8699', font: FONT, grid: { stroke: '#edf0f4', width: 1 }, ticks: { stroke: '#e3e7ee', width: 1, size: 4 } };
const STEP_INCRS = [];
for (let e = 0; e <= 12; e += 1) for (const m of [1, 2, 5]) STEP_INCRS.push(m * 10 ** e);
const TIME_INCRS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400,
  172800, 604800];
const TOOLTIP_ROWS = 12;
const NEAR_ROWS = 512;
const HOVER_DOTS = new Set(['line', 'median']);
const ENVELOPE_ROLES = new Set(['median', 'p10', 'p90', 'min', 'max']);
const X_TITLES = { step: 'step', wall: 'time', relative: 'since start' };

// The x range every chart of a page shows: set by dragging on any chart, cleared by a double
// click on any chart; a chart whose x is of another kind keeps its own.
export class Zoom {
  constructor() {
    this.kind = null;
    this.range = null;
    this.members = new Set();
    this.listeners = [];
  }
  onChange(listener) {
    this.listeners.push(listener);
  }
  set(kind, range) {
    if (!range && !this.range) return;
    this.kind = range ? kind : null;
    this.range = range;
    for (const member of this.members) member.applyZoom();
    for (const listener of this.listeners) listener();
  }
}

// The page's zoom as the sources take it: null, or the x kind and range.
export function zoomed(zoom) {
  return zoom.range ? { kind: zoom.kind, range: zoom.range } : null;
}

export class Panel {
  // page: {settings, zoom, labelClicked(label)}; settings: see js/settings.js.
  // timed: the data is only ever by time (system samples): no note when steps are asked for.
  constructor(key, title, page, { extraInfo = null, timed = false } = {}) {
    this.timed = timed;
    this.key = key;
    this.title = title;
    this.page = page;
    this.parts = null;
    this.model = null;
    this.u = null;
    this.signature = '';
    this.info = el('span', { class: 'chart-info' });
    this.note = el('span', { class: 'chart-note', hidden: true });
    this.logButton = el('button', {
      type: 'button', class: 'chart-button chart-log', title: 'Logarithmic y axis', 'aria-pressed': 'false',
      onclick: () => this.page.settings.toggleLog(this.key),
    }, 'log');
    const csv = el('button', { type: 'button', class: 'chart-button chart-csv', title: "Download this chart's data as CSV", onclick: () => this.exportCsv() }, 'CSV');
    const png = el('button', { type: 'button', class: 'chart-button chart-png', title: 'Download this chart as PNG', onclick: () => this.exportPng() }, 'PNG');
    this.plot = el('div', { class: 'plot' });
    this.tooltip = el('div', { class: 'tooltip', hidden: true });
    this.legend = el('div', { class: 'legend' });
    this.element = el('figure', { class: 'chart', dataset: { key } },
      el('figcaption', { class: 'chart-head' },
        el('span', { class: 'chart-title', title }, title),
        el('span', { class: 'chart-tools' }, this.note, this.info, extraInfo, this.logButton, csv, png)),
      this.plot, this.legend);
    this.element.chart = this;  // for the browser tests: figure.chart.describe()
    this.width = 0;
    this.resizer = new ResizeObserver(() => {
      const width = Math.floor(this.plot.clientWidth);
      if (!width || width === this.width) return;
      this.width = width;
      if (this.u) this.u.setSize({ width, height: HEIGHT });
      else if (this.parts) this.render();
    });
    this.resizer.observe(this.plot);
    page.zoom.members.add(this);
    this.plot.append(el('div', { class: 'plot-empty' }, 'loading…'));
  }

  destroy() {
    this.resizer.disconnect();
    this.page.zoom.members.delete(this);
    if (this.u) this.u.destroy();
    this.u = null;
  }

  // New data: parts as plan() takes them, and the line under the title.
  show(parts, info) {
    this.parts = parts;
    this.info.textContent = printable(info || '');
    this.render();
  }

  failed(message) {
    this.parts = null;
    if (this.u) this.u.destroy();
    this.u = null;
    this.plot.replaceChildren(el('div', { class: 'plot-empty bad' }, message));
  }

  render() {
    if (!this.parts) return;
    const settings = this.page.settings;
    const log = settings.logKeys.has(this.key);
    this.logButton.setAttribute('aria-pressed', String(log));
    this.logButton.classList.toggle('on', log);
    this.model = plan(this.parts, { xMode: settings.xMode, smoothing: settings.smoothing, log, hidden: settings.hidden });
    const model = this.model;
    const fellBack = model.xKind !== settings.xMode && !(this.timed && settings.xMode === 'step');
    this.note.hidden = !fellBack;
    this.note.textContent = fellBack ? 'by ' + X_TITLES[model.xKind] : '';
    this.note.title = fellBack ? 'this data has no ' + X_TITLES[settings.xMode] + ' x: drawn by ' + X_TITLES[model.xKind] : '';
    this.drawLegend();
    this.width = Math.floor(this.plot.clientWidth);
    if (!model.series.length) {
      if (this.u) this.u.destroy();
      this.u = null;
      this.plot.replaceChildren(el('div', { class: 'plot-empty' }, this.parts.some((p) => p.lines.length || envelopesOf(p).length) ? 'every line is hidden' : 'no values'));
      return;
    }
    if (!this.width) return;  // not laid out yet: the ResizeObserver draws it
    const data = model.tables.length === 1 ? model.tables[0] : window.uPlot.join(model.tables);
    const signature = JSON.stringify([model.xKind, log, model.series.map((s) => [s.name, s.role, s.stroke, s.width]), model.bands]);
    if (this.u && signature === this.signature) {
      this.u.setData(data);
    } else {
      if (this.u) this.u.destroy();
      this.plot.replaceChildren();
      this.u = new window.uPlot(this.options(model, log), data, this.plot);
      this.plot.append(this.tooltip);
      this.signature = signature;
    }
    this.applyZoom();
  }

  options(model, log) {
    const zoom = this.page.zoom;
    const kind = model.xKind;
    const xAxis = { ...AXIS, space: 70 };
    if (kind === 'step') Object.assign(xAxis, { incrs: STEP_INCRS, values: (u, splits) => splits.map(compact) });
    if (kind === 'relative') Object.assign(xAxis, { incrs: TIME_INCRS, values: (u, splits) => splits.map(elapsed) });
    if (kind === 'wall') Object.assign(xAxis, { incrs: TIME_INCRS, values: (u, splits, axis, space, incr) => splits.map((t) => wallTick(t, incr)) });
    return {
      width: this.width,
      height: HEIGHT,
      legend: { show: false },
      padding: [10, 12, 0, 0],
      scales: { x: { time: kind === 'wall' }, y: log ? { distr: 3, log: 10 } : {} },
      axes: [xAxis, { ...AXIS, size: 54, values: (u, splits) => splits.map(compact) }],
      series: [{}, ...model.series.map((s) => ({
        label: s.name, stroke: s.stroke, width: s.width, spanGaps: false, points: { show: false },
      }))],
      bands: model.bands,
      cursor: {
        sync: { key: 'runbus-x-' + kind },
        y: false,
        drag: { x: true, y: false, setScale: false },
        points: {
          // A dot where the cursor meets each line (not the bands, nor the faint raw lines).
          show: (u, si) => (HOVER_DOTS.has(model.series[si - 1]?.role) ? hoverDot() : null),
          fill: (u, si) => model.series[si - 1].color,
          stroke: () => '#ffffff',
        },
        bind: { dblclick: () => () => { zoom.set(kind, null); return null; } },
      },
      hooks: {
        setSelect: [(u) => {
          if (u.select.width < 3) return;
          const low = u.posToVal(u.select.left, 'x');
          const high = u.posToVal(u.select.left + u.select.width, 'x');
          u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
          zoom.set(kind, [low, high]);
        }],
        setCursor: [(u) => this.hover(u)],
        draw: [(u) => this.drawMarks(u)],
      },
    };
  }

  applyZoom() {
    const u = this.u;
    if (!u || !this.model) return;
    const zoom = this.page.zoom;
    const xs = u.data[0];
    if (zoom.range && zoom.kind === this.model.xKind) {
      u.setScale('x', { min: zoom.range[0], max: zoom.range[1] });
    } else if (xs.length) {
      const low = xs[0];
      const high = xs[xs.length - 1];
      u.setScale('x', low === high ? { min: low - 1, max: high + 1 } : { min: low, max: high });
    }
  }

  // Restarts (a dashed line where a label's new epoch begins), gaps (a shaded stretch where a
  // line has a hole) and non-finite values (a mark on the top edge).
  drawMarks(u) {
    const marks = this.model.marks;
    const ctx = u.ctx;
    const { left, top, width, height } = u.bbox;
    const ratio = window.devicePixelRatio || 1;
    ctx.save();
    ctx.beginPath();
    ctx.rect(left, top, width, height);
    ctx.clip();
    for (const gap of marks.gaps) {
      const x0 = u.valToPos(gap.x0, 'x', true);
      const x1 = u.valToPos(gap.x1, 'x', true);
      ctx.fillStyle = 'rgba(148, 163, 184, 0.13)';
      ctx.fillRect(x0, top, x1 - x0, height);
    }
    ctx.font = `${10 * ratio}px system-ui, sans-serif`;
    ctx.textAlign = 'left';  // uPlot leaves its axes' alignment set
    ctx.textBaseline = 'alphabetic';
    const placed = [];  // [x0, x1, row] of the names written so far, so none covers another
    for (const restart of marks.restarts) {
      const x = Math.round(u.valToPos(restart.x, 'x', true)) + 0.5;
      ctx.strokeStyle = restart.color;
      ctx.lineWidth = ratio;
      ctx.setLineDash([4 * ratio, 3 * ratio]);
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, top + height);
      ctx.stroke();
      ctx.setLineDash([]);
      const text = '↻ ' + printable(restart.text);
      const wide = ctx.measureText(text).width;
      // Right of the line, or left of it near the right edge.
      const x0 = x + 3 * ratio + wide > left + width ? x - 3 * ratio - wide : x + 3 * ratio;
      let row = 0;
      while (row < 6 && placed.some(([a, b, r]) => r === row && x0 < b && x0 + wide > a)) row += 1;
      placed.push([x0, x0 + wide, row]);
      ctx.fillStyle = restart.color;
      ctx.fillText(text, x0, top + (11 + 12 * row) * ratio);
    }
    for (const mark of marks.nonFinite) {
      const x = u.valToPos(mark.x, 'x', true);
      ctx.fillStyle = mark.color;
      ctx.beginPath();
      ctx.moveTo(x - 4 * ratio, top);
      ctx.lineTo(x + 4 * ratio, top);
      ctx.lineTo(x, top + 6 * ratio);
      ctx.fill();
      // A band's label is no line: the mark names it (and its step).
      if (!mark.text) continue;
      const text = printable(mark.text);
      const wide = ctx.measureText(text).width;
      const x0 = x + 5 * ratio + wide > left + width ? x - 5 * ratio - wide : x + 5 * ratio;
      let row = 0;
      while (row < 6 && placed.some(([a, b, r]) => r === row && x0 < b && x0 + wide > a)) row += 1;
      placed.push([x0, x0 + wide, row]);
      ctx.fillText(text, x0, top + (11 + 12 * row) * ratio);
    }
    ctx.restore();
  }

  // The value of series `si` nearest to row `idx` (joined tables leave holes between a line's
  // points): only inside the series' own x span, so a line that ended says nothing there.
  valueNear(u, si, idx) {
    const ys = u.data[si];
    const xs = u.data[0];
    if (ys[idx] !== undefined) return { y: ys[idx], x: xs[idx] };
    let before = -1;
    let after = -1;
    for (let d = 1; d < NEAR_ROWS && (before < 0 || after < 0); d += 1) {
      if (before < 0 && idx - d >= 0 && ys[idx - d] !== undefined) before = idx - d;
      if (after < 0 && idx + d < ys.length && ys[idx + d] !== undefined) after = idx + d;
    }
    if (before < 0 || after < 0) return null;
    const near = xs[idx] - xs[before] <= xs[after] - xs[idx] ? before : after;
    return { y: ys[near], x: xs[near] };
  }

  hover(u) {
    const idx = u.cursor.idx;
    // Charts whose cursor follows another's (cursor sync) show the line, not a tooltip.
    if (idx === null || idx === undefined || u.cursor.left < 0 || !u.cursor.event) {
      this.tooltip.hidden = true;
      return;
    }
    const x = u.data[0][idx];
    const kind = this.model.xKind;
    const head = kind === 'wall' ? dateTime(x) : kind === 'relative' ? elapsed(x) + ' since start' : 'step ' + count(x);
    const at = (i) => {
      const near = this.valueNear(u, i + 1, idx);
      return near && near.y !== null ? near.y : null;
    };
    // An envelope reads median, then p10–p90 and min–max as ranges; then the lines.
    const rows = [];
    const envelopes = new Map();
    this.model.series.forEach((s, i) => {
      if (ENVELOPE_ROLES.has(s.role)) {
        const prefix = s.name.slice(0, s.name.length - s.role.length);
        if (!envelopes.has(prefix)) envelopes.set(prefix, { color: s.color, values: {} });
        // Generations of a run side by side: each role from the one that has it here.
        const held = envelopes.get(prefix).values;
        held[s.role] = held[s.role] ?? at(i);
      } else if (s.role === 'line') {
        const y = at(i);
        if (y !== null) rows.push({ color: s.color, name: s.name, text: value(y) });
      }
    });
    const ranges = [];
    for (const [prefix, { color, values }] of envelopes) {
      const range = (lo, hi) => (values[lo] === null || values[hi] === null ? null : value(values[lo]) + ' – ' + value(values[hi]));
      for (const [name, text] of [['median', values.median === null ? null : value(values.median)],
        ['p10–p90', range('p10', 'p90')], ['min–max', range('min', 'max')]]) {
        if (text !== null) ranges.push({ color, name: prefix + name, text });
      }
    }
    rows.unshift(...ranges);
    const shown = rows.slice(0, TOOLTIP_ROWS).map(({ color, name, text }) => el('div', { class: 'tooltip-row' }, swatch(color),
      el('span', { class: 'tooltip-name' }, name), el('span', { class: 'tooltip-value' }, text)));
    if (rows.length > TOOLTIP_ROWS) shown.push(el('div', { class: 'tooltip-row muted' }, '+' + (rows.length - TOOLTIP_ROWS) + ' more'));
    this.tooltip.replaceChildren(el('div', { class: 'tooltip-head' }, head), ...shown);
    this.tooltip.hidden = false;
    const left = u.cursor.left + u.over.offsetLeft;
    const flip = left > this.plot.clientWidth * 0.55;
    this.tooltip.style.left = (flip ? left - this.tooltip.offsetWidth - 14 : left + 14) + 'px';
    this.tooltip.style.top = Math.max(0, u.cursor.top + u.over.offsetTop - 20) + 'px';
  }

  drawLegend() {
    if (this.parts.some((part) => part.prefix)) {
      this.drawRunsLegend();
      return;
    }
    const settings = this.page.settings;
    const items = [];
    const envelope = this.parts.find((p) => envelopesOf(p).length);
    if (envelope) {
      const color = envelope.color || '#475569';
      const band = (alpha, text) => {
        const mark = el('span', { class: 'swatch band-swatch' });
        mark.style.background = color;
        mark.style.opacity = String(alpha);
        return el('span', { class: 'legend-static' }, mark, text);
      };
      items.push(el('span', { class: 'legend-static' }, swatch(color), 'median'),
        band(0.45, 'p10–p90'), band(0.2, 'min–max'),
        el('span', { class: 'legend-static muted' }, count(envelopesOf(envelope)[0].labels) + ' labels'));
    }
    const seen = new Set();
    for (const part of this.parts) {
      for (const line of part.lines) {
        if (seen.has(line.label + '\n' + (part.prefix || ''))) continue;
        seen.add(line.label + '\n' + (part.prefix || ''));
        const off = settings.hidden.has(line.label);
        const outlier = part.outliers && part.outliers.includes(line.label);
        items.push(el('button', {
          type: 'button',
          class: 'legend-item' + (off ? ' off' : '') + (outlier ? ' outlier' : ''),
          dataset: { label: line.label },
          'aria-pressed': off ? 'false' : 'true',
          title: (off ? 'show ' : 'hide ') + line.label + ' on every chart' + (outlier ? ' (far from the median)' : ''),
          onclick: () => settings.toggleHidden(line.label),
        }, swatch(part.color || this.colorOf(line)), (part.prefix ? part.prefix + ' · ' : '') + line.name, outlier ? el('span', { class: 'outlier-tag' }, 'outlier') : null));
      }
    }
    this.legend.replaceChildren(...items);
  }

  // Runs compared: one entry per run, in its colour.
  drawRunsLegend() {
    this.legend.replaceChildren(...this.parts.map((part) => el('span', { class: 'legend-static', dataset: { run: part.prefix } },
      swatch(part.color), part.prefix,
      el('span', { class: 'muted' }, envelopesOf(part).length ? '· median, p10–p90 of ' + count(envelopesOf(part)[0].labels) + ' labels'
        : '· ' + part.lines.map((line) => line.name).filter((name, i, all) => all.indexOf(name) === i).join(', ')))));
  }

  colorOf(line) {
    const drawn = this.model && this.model.series.find((s) => s.label === line.label);
    return drawn ? drawn.color : '#98a2b3';
  }

  // The drawn data as rows: x, then each drawn series (raw values, smoothed ones marked, a
  // downsampled line's bucket min and max).
  csv() {
    if (!this.u) return '';
    const names = { raw: (s) => s.name, line: (s) => s.name + (this.page.settings.smoothing > 0 ? ' (smoothed)' : ''),
      hi: (s) => s.name + ' max', lo: (s) => s.name + ' min', 'median-raw': (s) => s.name };
    const xName = { step: 'step', wall: 'time (unix s)', relative: 'seconds since start' }[this.model.xKind];
    const header = [xName, ...this.model.series.map((s) => (names[s.role] || ((t) => t.name))(s))];
    const data = this.u.data;
    const lines = [header.map(csvText).join(',')];
    for (let i = 0; i < data[0].length; i += 1) {
      /** @type {Array<number|string>} */
      const row = [data[0][i]];
      let any = false;
      for (let si = 1; si < data.length; si += 1) {
        const v = data[si][i];
        any = any || (v !== undefined && v !== null);
        row.push(v === undefined || v === null ? '' : v);
      }
      if (any) lines.push(row.join(','));
    }
    return lines.join('\n') + '\n';
  }

  exportCsv() {
    download(fileName(this.title) + '.csv', new Blob([this.csv()], { type: 'text/csv' }));
  }

  exportPng() {
    if (!this.u) return;
    const source = this.u.ctx.canvas;
    const ratio = source.width / this.u.width;
    const titleHeight = 26 * ratio;
    const canvas = document.createElement('canvas');
    canvas.width = source.width;
    canvas.height = source.height + titleHeight;
    const ctx = canvas.getContext('2d');
    ctx.fillStyle = '#ffffff';
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    ctx.fillStyle = '#182033';
    ctx.font = `600 ${13 * ratio}px system-ui, sans-serif`;
    ctx.fillText(printable(this.title), 8 * ratio, 17 * ratio);
    ctx.drawImage(source, 0, titleHeight);
    canvas.toBlob((blob) => download(fileName(this.title) + '.png', blob), 'image/png');
  }

  // For tests and curious users: what is drawn, without reading pixels.
  describe() {
    const u = this.u;
    const model = this.model;
    if (!model) return null;
    return {
      xKind: model.xKind,
      log: this.page.settings.logKeys.has(this.key),
      distr: u ? u.scales.y.distr : null,
      xRange: u ? [u.scales.x.min, u.scales.x.max] : null,
      series: model.series.map((s, i) => ({
        name: s.name, label: s.label, epoch: s.epoch, role: s.role, color: s.color, stroke: s.stroke,
        values: u ? u.data[i + 1].filter((v) => v !== undefined) : [],
      })),
      marks: model.marks,
      rows: u ? u.data[0].length : 0,
    };
  }
}

// A wall-time tick as the rest of the page writes times: 24-hour local clock, a date past a day.
function wallTick(ts, incr) {
  if (incr >= 86400) return dateTime(ts).slice(0, 10);
  return incr >= 60 ? clock(ts).slice(0, 5) : clock(ts);
}

function hoverDot() {
  const dot = document.createElement('div');
  Object.assign(dot.style, { width: '8px', height: '8px', marginLeft: '-4px', marginTop: '-4px', borderWidth: '1.5px', borderStyle: 'solid' });
  return dot;
}

function fileName(title) {
  return (title.replace(/[^A-Za-z0-9._-]+/g, '_').replace(/^_+|_+$/g, '') || 'chart').slice(0, 80);
}

// A CSV text cell: quoted, and never read as a formula by a spreadsheet.
function csvText(text) {
  let cell = String(text);
  if (/^[=+\-@\t\r]/.test(cell)) cell = "'" + cell;
  return '"' + cell.replace(/"/g, '""') + '"';
}
