// @ts-check
// Runs compared (#/compare/ID,ID,...): each run in its own colour, the config keys on which they
// differ, and every metric key any of them logged, a chart per key with a line or envelope per
// run.

import { ApiError, ignoreApiErrors, poll } from './api.js';
import { Zoom, zoomed } from './chart.js';
import { runColor } from './colors.js';
import { configText } from './config.js';
import { count, el, setCrumbs, stateBadge, swatch } from './dom.js';
import { PanelGrid, refreshOnZoom } from './panels.js';
import { runHref } from './route.js';
import { Settings } from './settings.js';
import * as sources from './sources.js';
import { chartToolbar, pager } from './toolbar.js';

const COMPARE_EVERY_MS = 5000;
const ENVELOPE_GREY = '#98a2b3';

/** @param {string[]} ids the runs, in the order of the address */
export function compareView(ids) {
  setCrumbs({ text: 'Runs', href: '#/' }, { text: 'compare ' + ids.length + ' runs' });
  document.title = 'runbus · compare';
  const main = document.getElementById('main');
  const settings = new Settings();
  const zoom = new Zoom();
  const page = { settings, zoom };
  let runs = [];
  let query = '';
  let offset = 0;
  let mode = 'envelope';
  const modeSelect = el('select', { class: 'input', id: 'compare-mode', 'aria-label': 'What each run shows' },
    el('option', { value: 'envelope' }, 'Each run: envelope of its labels'),
    el('option', { value: 'primary' }, 'Each run: its primary label'));
  const toolbar = chartToolbar(settings, zoom, {
    showLabels: false,
    extra: modeSelect,
    onSearch(text) {
      query = text;
      offset = 0;
      refreshKeys().catch(ignoreApiErrors);
    },
  });
  const keyPager = pager((direction) => {
    offset = Math.max(0, offset + direction * sources.KEYS_PER_PAGE);
    refreshKeys().catch(ignoreApiErrors);
  });
  let owners = new Map();
  const grid = new PanelGrid(page, (key) => sources.compareChart(runs, key, {
    mode, xMode: settings.xMode, range: zoomed(zoom), owners: owners.get(key),
  }));
  const legend = el('div', { class: 'compare-runs', id: 'compare-runs' });
  const configBody = el('div', { class: 'config-wrap' });
  main.replaceChildren(
    el('section', { class: 'card' }, el('div', { class: 'card-head' }, el('h2', null, 'Runs compared'),
      el('span', { class: 'muted' }, 'each in its own colour')), legend),
    el('section', { class: 'card', id: 'compare-config' }, el('div', { class: 'card-head' }, el('h2', null, 'Config differences'),
      el('span', { class: 'muted' }, 'the keys whose values differ')), configBody),
    el('section', { class: 'card', id: 'metrics' },
      el('div', { class: 'card-head' }, el('h2', null, 'Metrics'), el('span', { class: 'spacer' }), keyPager.element),
      toolbar.element, grid.element));
  settings.onChange((what) => (what === 'fetch' ? grid.refresh() : grid.rerender()));
  refreshOnZoom(zoom, grid);
  modeSelect.addEventListener('change', () => {
    mode = /** @type {HTMLSelectElement} */ (modeSelect).value;
    grid.refresh().catch(ignoreApiErrors);
  });

  async function refreshKeys() {
    const keys = await sources.compareKeyPage(runs.map((r) => r.run_id), { query, offset });
    offset = keys.offset;
    owners = keys.owners;
    toolbar.setSearchNote(keys.error);
    keyPager.set({ offset: keys.offset, shown: keys.keys.length, total: keys.total });
    grid.setKeys(keys.keys, { searching: Boolean(query) });
  }

  let stopped = false;
  const polling = poll(async () => {
    const found = await Promise.all(ids.map(runOrMissing));
    if (stopped) return;
    found.forEach((r, i) => { r.color = runColor(i); });
    runs = found.filter((r) => !r.missing);
    legend.replaceChildren(...found.map(legendEntry));
    if (runs.length) configBody.replaceChildren(configDiffTable(await sources.compareConfig(runs.map((r) => r.run_id)), runs));
    await refreshKeys();
    await grid.refresh();
    if (runs.every((r) => r.state !== 'running')) polling.stop();
  }, COMPARE_EVERY_MS);
  return {
    stop() {
      stopped = true;
      polling.stop();
      grid.destroy();
    },
  };
}

// A run's document, or {run_id, missing: why} for an id the store does not know (or refuses).
function runOrMissing(id) {
  return sources.run(id).catch((error) => {
    if (error instanceof ApiError && (error.status === 404 || error.status === 400)) return { run_id: id, missing: error.message };
    throw error;
  });
}

function legendEntry(r) {
  return el('span', { class: 'compare-run', dataset: { run: r.run_id } },
    swatch(r.color),
    r.missing ? el('span', { class: 'mono bad' }, r.run_id + ' (' + r.missing + ')')
      : el('a', { class: 'mono', href: runHref(r.run_id) }, r.run_id),
    r.missing ? null : stateBadge(r.state, r.exit_code),
    r.missing ? null : el('span', { class: 'muted' }, count(r.labels.length) + (r.labels.length === 1 ? ' label' : ' labels')));
}

// A row per differing key, a column per run (in its colour); a key some runs lack says so.
function configDiffTable(diff, runs) {
  const same = count(diff.equal) + (diff.equal === 1 ? ' key' : ' keys') + ' with one value in every run';
  if (!diff.keys.length) return el('p', { class: 'empty' }, 'No config differences: ' + same + '.');
  const colorOf = new Map(runs.map((r) => [r.run_id, r.color]));
  const head = el('tr', null, el('th', null, 'Key'),
    diff.runs.map((id) => el('th', { class: 'mono' }, swatch(colorOf.get(id) || ENVELOPE_GREY), id)));
  const rows = diff.keys.map((row) => el('tr', { class: row.missing.length ? 'config-diff partial' : 'config-diff', dataset: { key: row.key } },
    el('th', { class: 'mono' }, row.key,
      row.missing.length ? el('span', { class: 'badge only-in', title: 'not set in ' + row.missing.join(', ') },
        'in ' + (diff.runs.length - row.missing.length) + ' of ' + diff.runs.length) : null),
    diff.runs.map((id) => (Object.hasOwn(row.values, id)
      ? el('td', { class: 'mono', dataset: { run: id } }, configText(row.values[id]))
      : el('td', { class: 'muted absent', dataset: { run: id }, title: 'not set in ' + id }, 'not set')))));
  return el('div', null, el('table', { class: 'table config-table config-diff-table' }, el('thead', null, head), el('tbody', null, rows)),
    el('p', { class: 'muted' }, same + ' not shown.'));
}
