// The runbus dashboard: the runs list and one run's page, over the JSON API of `runbus serve`.
// Every string that came from the bus (labels, metric names, log text, config) reaches the page
// through textContent or an attribute value, never as markup; the server's Content-Security-Policy
// forbids inline scripts as a second wall.
'use strict';

(() => {
  const PALETTE = ['#4e79a7', '#f28e2b', '#e15759', '#59a14f', '#b07aa1', '#76b7b2',
    '#edc948', '#ff9da7', '#9c755f', '#6b7280'];
  const SVG_NS = 'http://www.w3.org/2000/svg';
  const STATES = new Set(['running', 'finished', 'failed', 'crashed']);
  const LEVELS = ['DEBUG', 'INFO', 'WARNING', 'ERROR', 'CRITICAL'];
  const RUNS_EVERY_MS = 3000;
  const RUN_EVERY_MS = 5000;
  const FOLLOW_EVERY_MS = 1500;
  const LOG_PAGE = 500;
  const LOG_CATCH_UP = 5000;
  const LOG_KEEP = 5000;
  const LOG_OVERLAP = 50;
  const SYSTEM_POINTS = 600;
  const FETCHES_AT_ONCE = 4;

  // -- the API ---------------------------------------------------------------------------------

  // A token given as ?token= is kept for this tab and taken out of the address bar.
  const token = (() => {
    const params = new URLSearchParams(location.search);
    const given = params.get('token');
    if (given) {
      sessionStorage.setItem('runbus.token', given);
      params.delete('token');
      const rest = params.toString();
      history.replaceState(null, '', location.pathname + (rest ? '?' + rest : '') + location.hash);
      return given;
    }
    return sessionStorage.getItem('runbus.token');
  })();

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  async function api(path, params = {}) {
    const url = new URL(path, location.origin);
    for (const [name, value] of Object.entries(params)) {
      if (value !== undefined && value !== null && value !== '') url.searchParams.set(name, String(value));
    }
    const headers = token ? { Authorization: 'Bearer ' + token } : {};
    let response;
    try {
      response = await fetch(url, { headers, cache: 'no-store', credentials: 'same-origin' });
    } catch (error) {
      setStatus('error', 'Server unreachable');
      throw new ApiError(0, 'the server does not answer');
    }
    let body = null;
    try {
      body = await response.json();
    } catch (error) {
      body = null;
    }
    if (!response.ok) throw new ApiError(response.status, (body && body.error) || response.statusText);
    setStatus('ok', 'Updated ' + clock(Date.now() / 1000));
    return body;
  }

  function runPath(runId, tail = '') {
    return '/api/runs/' + encodeURIComponent(runId) + tail;
  }

  // Runs `jobs` (functions returning promises) a few at a time.
  async function inBatches(jobs) {
    const results = new Array(jobs.length);
    let next = 0;
    async function worker() {
      while (next < jobs.length) {
        const index = next++;
        results[index] = await jobs[index]();
      }
    }
    await Promise.all(Array.from({ length: Math.min(FETCHES_AT_ONCE, jobs.length) }, worker));
    return results;
  }

  // -- building the DOM ------------------------------------------------------------------------

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    setProps(node, props);
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function setProps(node, props) {
    for (const [name, value] of Object.entries(props || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (name === 'class') node.className = value;
      else if (name === 'dataset') Object.assign(node.dataset, value);
      else if (name.startsWith('on')) node.addEventListener(name.slice(2), value);
      else node.setAttribute(name, value === true ? '' : String(value));
    }
  }

  function svg(tag, attrs) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, String(value));
    return node;
  }

  function stateBadge(state, exitCode = null) {
    const known = STATES.has(state) ? state : 'unknown';
    const text = exitCode !== null && exitCode !== undefined && exitCode !== 0 ? state + ' · exit ' + exitCode : state;
    return el('span', { class: 'badge state-' + known, title: 'state: ' + text }, text);
  }

  // A label's colour lightened for the dark log console.
  function tint(hex, amount = 0.35) {
    const channels = [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
    return 'rgb(' + channels.map((c) => Math.round(c + (255 - c) * amount)).join(',') + ')';
  }

  function setStatus(kind, text) {
    const status = document.getElementById('status');
    status.className = 'status status-' + kind;
    status.textContent = text;
  }

  function setCrumbs(...items) {
    const nav = document.getElementById('crumbs');
    nav.replaceChildren();
    items.forEach((item, index) => {
      if (index) nav.append(el('span', { class: 'crumb-sep' }, '/'));
      nav.append(item.href ? el('a', { href: item.href }, item.text) : el('span', { class: 'crumb-here' }, item.text));
    });
  }

  // -- numbers and times -----------------------------------------------------------------------

  function num(value) {
    return value === null || value === undefined ? NaN : Number(value);
  }

  function pad(n, width = 2) {
    return String(n).padStart(width, '0');
  }

  function clock(ts, millis = false) {
    const d = new Date(ts * 1000);
    const base = pad(d.getHours()) + ':' + pad(d.getMinutes()) + ':' + pad(d.getSeconds());
    return millis ? base + '.' + pad(d.getMilliseconds(), 3) : base;
  }

  function dateTime(ts) {
    if (ts === null || ts === undefined) return '–';
    const d = new Date(ts * 1000);
    return d.getFullYear() + '-' + pad(d.getMonth() + 1) + '-' + pad(d.getDate()) + ' ' + clock(ts);
  }

  function duration(seconds) {
    if (!Number.isFinite(seconds) || seconds < 0) return '–';
    const s = Math.round(seconds);
    if (s < 60) return s + 's';
    if (s < 3600) return Math.floor(s / 60) + 'm ' + pad(s % 60) + 's';
    if (s < 86400) return Math.floor(s / 3600) + 'h ' + pad(Math.floor((s % 3600) / 60)) + 'm';
    return Math.floor(s / 86400) + 'd ' + Math.floor((s % 86400) / 3600) + 'h';
  }

  function ago(ts) {
    if (ts === null || ts === undefined) return '–';
    return duration(Date.now() / 1000 - ts) + ' ago';
  }

  function count(n) {
    return n === null || n === undefined ? '–' : Number(n).toLocaleString('en-US');
  }

  function value(v) {
    if (typeof v === 'string') return v;
    if (!Number.isFinite(v)) return String(v);
    const abs = Math.abs(v);
    if (abs !== 0 && (abs >= 1e6 || abs < 1e-3)) return v.toExponential(3);
    return String(Number(v.toPrecision(5)));
  }

  function compact(v) {
    const abs = Math.abs(v);
    if (abs >= 1e9) return Number((v / 1e9).toPrecision(3)) + 'G';
    if (abs >= 1e6) return Number((v / 1e6).toPrecision(3)) + 'M';
    if (abs >= 1e4) return Number((v / 1e3).toPrecision(3)) + 'k';
    if (abs !== 0 && abs < 1e-3) return v.toExponential(1);
    return String(Number(v.toPrecision(4)));
  }

  function niceTicks(low, high, wanted, least = 0) {
    const raw = (high - low) / wanted;
    const magnitude = 10 ** Math.floor(Math.log10(raw));
    const norm = raw / magnitude;
    const step = Math.max(least, (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * magnitude);
    const ticks = [];
    for (let t = Math.ceil(low / step) * step; t <= high + step * 1e-9; t += step) {
      ticks.push(Number(t.toPrecision(12)));
    }
    return ticks;
  }

  const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];

  function timeTicks(low, high, wanted) {
    const step = TIME_STEPS.find((s) => (high - low) / s <= wanted) || 86400 * Math.ceil((high - low) / wanted / 86400);
    const offset = new Date(low * 1000).getTimezoneOffset() * 60;
    const ticks = [];
    for (let t = Math.ceil((low - offset) / step) * step + offset; t <= high; t += step) ticks.push(t);
    return { ticks, step };
  }

  // -- charts ----------------------------------------------------------------------------------

  const H = 200;
  const M = { left: 50, right: 12, top: 10, bottom: 24 };

  // Labels shown or hidden, and their colours: shared by every chart of a run page.
  class Labels {
    constructor() {
      this.names = [];
      this.hidden = new Set();
      this.listeners = [];
    }
    setNames(names) {
      for (const name of names) if (!this.names.includes(name)) this.names.push(name);
    }
    color(label) {
      let index = this.names.indexOf(label);
      if (index < 0) {
        this.names.push(label);
        index = this.names.length - 1;
      }
      return PALETTE[index % PALETTE.length];
    }
    toggle(label) {
      if (this.hidden.has(label)) this.hidden.delete(label);
      else this.hidden.add(label);
      for (const listener of this.listeners) listener();
    }
  }

  class Chart {
    constructor(key, title, labels) {
      this.key = key;
      this.labels = labels;
      this.series = [];
      this.xKind = 'step';
      this.info = el('span', { class: 'chart-info' });
      this.plot = el('div', { class: 'plot' });
      this.tooltip = el('div', { class: 'tooltip', hidden: true });
      this.legend = el('div', { class: 'legend' });
      this.element = el('figure', { class: 'chart', dataset: { key } },
        el('figcaption', { class: 'chart-head' }, el('span', { class: 'chart-title', title }, title), this.info),
        this.plot, this.legend);
      labels.listeners.push(() => this.draw());
      this.width = 0;
      new ResizeObserver(() => {
        if (this.series.length && Math.round(this.plot.clientWidth) !== this.width) this.draw();
      }).observe(this.plot);
    }

    set(xKind, series) {
      this.xKind = xKind;
      this.series = series.map((s) => ({
        label: s.label,
        name: s.name || s.label,
        count: s.count,
        downsampled: s.downsampled,
        points: s.data.map((row) => ({ x: row[0], y: num(row[1]), lo: num(row[3]), hi: num(row[4]), n: row[5] })),
      }));
      const total = this.series.reduce((sum, s) => sum + s.count, 0);
      const cut = this.series.some((s) => s.downsampled);
      this.info.textContent = count(total) + ' points' + (cut ? ' · downsampled' : '');
      this.draw();
    }

    draw() {
      this.width = Math.round(this.plot.clientWidth);
      // Drawn at its own pixel width, so text never scales with the chart.
      const W = Math.max(280, this.width || 560);
      const visible = this.series.filter((s) => !this.labels.hidden.has(s.label));
      this.drawLegend();
      let x0 = Infinity; let x1 = -Infinity; let y0 = Infinity; let y1 = -Infinity;
      for (const s of visible) {
        for (const p of s.points) {
          if (!Number.isFinite(p.x)) continue;
          x0 = Math.min(x0, p.x);
          x1 = Math.max(x1, p.x);
          for (const v of [p.y, p.lo, p.hi]) {
            if (Number.isFinite(v)) {
              y0 = Math.min(y0, v);
              y1 = Math.max(y1, v);
            }
          }
        }
      }
      const canvas = svg('svg', { viewBox: `0 0 ${W} ${H}`, class: 'plot-svg', role: 'img' });
      canvas.setAttribute('aria-label', this.key);
      this.plot.replaceChildren(canvas, this.tooltip);
      if (!Number.isFinite(x0) || !Number.isFinite(y0)) {
        const text = svg('text', { x: W / 2, y: H / 2, 'text-anchor': 'middle', class: 'no-data' });
        text.textContent = this.series.length ? 'every line is hidden' : 'no values';
        canvas.append(text);
        return;
      }
      if (x0 === x1) { x0 -= 1; x1 += 1; }
      if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
      const yPad = (y1 - y0) * 0.06;
      y0 -= yPad;
      y1 += yPad;
      const sx = (x) => M.left + ((x - x0) / (x1 - x0)) * (W - M.left - M.right);
      const sy = (y) => M.top + (1 - (y - y0) / (y1 - y0)) * (H - M.top - M.bottom);
      const clampY = (y) => Math.max(M.top - 2, Math.min(H - M.bottom + 2, sy(y)));

      for (const t of niceTicks(y0, y1, 5)) {
        canvas.append(svg('line', { x1: M.left, x2: W - M.right, y1: sy(t), y2: sy(t), class: 'gridline' }));
        const label = svg('text', { x: M.left - 6, y: sy(t) + 3.5, 'text-anchor': 'end', class: 'tick' });
        label.textContent = compact(t);
        canvas.append(label);
      }
      // Steps are whole numbers: no tick between two of them.
      const xTicks = this.xKind === 'ts' ? timeTicks(x0, x1, 6) : { ticks: niceTicks(x0, x1, 6, 1) };
      for (const t of xTicks.ticks) {
        const label = svg('text', { x: sx(t), y: H - 7, 'text-anchor': 'middle', class: 'tick' });
        label.textContent = this.xKind === 'ts' ? (xTicks.step < 60 ? clock(t) : clock(t).slice(0, 5)) : compact(t);
        canvas.append(label);
      }
      canvas.append(svg('line', { x1: M.left, x2: W - M.right, y1: H - M.bottom, y2: H - M.bottom, class: 'axis' }));

      for (const s of visible) {
        const color = this.labels.color(s.label);
        if (s.downsampled) {
          const band = bandPath(s.points, sx, clampY);
          if (band) canvas.append(svg('path', { d: band, fill: color, class: 'band', 'data-label': s.label }));
        }
        const line = linePath(s.points, sx, clampY);
        const path = svg('path', { d: line.d, stroke: color, class: 'line', 'data-label': s.label });
        canvas.append(path);
        for (const [x, y] of line.lonely) {
          canvas.append(svg('circle', { cx: x, cy: y, r: 2.5, fill: color, class: 'dot', 'data-label': s.label }));
        }
      }
      this.hover(canvas, visible, { W, sx, sy, x0, x1 });
    }

    drawLegend() {
      this.legend.replaceChildren();
      const seen = new Set();
      for (const s of this.series) {
        if (seen.has(s.name)) continue;
        seen.add(s.name);
        const swatch = el('span', { class: 'swatch' });
        swatch.style.background = this.labels.color(s.label);
        const off = this.labels.hidden.has(s.label);
        this.legend.append(el('button', {
          type: 'button',
          class: 'legend-item' + (off ? ' off' : ''),
          dataset: { label: s.label },
          'aria-pressed': off ? 'false' : 'true',
          title: (off ? 'show ' : 'hide ') + s.label + ' on every chart',
          onclick: () => this.labels.toggle(s.label),
        }, swatch, s.name));
      }
    }

    hover(canvas, visible, { W, sx, sy, x0, x1 }) {
      const cross = svg('line', { y1: M.top, y2: H - M.bottom, class: 'crosshair', visibility: 'hidden' });
      const dots = svg('g', {});
      const target = svg('rect', {
        x: M.left, y: M.top, width: W - M.left - M.right, height: H - M.top - M.bottom, class: 'hover-target',
      });
      canvas.append(cross, dots, target);
      const hide = () => {
        cross.setAttribute('visibility', 'hidden');
        dots.replaceChildren();
        this.tooltip.hidden = true;
      };
      target.addEventListener('mouseleave', hide);
      target.addEventListener('mousemove', (event) => {
        const box = canvas.getBoundingClientRect();
        const at = x0 + (((event.clientX - box.left) / box.width) * W - M.left) / (W - M.left - M.right) * (x1 - x0);
        const rows = [];
        let nearestX = null;
        for (const s of visible) {
          const p = nearest(s.points, at);
          if (!p) continue;
          if (nearestX === null || Math.abs(p.x - at) < Math.abs(nearestX - at)) nearestX = p.x;
          rows.push({ s, p });
        }
        if (nearestX === null) return hide();
        cross.setAttribute('x1', sx(nearestX));
        cross.setAttribute('x2', sx(nearestX));
        cross.setAttribute('visibility', 'visible');
        dots.replaceChildren();
        const body = [el('div', { class: 'tooltip-head' }, this.xKind === 'ts' ? dateTime(nearestX) : 'step ' + count(nearestX))];
        for (const { s, p } of rows) {
          const color = this.labels.color(s.label);
          if (Number.isFinite(p.y)) {
            dots.append(svg('circle', { cx: sx(p.x), cy: sy(p.y), r: 3, fill: color, class: 'hover-dot' }));
          }
          const swatch = el('span', { class: 'swatch' });
          swatch.style.background = color;
          const spread = p.n > 1 ? el('span', { class: 'tooltip-range' }, value(p.lo) + ' … ' + value(p.hi)) : null;
          body.push(el('div', { class: 'tooltip-row' }, swatch, el('span', { class: 'tooltip-name' }, s.name),
            el('span', { class: 'tooltip-value' }, value(p.y)), spread));
        }
        this.tooltip.replaceChildren(...body);
        this.tooltip.hidden = false;
        const plotBox = this.plot.getBoundingClientRect();
        const left = event.clientX - plotBox.left;
        const flip = left > plotBox.width * 0.6;
        this.tooltip.style.left = (flip ? left - this.tooltip.offsetWidth - 14 : left + 14) + 'px';
        this.tooltip.style.top = Math.max(0, event.clientY - plotBox.top - 20) + 'px';
      });
    }
  }

  function nearest(points, x) {
    if (!points.length) return null;
    let lo = 0;
    let hi = points.length - 1;
    while (hi - lo > 1) {
      const mid = (lo + hi) >> 1;
      if (points[mid].x < x) lo = mid;
      else hi = mid;
    }
    return Math.abs(points[lo].x - x) <= Math.abs(points[hi].x - x) ? points[lo] : points[hi];
  }

  // A line through the finite values; a non-finite one breaks it. Points alone get a dot.
  function linePath(points, sx, sy) {
    const parts = [];
    const lonely = [];
    let run = [];
    const flush = () => {
      if (run.length === 1) lonely.push(run[0]);
      if (run.length) parts.push('M' + run.map(([x, y]) => x.toFixed(1) + ',' + y.toFixed(1)).join('L'));
      run = [];
    };
    for (const p of points) {
      if (Number.isFinite(p.y)) run.push([sx(p.x), sy(p.y)]);
      else flush();
    }
    flush();
    return { d: parts.join('') || 'M0,0', lonely };
  }

  // The min..max envelope of downsampled buckets, so spikes inside a bucket stay visible.
  function bandPath(points, sx, sy) {
    const usable = points.filter((p) => !Number.isNaN(p.lo) && !Number.isNaN(p.hi));
    if (usable.length < 2) return null;
    const top = usable.map((p) => sx(p.x).toFixed(1) + ',' + sy(p.hi).toFixed(1));
    const bottom = usable.reverse().map((p) => sx(p.x).toFixed(1) + ',' + sy(p.lo).toFixed(1));
    return 'M' + top.join('L') + 'L' + bottom.join('L') + 'Z';
  }

  // -- views -----------------------------------------------------------------------------------

  let current = null;

  function route() {
    if (current) current.stop();
    const match = location.hash.match(/^#\/run\/(.+)$/);
    let runId = null;
    try {
      runId = match ? decodeURIComponent(match[1]) : null;
    } catch (error) {
      runId = null;  // a malformed address: show the runs
    }
    current = runId === null ? runsView() : runView(runId);
  }

  // Calls `tick` now and again `every` ms after each call ends, until stopped.
  function poll(tick, every) {
    let timer = null;
    let stopped = false;
    const loop = async () => {
      if (stopped) return;
      if (!document.hidden) {
        try {
          await tick();
        } catch (error) {
          if (!(error instanceof ApiError)) throw error;
        }
      }
      if (!stopped) timer = setTimeout(loop, every);
    };
    loop();
    return () => {
      stopped = true;
      clearTimeout(timer);
    };
  }

  function section(title, ...content) {
    return el('section', { class: 'card' }, el('div', { class: 'card-head' }, el('h2', null, title)), ...content);
  }

  function errorCard(error) {
    const text = error.status === 404 ? error.message : 'Could not load: ' + error.message;
    return el('section', { class: 'card error-card' }, el('h2', null, error.status === 404 ? 'Not found' : 'Error'),
      el('p', null, text), el('p', null, el('a', { href: '#/' }, '← All runs')));
  }

  function runsView() {
    setCrumbs({ text: 'Runs' });
    document.title = 'runbus · runs';
    const main = document.getElementById('main');
    const rows = el('tbody');
    const total = el('span', { class: 'muted' });
    const empty = el('p', { class: 'empty', hidden: true },
      'No runs yet. Log from your job with producer.init(), and keep `runbus ingest` running.');
    main.replaceChildren(el('section', { class: 'card' },
      el('div', { class: 'card-head' }, el('h2', null, 'Runs'), total),
      el('div', { class: 'table-wrap' }, el('table', { class: 'table runs-table' },
        el('thead', null, el('tr', null, ['Run', 'State', 'Primary', 'Labels', 'Metrics', 'Logs', 'Started', 'Duration',
          'Last event'].map((h) => el('th', null, h)))),
        rows)),
      empty));
    const stop = poll(async () => {
      const doc = await api('/api/runs');
      total.textContent = doc.runs.length + (doc.runs.length === 1 ? ' run' : ' runs');
      empty.hidden = doc.runs.length > 0;
      rows.replaceChildren(...doc.runs.map(runRow));
    }, RUNS_EVERY_MS);
    return { stop };
  }

  function runRow(run) {
    const href = '#/run/' + encodeURIComponent(run.run_id);
    const chips = run.labels.slice(0, 8).map((lab) => el('span', { class: 'chip', title: lab.label + ': ' + lab.state },
      el('span', { class: 'dot dot-' + (STATES.has(lab.state) ? lab.state : 'unknown') }), lab.label));
    if (run.labels.length > 8) chips.push(el('span', { class: 'chip more' }, '+' + (run.labels.length - 8)));
    const end = run.state === 'running' ? Date.now() / 1000 : (run.ended_ts ?? run.last_ts);
    return el('tr', { class: 'run-row', dataset: { run: run.run_id }, onclick: (event) => {
      if (!event.target.closest('a')) location.hash = href;
    } },
    el('td', null, el('a', { class: 'run-link mono', href }, run.run_id)),
    el('td', null, stateBadge(run.state, run.exit_code)),
    el('td', { class: 'mono' }, run.primary ?? '–'),
    el('td', null, el('div', { class: 'chips' }, chips)),
    el('td', { class: 'num' }, count(run.counts.metric)),
    el('td', { class: 'num' }, count(run.counts.log)),
    el('td', { class: 'nowrap' }, dateTime(run.started_ts)),
    el('td', { class: 'nowrap' }, run.started_ts ? duration(end - run.started_ts) : '–'),
    el('td', { class: 'nowrap muted' }, ago(run.last_ts)));
  }

  function runView(runId) {
    setCrumbs({ text: 'Runs', href: '#/' }, { text: runId });
    document.title = 'runbus · ' + runId;
    const main = document.getElementById('main');
    const labels = new Labels();
    const header = el('section', { class: 'card run-header' });
    const metricGrid = el('div', { class: 'grid' });
    const metricNote = el('span', { class: 'muted' });
    const systemGrid = el('div', { class: 'grid' });
    const systemNote = el('span', { class: 'muted' });
    const labelsBody = el('div', { class: 'table-wrap' });
    const configBody = el('div', { class: 'config-wrap' });
    const logs = logsPanel(runId, labels);
    main.replaceChildren(
      header,
      el('div', { class: 'columns' },
        el('section', { class: 'card', id: 'labels' }, el('div', { class: 'card-head' }, el('h2', null, 'Labels'),
          el('span', { class: 'muted' }, 'one per rank, each with its own state')), labelsBody),
        el('section', { class: 'card', id: 'config' }, el('div', { class: 'card-head' }, el('h2', null, 'Config'),
          el('span', { class: 'muted' }, "from the primary's start event")), configBody)),
      el('section', { class: 'card', id: 'metrics' }, el('div', { class: 'card-head' }, el('h2', null, 'Metrics'), metricNote),
        metricGrid),
      logs.element,
      el('section', { class: 'card', id: 'system' }, el('div', { class: 'card-head' }, el('h2', null, 'System'), systemNote),
        systemGrid));

    const metricCharts = new Map();
    const systemCharts = new Map();
    let lastState = null;
    let stopped = false;

    async function refresh() {
      let run;
      try {
        run = await api(runPath(runId));
      } catch (error) {
        if (error.status === 404 || error.status === 400) {
          main.replaceChildren(errorCard(error));
          stopPolling();
          return;
        }
        throw error;
      }
      labels.setNames(run.labels.map((lab) => lab.label));
      renderHeader(header, run);
      labelsBody.replaceChildren(labelsTable(run, labels));
      configBody.replaceChildren(configTable(run.config));
      logs.setLabels(run.labels.map((lab) => lab.label));
      await Promise.all([refreshMetrics(), refreshSystem()]);
      // A run that is over changes no more: one last refresh after it ends, then stop.
      if (run.state !== 'running' && lastState !== null && lastState !== 'running') stopPolling();
      lastState = run.state;
    }

    async function refreshMetrics() {
      const { keys } = await api(runPath(runId, '/metrics'));
      metricNote.textContent = keys.length ? keys.length + (keys.length === 1 ? ' key' : ' keys') + ' · one line per label'
        : '';
      if (!keys.length) {
        metricGrid.replaceChildren(el('p', { class: 'empty' }, 'No metrics logged yet.'));
        return;
      }
      const docs = await inBatches(keys.map((key) => () => api(runPath(runId, '/metrics/series'), { key })));
      if (stopped) return;
      if (!metricCharts.size) metricGrid.replaceChildren();
      docs.forEach((doc) => {
        let chart = metricCharts.get(doc.key);
        if (!chart) {
          chart = new Chart(doc.key, doc.key, labels);
          metricCharts.set(doc.key, chart);
          metricGrid.append(chart.element);
        }
        chart.set(doc.x, doc.series);
      });
    }

    async function refreshSystem() {
      const doc = await api(runPath(runId, '/system'), { points: SYSTEM_POINTS });
      if (stopped) return;
      const groups = systemGroups(doc.keys);
      systemNote.textContent = groups.length ? 'sampled per label' : '';
      if (!groups.length) {
        systemGrid.replaceChildren(el('p', { class: 'empty' }, 'No system samples (the producer samples every 15 s).'));
        return;
      }
      if (!systemCharts.size) systemGrid.replaceChildren();
      for (const group of groups) {
        let chart = systemCharts.get(group.key);
        if (!chart) {
          chart = new Chart(group.key, group.title, labels);
          systemCharts.set(group.key, chart);
          systemGrid.append(chart.element);
        }
        chart.set('ts', group.series);
      }
    }

    const stopPolling = poll(refresh, RUN_EVERY_MS);
    return {
      stop() {
        stopped = true;
        stopPolling();
        logs.stop();
      },
    };
  }

  function renderHeader(header, run) {
    const end = run.state === 'running' ? Date.now() / 1000 : (run.ended_ts ?? run.last_ts);
    const dead = run.dead_letters;
    let deadText = 'unknown (no Redis)';
    if (dead.total !== null) deadText = count(dead.run) + (dead.complete ? '' : '+') + ' of ' + count(dead.total) + ' in Redis';
    const facts = [
      ['Primary', run.primary ?? '–', 'mono'],
      ['Started', dateTime(run.started_ts)],
      [run.state === 'running' ? 'Running for' : 'Duration', run.started_ts ? duration(end - run.started_ts) : '–'],
      ['Exit code', run.exit_code ?? '–', run.exit_code ? 'bad' : ''],
      ['Labels', count(run.labels.length)],
      ['Events', count(run.counts.metric) + ' metric · ' + count(run.counts.log) + ' log · ' + count(run.counts.system) + ' system'],
      ['Gaps', run.gaps ? count(run.gaps) + ' missing' : 'none', run.gaps ? 'warn' : ''],
      ['Dead letters', deadText, dead.run ? 'warn' : ''],
    ];
    const refused = run.primary_refused || [];
    if (refused.length) facts.push(['Refused primary', refused.map((r) => r.label + ' at ' + dateTime(r.ts)).join(', '), 'warn']);
    header.replaceChildren(
      el('div', { class: 'run-title' }, el('h1', { class: 'mono' }, run.run_id), stateBadge(run.state)),
      el('dl', { class: 'facts' }, facts.map(([name, text, kind]) =>
        el('div', { class: 'fact' }, el('dt', null, name), el('dd', { class: kind || null }, String(text))))));
  }

  function labelsTable(run, labels) {
    const dead = run.dead_letters.labels || {};
    const head = ['Label', 'State', 'Epoch', 'Last seq', 'Events', 'Gaps', 'Dead letters', 'Host', 'Last event'];
    return el('table', { class: 'table labels-table' },
      el('thead', null, el('tr', null, head.map((h) => el('th', null, h)))),
      el('tbody', null, run.labels.map((lab) => {
        const swatch = el('span', { class: 'swatch' });
        swatch.style.background = labels.color(lab.label);
        return el('tr', { dataset: { label: lab.label } },
          el('td', { class: 'mono nowrap' }, swatch, lab.label, lab.primary ? el('span', { class: 'primary', title: 'primary' }, 'primary') : null),
          el('td', null, stateBadge(lab.state, lab.exit_code)),
          el('td', { class: 'num' }, lab.epoch),
          el('td', { class: 'num' }, count(lab.last_seq)),
          el('td', { class: 'num' }, count(lab.events)),
          el('td', { class: 'num' + (lab.missing ? ' warn' : '') }, count(lab.missing)),
          el('td', { class: 'num' + (dead[lab.label] ? ' warn' : '') }, run.dead_letters.total === null ? '–' : count(dead[lab.label] || 0)),
          el('td', { class: 'mono', title: lab.rank === null ? null : 'rank ' + lab.rank }, lab.host ?? '–'),
          el('td', { class: 'nowrap muted' }, lab.last_ts ? clock(lab.last_ts) : '–'));
      })));
  }

  function flatten(object, prefix, out) {
    for (const [name, item] of Object.entries(object)) {
      const key = prefix ? prefix + '.' + name : name;
      if (item && typeof item === 'object' && !Array.isArray(item) && Object.keys(item).length) flatten(item, key, out);
      else out.push([key, typeof item === 'string' ? item : JSON.stringify(item)]);
    }
    return out;
  }

  function configTable(config) {
    const rows = config ? flatten(config, '', []) : [];
    if (!rows.length) return el('p', { class: 'empty' }, "No config in the primary's start event.");
    return el('table', { class: 'table config-table' }, el('tbody', null,
      rows.map(([key, text]) => el('tr', null, el('th', { class: 'mono' }, key), el('td', { class: 'mono' }, text)))));
  }

  // -- system charts: one per figure, a line per label; GPU figures of every index together ----

  const SYSTEM_TITLES = {
    'proc.cpu_percent': 'Process CPU (%)',
    'sys.cpu_percent': 'Machine CPU (%)',
    'proc.rss_mb': 'Process memory, RSS (MB)',
    'sys.memory_percent': 'Machine memory (%)',
    'sys.memory_used_mb': 'Machine memory used (MB)',
    'proc.threads': 'Process threads',
    'gpu.util': 'GPU utilisation (%)',
    'gpu.mem_used_mb': 'GPU memory used (MB)',
    'gpu.proc_mem_mb': 'GPU memory of the process (MB)',
    'gpu.mem_total_mb': 'GPU memory total (MB)',
    'gpu.power_w': 'GPU power (W)',
    'gpu.temp_c': 'GPU temperature (°C)',
    'gpu.sm_clock_mhz': 'GPU SM clock (MHz)',
    'sys.disk_read_mb_s': 'Disk read (MB/s)',
    'sys.disk_write_mb_s': 'Disk write (MB/s)',
    'sys.net_sent_mb_s': 'Network sent (MB/s)',
    'sys.net_recv_mb_s': 'Network received (MB/s)',
  };
  const SYSTEM_ORDER = Object.keys(SYSTEM_TITLES);

  function systemGroups(keys) {
    const groups = new Map();
    for (const { key, series } of keys) {
      const gpu = key.match(/^gpu\.(\d+)\.(.+)$/);
      const group = gpu ? 'gpu.' + gpu[2] : key;
      if (!groups.has(group)) groups.set(group, { key: group, title: SYSTEM_TITLES[group] || key, series: [] });
      for (const s of series) groups.get(group).series.push({ ...s, name: gpu ? s.label + ' · gpu' + gpu[1] : s.label });
    }
    const rank = (key) => (SYSTEM_ORDER.includes(key) ? SYSTEM_ORDER.indexOf(key) : SYSTEM_ORDER.length);
    return [...groups.values()].sort((a, b) => rank(a.key) - rank(b.key) || (a.key < b.key ? -1 : 1));
  }

  // -- logs --------------------------------------------------------------------------------------

  function logsPanel(runId, labels) {
    const labelSelect = el('select', { class: 'input', id: 'log-label', 'aria-label': 'Label' },
      el('option', { value: '' }, 'All labels'));
    const levelSelect = el('select', { class: 'input', id: 'log-level', 'aria-label': 'Minimum level' },
      el('option', { value: '' }, 'All levels'), LEVELS.slice(1).map((l) => el('option', { value: l }, l + ' and above')));
    const grep = el('input', { class: 'input', id: 'log-grep', type: 'search', placeholder: 'Filter text', 'aria-label': 'Text filter' });
    const follow = el('input', { type: 'checkbox', id: 'log-follow' });
    const summary = el('span', { class: 'muted', id: 'log-count' });
    const list = el('div', { class: 'log-list', id: 'log-list', role: 'log', 'aria-live': 'off' });
    const more = el('button', { type: 'button', class: 'button', hidden: true }, 'Load more');
    const element = el('section', { class: 'card', id: 'logs' },
      el('div', { class: 'card-head' }, el('h2', null, 'Logs'), summary),
      el('div', { class: 'toolbar' }, labelSelect, levelSelect, grep,
        el('label', { class: 'toggle' }, follow, el('span', null, 'Follow'))),
      list, el('div', { class: 'more' }, more));

    let offset = 0;
    let generation = 0;
    let loading = false;
    let hasMore = false;
    const seen = new Set();
    let known = [];

    function filters() {
      return { label: labelSelect.value, level: levelSelect.value, grep: grep.value };
    }

    function row(line) {
      const level = LEVELS.includes(line.level.toUpperCase()) ? line.level.toLowerCase() : 'info';
      const name = el('span', { class: 'log-label' }, line.label);
      name.style.color = tint(labels.color(line.label));
      return el('div', { class: 'log-row level-' + level, dataset: { label: line.label, level: line.level } },
        el('span', { class: 'log-time', title: dateTime(line.ts) }, clock(line.ts, true)),
        name,
        el('span', { class: 'log-level' }, line.level),
        el('span', { class: 'log-text' }, line.text));
    }

    async function load(reset, catchUp = false) {
      if (loading && !reset) return;
      const mine = reset ? ++generation : generation;
      loading = true;
      try {
        if (reset) {
          offset = 0;
          seen.clear();
        }
        const from = catchUp ? Math.max(0, offset - LOG_OVERLAP) : offset;
        const doc = await api(runPath(runId, '/logs'), { ...filters(), offset: from, limit: catchUp ? LOG_CATCH_UP : LOG_PAGE });
        if (mine !== generation) return;
        const atBottom = list.scrollTop + list.clientHeight >= list.scrollHeight - 8;
        if (reset) list.replaceChildren();
        const fresh = doc.lines.filter((line) => {
          const id = line.label + '/' + line.epoch + '/' + line.seq;
          if (seen.has(id)) return false;
          seen.add(id);
          return true;
        });
        list.append(...fresh.map(row));
        while (list.childElementCount > LOG_KEEP) list.firstElementChild.remove();
        offset = doc.next_offset;
        hasMore = doc.more;
        more.hidden = !hasMore || follow.checked;
        summary.textContent = list.childElementCount ? count(list.childElementCount) + ' lines shown' : '';
        if (!list.childElementCount) list.append(el('p', { class: 'empty', id: 'log-empty' }, 'No log lines match.'));
        else list.querySelector('#log-empty')?.remove();
        if (follow.checked && (atBottom || reset || catchUp)) list.scrollTop = list.scrollHeight;
        if (follow.checked && doc.more) {
          loading = false;
          await load(false, true);
        }
      } finally {
        if (mine === generation) loading = false;
      }
    }

    let typing = null;
    labelSelect.addEventListener('change', () => load(true));
    levelSelect.addEventListener('change', () => load(true));
    grep.addEventListener('input', () => {
      clearTimeout(typing);
      typing = setTimeout(() => load(true), 300);
    });
    more.addEventListener('click', () => load(false));
    follow.addEventListener('change', () => {
      if (follow.checked) load(false, true);
      else more.hidden = !hasMore;
    });
    load(true).catch(() => {});
    const stopFollow = poll(async () => {
      if (follow.checked) await load(false, true);
    }, FOLLOW_EVERY_MS);

    return {
      element,
      setLabels(names) {
        if (names.join('\n') === known.join('\n')) return;
        known = names.slice();
        const chosen = labelSelect.value;
        labelSelect.replaceChildren(el('option', { value: '' }, 'All labels'), ...names.map((n) => el('option', { value: n }, n)));
        labelSelect.value = names.includes(chosen) ? chosen : '';
      },
      stop: stopFollow,
    };
  }

  window.addEventListener('hashchange', route);
  route();
})();
