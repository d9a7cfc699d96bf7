// @ts-check
// The straggler view: a label x step heatmap of seconds per step (a canvas; each cell coloured by
// its ratio to that step bucket's median across labels) and the table of the slowest labels,
// chronic (behind in most buckets) or one-off (one bad stretch), with how far behind they are: only
// the labels behind the median (the server's kind), not those on time or faster.

import { count, duration, el, printable, swatch, value } from './dom.js';
import { labelColor } from './colors.js';

const MAX_HEIGHT = 560;
const TABLE_ROWS = 20;
const LEFT = 86;
const BOTTOM = 22;

// Ratio to the median -> colour: at or under the median pale, then amber, red, dark red at 2x.
function heat(ratio) {
  if (!Number.isFinite(ratio)) return [236, 239, 244];
  const t = Math.max(0, Math.min(1, (ratio - 1) / 1));
  const stops = [[230, 244, 234], [254, 224, 139], [244, 109, 67], [165, 0, 38]];
  const at = t * (stops.length - 1);
  const i = Math.min(stops.length - 2, Math.floor(at));
  const f = at - i;
  return stops[i].map((c, k) => Math.round(c + (stops[i + 1][k] - c) * f));
}

function steps(bucket) {
  if (!bucket) return '';
  return bucket.from === bucket.to ? ' at step ' + count(bucket.to) : ' at steps ' + count(bucket.from) + '–' + count(bucket.to);
}

function percent(fraction) {
  const p = fraction * 100;
  return Math.abs(p) < 0.05 ? '0.0%' : (p > 0 ? '+' : '') + p.toFixed(1) + '%';
}

/**
 * @param {{labels: string[], buckets: Array<{from: number, to: number}>, cells: number[][], median: number[], slowest: any[]}} data
 * @param {{hostOf?: (label: string) => string|null|undefined, labelClicked?: (label: string) => void}} [options]
 */
export function stragglerView(data, { hostOf = () => null, labelClicked = () => {} } = {}) {
  const { labels, buckets, cells, median, slowest } = data;
  const order = labels.map((label, i) => i);  // rows in the labels' own order (rank order)
  const canvas = el('canvas', { class: 'heatmap', id: 'straggler-heatmap', role: 'img', 'aria-label': 'step time per label and step' });
  const tip = el('div', { class: 'tooltip', hidden: true });
  const wrap = el('div', { class: 'heatmap-wrap' }, canvas, tip);
  // Up to 16 px a row; past MAX_HEIGHT / 2 px a row, rows share pixels (thousands of labels).
  const rowHeight = Math.min(16, MAX_HEIGHT / Math.max(1, labels.length));
  const height = Math.ceil(rowHeight * labels.length) + BOTTOM + 6;

  function draw() {
    const width = Math.max(320, Math.floor(wrap.clientWidth || 900));
    const ratio = window.devicePixelRatio || 1;
    canvas.width = width * ratio;
    canvas.height = height * ratio;
    canvas.style.width = width + 'px';
    canvas.style.height = height + 'px';
    const ctx = canvas.getContext('2d');
    ctx.scale(ratio, ratio);
    ctx.fillStyle = '#fff';
    ctx.fillRect(0, 0, width, height);
    const cellWidth = (width - LEFT - 8) / Math.max(1, buckets.length);
    order.forEach((i, row) => {
      for (let b = 0; b < buckets.length; b += 1) {
        const [r, g, bl] = heat(cells[i][b] / median[b]);
        ctx.fillStyle = `rgb(${r},${g},${bl})`;
        ctx.fillRect(LEFT + b * cellWidth, 3 + row * rowHeight, Math.ceil(cellWidth), rowHeight);
      }
    });
    ctx.fillStyle = '#69758a';
    ctx.font = '11px system-ui, sans-serif';
    ctx.textBaseline = 'middle';
    const every = Math.ceil(12 / rowHeight);
    order.forEach((i, row) => {
      if (row % every) return;
      ctx.fillText(printable(labels[i]).slice(0, 12), 4, 3 + row * rowHeight + rowHeight / 2);
    });
    ctx.textBaseline = 'alphabetic';
    const ticks = Math.min(buckets.length, 8);
    for (let t = 0; t < ticks; t += 1) {
      const b = Math.round((t * (buckets.length - 1)) / Math.max(1, ticks - 1));
      const last = t === ticks - 1 && ticks > 1;
      ctx.textAlign = last ? 'right' : 'left';
      ctx.fillText('step ' + count(last ? buckets[b].to : buckets[b].from), last ? width - 8 : LEFT + b * cellWidth, height - 6);
    }
    canvas.onmousemove = (event) => {
      const box = canvas.getBoundingClientRect();
      const b = Math.floor((event.clientX - box.left - LEFT) / cellWidth);
      const row = Math.floor((event.clientY - box.top - 3) / rowHeight);
      if (b < 0 || b >= buckets.length || row < 0 || row >= order.length) {
        tip.hidden = true;
        return;
      }
      const i = order[row];
      const seconds = cells[i][b];
      tip.replaceChildren(
        el('div', { class: 'tooltip-head' }, 'steps ' + count(buckets[b].from) + '–' + count(buckets[b].to)),
        el('div', { class: 'tooltip-row' }, swatch(labelColor(labels[i])), el('span', { class: 'tooltip-name' }, labels[i]),
          el('span', { class: 'tooltip-value' }, Number.isFinite(seconds) ? value(seconds) + ' s/step' : 'no data')),
        el('div', { class: 'tooltip-row' }, el('span', { class: 'tooltip-name' }, 'median'),
          el('span', { class: 'tooltip-value' }, value(median[b]) + ' s/step')),
        Number.isFinite(seconds) ? el('div', { class: 'tooltip-row' }, el('span', { class: 'tooltip-name' }, 'vs median'),
          el('span', { class: 'tooltip-value' }, '×' + value(seconds / median[b]))) : null);
      tip.hidden = false;
      tip.style.left = Math.min(event.clientX - box.left + 14, box.width - 220) + 'px';
      tip.style.top = (event.clientY - box.top + 10) + 'px';
    };
    canvas.onmouseleave = () => { tip.hidden = true; };
  }

  const legend = el('div', { class: 'heat-legend' }, el('span', { class: 'muted' }, 'vs the median of its steps:'),
    ...[1, 1.25, 1.5, 2].map((r) => {
      const box = el('span', { class: 'swatch' });
      box.style.background = `rgb(${heat(r).join(',')})`;
      return el('span', { class: 'heat-stop' }, box, r === 1 ? '≤ median' : '×' + r);
    }));

  const behind = slowest.filter((s) => s.kind);
  const rows = behind.slice(0, TABLE_ROWS).map((s, rank) => el('tr', { class: 'straggler-row', dataset: { label: s.label },
    title: 'show ' + s.label + ' on the charts', onclick: () => labelClicked(s.label) },
  el('td', { class: 'num' }, rank + 1),
  el('td', { class: 'mono nowrap' }, swatch(labelColor(s.label)), s.label),
  el('td', { class: 'mono' }, hostOf(s.label) ?? '–'),
  el('td', null, s.kind ? el('span', { class: 'kind kind-' + s.kind }, s.kind) : el('span', { class: 'muted' }, '–')),
  el('td', { class: 'num' + (s.behind > 0.05 ? ' warn' : '') }, percent(s.behind)),
  el('td', { class: 'num' }, s.worst > 1.05 ? '×' + s.worst.toFixed(2) + steps(s.worstSteps) : '–'),
  el('td', { class: 'num' }, Number.isFinite(s.secondsBehind) && s.secondsBehind >= 0.5 ? duration(s.secondsBehind) : '–')));
  const table = el('table', { class: 'table straggler-table', id: 'straggler-table' },
    el('thead', null, el('tr', null, ['#', 'Label', 'Host', 'Kind', 'Behind median (mean)', 'Worst', 'Time lost'].map((h) => el('th', null, h)))),
    el('tbody', null, rows));
  const none = behind.length ? null : el('p', { class: 'empty', id: 'straggler-none' }, 'No label is behind the median.');

  const element = el('div', { class: 'stragglers' }, legend, wrap,
    el('h3', { class: 'subhead' }, 'Labels behind the median'), none ?? el('div', { class: 'table-wrap' }, table));
  const resize = new ResizeObserver(() => draw());
  resize.observe(wrap);
  return { element, stop: () => resize.disconnect() };
}
