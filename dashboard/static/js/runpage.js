// @ts-check
// One run's page (#/run/ID[/tab]): its header and three tabs. Charts: the labels, the merged
// config and summary, a chart per metric key (a page of keys at a time), the logs and the system
// figures. Stragglers: seconds per step of each label against the median. Hardware: each label's
// machine. The run is polled until it has ended; a tab is filled when opened, then at each poll
// while it is open.

import { ApiError, ignoreApiErrors, poll } from './api.js';
import { Zoom, zoomed } from './chart.js';
import { count, el, setCrumbs } from './dom.js';
import { hardwareView } from './hardware.js';
import { healthBanner } from './health.js';
import { logsPanel } from './logs.js';
import { PanelGrid, refreshOnZoom } from './panels.js';
import { runHref } from './route.js';
import { labelsTable, renderHeader, valuesTable } from './runfacts.js';
import { byName, MAX_LINES } from './series.js';
import { Settings } from './settings.js';
import * as sources from './sources.js';
import { stragglerView } from './stragglers.js';
import { systemCard } from './system.js';
import { chartToolbar, pager } from './toolbar.js';

const RUN_EVERY_MS = 5000;
const LABEL_ROWS = 64;

/**
 * What the parts of a run page share: the page's settings and zoom (`page`, as the charts take
 * them), the latest run document (null until the first answer), and whether the page was left.
 * @typedef {{runId: string, settings: Settings, zoom: Zoom, page: {settings: Settings, zoom: Zoom}, doc: any, stopped: boolean}} RunState
 */

/**
 * @param {string} runId
 * @param {string} firstTab one of route.js's TABS
 */
export function runView(runId, firstTab) {
  setCrumbs({ text: 'Runs', href: '#/' }, { text: runId });
  document.title = 'runbus · ' + runId;
  const main = document.getElementById('main');
  const settings = new Settings();
  settings.labelRows = LABEL_ROWS;
  const zoom = new Zoom();
  /** @type {RunState} */
  const state = { runId, settings, zoom, page: { settings, zoom }, doc: null, stopped: false };
  const header = el('section', { class: 'card run-header' });
  const banner = healthBanner(runId);
  const tabs = tabBar(runId, [['charts', 'Charts'], ['stragglers', 'Stragglers'], ['hardware', 'Hardware']]);
  const charts = chartsPane(state);
  const panes = { charts, stragglers: stragglersPane(state), hardware: hardwarePane(runId) };
  main.replaceChildren(header, banner.element, tabs.element, ...Object.values(panes).map((pane) => pane.element));

  // A tab is filled when first opened, then at each refresh while it is open (a finished run
  // stops refreshing, but a tab opened later is still filled once).
  let tab = firstTab;
  const filled = new Set();
  function setTab(name) {
    tab = name;
    tabs.select(tab);
    for (const pane of Object.values(panes)) pane.element.hidden = pane.element.dataset.pane !== tab;
    if (state.doc && !filled.has(tab)) fillTab().catch(ignoreApiErrors);
  }
  async function fillTab() {
    const name = tab;
    filled.add(name);
    await panes[name].fill();
  }

  let lastState = null;
  async function refresh() {
    const { doc, error } = await loadRun(runId);
    if (error) {
      main.replaceChildren(errorCard(error));
      polling.stop();
      return;
    }
    state.doc = doc;
    if (state.stopped) return;
    renderHeader(header, doc);
    await banner.refresh().catch(ignoreApiErrors);
    if (state.stopped) return;
    charts.show(doc);
    await fillTab();
    // A run that is over changes no more: one last refresh after it ends, then stop.
    if (doc.state !== 'running' && lastState !== null && lastState !== 'running') polling.stop();
    lastState = doc.state;
  }

  setTab(firstTab);
  const polling = poll(refresh, RUN_EVERY_MS);
  return {
    runId,
    setTab(name) {
      if (name !== tab) setTab(name);
    },
    stop() {
      state.stopped = true;
      polling.stop();
      charts.stop();
      panes.stragglers.stop();
    },
  };
}

// {doc}: the run document, its labels in their natural order (rank2 before rank10), as every
// list on the page shows them; {error} for a run the store does not know or refuses. Any other
// error is thrown.
/**
 * @param {string} runId
 * @returns {Promise<{doc: any, error?: undefined} | {doc?: undefined, error: ApiError}>}
 */
async function loadRun(runId) {
  try {
    const doc = await sources.run(runId);
    doc.labels = [...doc.labels].sort((a, b) => byName(a.label, b.label));
    return { doc };
  } catch (error) {
    if (error.status === 404 || error.status === 400) return { error };
    throw error;
  }
}

function errorCard(error) {
  const text = error.status === 404 ? error.message : 'Could not load: ' + error.message;
  return el('section', { class: 'card error-card' }, el('h2', null, error.status === 404 ? 'Not found' : 'Error'),
    el('p', null, text), el('p', null, el('a', { href: '#/' }, '← All runs')));
}

function tabBar(runId, names) {
  const links = names.map(([tab, text]) => el('a', { class: 'tab', dataset: { tab }, href: runHref(runId, tab) }, text));
  return {
    element: el('nav', { class: 'tabs', 'aria-label': 'Run views' }, links),
    select(tab) {
      for (const link of links) {
        const on = link.dataset.tab === tab;
        link.classList.toggle('active', on);
        if (on) link.setAttribute('aria-current', 'page');
        else link.removeAttribute('aria-current');
      }
    },
  };
}

// A card: its id, heading and the muted line beside it, then its body.
function card(id, title, note, ...body) {
  return el('section', { class: 'card', id }, el('div', { class: 'card-head' }, el('h2', null, title),
    el('span', { class: 'muted' }, note)), ...body);
}

function pane(name, ...children) {
  return el('div', { class: 'pane', dataset: { pane: name } }, ...children);
}

// -- the charts tab ------------------------------------------------------------------------------

/** @param {RunState} state */
function chartsPane(state) {
  const { runId, settings } = state;
  const labels = labelsCard(state);
  const configBody = el('div', { class: 'config-wrap' });
  const summaryBody = el('div', { class: 'config-wrap' });
  const metrics = metricsCard(state);
  const logs = logsPanel(runId);
  const system = systemCard(runId, state.page);
  const element = pane('charts',
    el('div', { class: 'columns' }, labels.element,
      el('div', { class: 'stack' },
        card('config', 'Config', "every label's, merged: the primary's value wins", configBody),
        card('summary', 'Summary', 'final values, merged alike', summaryBody))),
    metrics.element, logs.element, system.element);
  settings.onChange((what) => {
    labels.rerender();
    if (what === 'fetch') {
      metrics.grid.refresh().catch(ignoreApiErrors);
      system.refresh().catch(ignoreApiErrors);
    } else {
      metrics.grid.rerender();
      system.rerender();
    }
  });
  refreshOnZoom(state.zoom, metrics.grid);
  return {
    element,
    // A new run document: everything on the tab that comes from it.
    show(doc) {
      const names = doc.labels.map((lab) => lab.label);
      labels.show(doc);
      configBody.replaceChildren(valuesTable(doc.config, doc.set_by?.config, 'No config set by any label.'));
      summaryBody.replaceChildren(valuesTable(doc.summary, doc.set_by?.summary, 'No summary values set.'));
      logs.setLabels(names);
      metrics.toolbar.setLabels(names, names.length > MAX_LINES);
      system.setRun(doc);
    },
    async fill() {
      await metrics.refreshKeys();
      await Promise.all([metrics.grid.refresh(), system.refresh()]);
    },
    stop() {
      logs.stop();
      metrics.grid.destroy();
      system.stop();
    },
  };
}

// The labels card: the first LABEL_ROWS labels, and a button to show them all.
/** @param {RunState} state */
function labelsCard(state) {
  const { settings } = state;
  const body = el('div', { class: 'table-wrap labels-wrap' });
  const more = el('button', { type: 'button', class: 'button small', hidden: true }, 'Show all labels');
  const rerender = () => {
    if (state.doc) body.replaceChildren(labelsTable(state.doc, settings));
  };
  more.addEventListener('click', () => {
    settings.labelRows = Infinity;
    rerender();
    more.hidden = true;
  });
  return {
    element: card('labels', 'Labels', 'one per rank, each with its own state', body, el('div', { class: 'more' }, more)),
    rerender,
    show(doc) {
      body.replaceChildren(labelsTable(doc, settings));
      more.hidden = doc.labels.length <= settings.labelRows;
    },
  };
}

// The metrics card: a page of the run's keys (searched by the toolbar), a chart per key.
/** @param {RunState} state */
function metricsCard(state) {
  const { runId, settings, zoom } = state;
  const note = el('span', { class: 'muted' });
  let query = '';
  let offset = 0;
  const keyPager = pager((direction) => {
    offset = Math.max(0, offset + direction * sources.KEYS_PER_PAGE);
    refreshKeys().catch(ignoreApiErrors);
  });
  const toolbar = chartToolbar(settings, zoom, {
    onSearch(text) {
      query = text;
      offset = 0;
      refreshKeys().catch(ignoreApiErrors);
    },
  });
  const grid = new PanelGrid(state.page, (key) => sources.metricChart(runId, key, {
    run: state.doc, shown: settings.shown, xMode: settings.xMode, range: zoomed(zoom),
  }));

  async function refreshKeys() {
    const keys = await sources.keyPage(runId, { query, offset });
    if (state.stopped) return keys;
    offset = keys.offset;
    toolbar.setSearchNote(keys.error);
    note.textContent = keys.all ? count(keys.all) + (keys.all === 1 ? ' key' : ' keys') : '';
    keyPager.set({ offset: keys.offset, shown: keys.keys.length, total: keys.total, all: query ? keys.all : undefined });
    if (!keys.total) {
      grid.setKeys([]);
      grid.element.replaceChildren(el('p', { class: 'empty' }, keys.all ? 'No key matches.' : 'No metrics logged yet.'));
    } else {
      grid.setKeys(keys.keys, { searching: Boolean(query) });
    }
    return keys;
  }

  const element = el('section', { class: 'card', id: 'metrics' },
    el('div', { class: 'card-head' }, el('h2', null, 'Metrics'), note, el('span', { class: 'spacer' }), keyPager.element),
    toolbar.element, grid.element);
  return { element, toolbar, grid, refreshKeys };
}

// -- the stragglers tab --------------------------------------------------------------------------

/** @param {RunState} state */
function stragglersPane(state) {
  const { runId, settings } = state;
  const body = el('div', { class: 'straggler-body' }, el('p', { class: 'placeholder' }, 'Loading…'));
  const keySelect = /** @type {HTMLSelectElement} */ (el('select', { class: 'input', id: 'straggler-key', 'aria-label': 'Metric whose timestamps give step times' }));
  const valuesBox = /** @type {HTMLInputElement} */ (el('input', { type: 'checkbox', id: 'straggler-values' }));
  const element = pane('stragglers',
    card('stragglers', 'Stragglers', 'seconds per step of each label against the median of all labels',
      el('div', { class: 'toolbar' }, el('label', { class: 'control' }, el('span', { class: 'control-name' }, 'Step times from'), keySelect),
        el('label', { class: 'toggle', title: 'the values of this key are seconds per step (else: when it was logged)' },
          valuesBox, el('span', null, 'its values are step times'))),
      body));
  let view = null;

  async function refresh() {
    if (!keySelect.options.length) {
      body.replaceChildren(el('p', { class: 'empty' }, 'No metrics logged yet.'));
      return;
    }
    const data = await sources.stragglers(runId, { key: keySelect.value, timeKey: valuesBox.checked });
    if (state.stopped) return;
    if (view) view.stop();
    view = null;
    if (!data.labels.length || !data.buckets.length) {
      body.replaceChildren(el('p', { class: 'empty' }, 'No step times: this key was not logged with steps.'));
      return;
    }
    const hosts = new Map(state.doc.labels.map((lab) => [lab.label, lab.host]));
    view = stragglerView(data, { hostOf: (label) => hosts.get(label), labelClicked: (label) => settings.toggleShown(label) });
    body.replaceChildren(view.element);
  }

  // The keys to take step times from, listed once: a key logged every step gives the finest
  // step times (a loss, most often), so one is chosen first.
  async function listKeys() {
    if (keySelect.options.length) return;
    const keys = await sources.keyPage(runId, { limit: 200 });
    keySelect.replaceChildren(...keys.keys.map((key) => el('option', { value: key }, key)));
    keySelect.value = keys.keys.find((key) => /loss/i.test(key)) ?? keys.keys[0] ?? '';
  }

  keySelect.addEventListener('change', () => refresh().catch(ignoreApiErrors));
  valuesBox.addEventListener('change', () => refresh().catch(ignoreApiErrors));
  return {
    element,
    async fill() {
      await listKeys();
      await refresh();
    },
    stop() {
      if (view) view.stop();
    },
  };
}

// -- the hardware tab ----------------------------------------------------------------------------

/** @param {string} runId */
function hardwarePane(runId) {
  const body = el('div', { class: 'table-wrap' });
  return {
    element: pane('hardware', card('hardware', 'Hardware', "each label's machine and command line, from its start event", body)),
    async fill() {
      body.replaceChildren(...hardwareView(await sources.labelHardware(runId)));
    },
  };
}
