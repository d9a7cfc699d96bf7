// The runbus dashboard: the runs list, one run's page (charts, stragglers, hardware), and runs
// compared, over the JSON API of `runbus serve`. Every string that came from the bus (labels,
// metric names, hosts, log text, config, argv) reaches the page through textContent or an
// attribute value, never as markup; the server's Content-Security-Policy forbids inline scripts
// as a second wall. Charts are drawn by uPlot (static/vendor/uplot); their data comes through
// js/sources.js alone.
'use strict';

import { ApiError, api, poll } from './js/api.js';
import { Zoom } from './js/chart.js';
import { labelColor, runColor } from './js/colors.js';
import { clock, count, dateTime, duration, el, setCrumbs, stateBadge, swatch } from './js/dom.js';
import { healthBanner } from './js/health.js';
import { logsPanel } from './js/logs.js';
import { PanelGrid } from './js/panels.js';
import { MAX_LINES, byName } from './js/series.js';
import { Settings } from './js/settings.js';
import * as sources from './js/sources.js';
import { stragglerView } from './js/stragglers.js';
import { systemCard } from './js/system.js';
import { runsView as listRuns, tagChips } from './js/runs.js';
import { chartToolbar, pager } from './js/toolbar.js';

(() => {
  const RUN_EVERY_MS = 5000;
  const LABEL_ROWS = 64;
  const MAX_COMPARED = 8;
  const TABS = ['charts', 'stragglers', 'hardware'];
  const ZOOM_SETTLE_MS = 250;
  const ENVELOPE_GREY = '#98a2b3';

  // A run's labels in their natural order (rank2 before rank10), as every list on the page shows them.
  function byLabel(labels) {
    return [...labels].sort((a, b) => byName(a.label, b.label));
  }

  // -- views -----------------------------------------------------------------------------------

  let current = null;

  // #/ runs; #/run/ID[/stragglers|/hardware] one run; #/compare/ID,ID,... runs compared.
  function route() {
    let match = null;
    let view = null;
    try {
      match = location.hash.match(/^#\/run\/([^/]+)(?:\/([a-z]+))?$/);
      if (match) view = { kind: 'run', runId: decodeURIComponent(match[1]), tab: TABS.includes(match[2]) ? match[2] : 'charts' };
      const compare = location.hash.match(/^#\/compare\/(.+)$/);
      if (compare) {
        const ids = [...new Set(compare[1].split(',').map(decodeURIComponent).filter(Boolean))].slice(0, MAX_COMPARED);
        if (ids.length) view = { kind: 'compare', ids };
      }
    } catch (error) {
      view = null;  // a malformed address: show the runs
    }
    if (current && view && view.kind === 'run' && current.runId === view.runId) {
      current.setTab(view.tab);
      return;
    }
    if (current) current.stop();
    if (!view) current = runsView();
    else if (view.kind === 'run') current = runView(view.runId, view.tab);
    else current = compareView(view.ids);
  }

  function errorCard(error) {
    const text = error.status === 404 ? error.message : 'Could not load: ' + error.message;
    return el('section', { class: 'card error-card' }, el('h2', null, error.status === 404 ? 'Not found' : 'Error'),
      el('p', null, text), el('p', null, el('a', { href: '#/' }, '← All runs')));
  }

  function compareHref(ids) {
    return '#/compare/' + ids.map(encodeURIComponent).join(',');
  }

  // -- the runs list: js/runs.js -----------------------------------------------------------------

  function runsView() {
    return listRuns({ picked: new Set(), maxCompared: MAX_COMPARED, compareHref });
  }

  // -- one run ---------------------------------------------------------------------------------

  function tabBar(runId, names) {
    const links = names.map(([tab, text]) => el('a', {
      class: 'tab', dataset: { tab }, href: '#/run/' + encodeURIComponent(runId) + (tab === 'charts' ? '' : '/' + tab),
    }, text));
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

  function runView(runId, firstTab) {
    setCrumbs({ text: 'Runs', href: '#/' }, { text: runId });
    document.title = 'runbus · ' + runId;
    const main = document.getElementById('main');
    const settings = new Settings();
    settings.labelRows = LABEL_ROWS;
    const zoom = new Zoom();
    const page = { settings, zoom };
    const header = el('section', { class: 'card run-header' });
    const banner = healthBanner(runId);
    const tabs = tabBar(runId, [['charts', 'Charts'], ['stragglers', 'Stragglers'], ['hardware', 'Hardware']]);
    const labelsBody = el('div', { class: 'table-wrap labels-wrap' });
    const labelsMore = el('button', { type: 'button', class: 'button small', hidden: true }, 'Show all labels');
    const configBody = el('div', { class: 'config-wrap' });
    const summaryBody = el('div', { class: 'config-wrap' });
    const logs = logsPanel(runId);
    const metricNote = el('span', { class: 'muted' });
    let keyQuery = '';
    let keyOffset = 0;
    let runDoc = null;
    const keyPager = pager((direction) => {
      keyOffset = Math.max(0, keyOffset + direction * sources.KEYS_PER_PAGE);
      refreshKeys().catch(ignoreApiErrors);
    });
    const toolbar = chartToolbar(settings, zoom, {
      onSearch(query) {
        keyQuery = query;
        keyOffset = 0;
        refreshKeys().catch(ignoreApiErrors);
      },
    });
    const grid = new PanelGrid(page, (key) => sources.metricChart(runId, key, {
      run: runDoc, shown: settings.shown, xMode: settings.xMode, range: zoomed(zoom),
    }));
    const system = systemCard(runId, page);
    const chartsPane = el('div', { class: 'pane', dataset: { pane: 'charts' } },
      el('div', { class: 'columns' },
        el('section', { class: 'card', id: 'labels' }, el('div', { class: 'card-head' }, el('h2', null, 'Labels'),
          el('span', { class: 'muted' }, 'one per rank, each with its own state')), labelsBody, el('div', { class: 'more' }, labelsMore)),
        el('div', { class: 'stack' },
          el('section', { class: 'card', id: 'config' }, el('div', { class: 'card-head' }, el('h2', null, 'Config'),
            el('span', { class: 'muted' }, "every label's, merged: the primary's value wins")), configBody),
          el('section', { class: 'card', id: 'summary' }, el('div', { class: 'card-head' }, el('h2', null, 'Summary'),
            el('span', { class: 'muted' }, 'final values, merged alike')), summaryBody))),
      el('section', { class: 'card', id: 'metrics' },
        el('div', { class: 'card-head' }, el('h2', null, 'Metrics'), metricNote, el('span', { class: 'spacer' }), keyPager.element),
        toolbar.element, grid.element),
      logs.element,
      system.element);
    const stragglerBody = el('div', { class: 'straggler-body' }, el('p', { class: 'placeholder' }, 'Loading…'));
    const stragglerKey = el('select', { class: 'input', id: 'straggler-key', 'aria-label': 'Metric whose timestamps give step times' });
    const stragglerValues = el('input', { type: 'checkbox', id: 'straggler-values' });
    const stragglersPane = el('div', { class: 'pane', dataset: { pane: 'stragglers' } },
      el('section', { class: 'card', id: 'stragglers' },
        el('div', { class: 'card-head' }, el('h2', null, 'Stragglers'),
          el('span', { class: 'muted' }, 'seconds per step of each label against the median of all labels')),
        el('div', { class: 'toolbar' }, el('label', { class: 'control' }, el('span', { class: 'control-name' }, 'Step times from'), stragglerKey),
          el('label', { class: 'toggle', title: 'the values of this key are seconds per step (else: when it was logged)' },
            stragglerValues, el('span', null, 'its values are step times'))),
        stragglerBody));
    const hardwareBody = el('div', { class: 'table-wrap' });
    const hardwarePane = el('div', { class: 'pane', dataset: { pane: 'hardware' } },
      el('section', { class: 'card', id: 'hardware' },
        el('div', { class: 'card-head' }, el('h2', null, 'Hardware'),
          el('span', { class: 'muted' }, "each label's machine and command line, from its start event")), hardwareBody));
    main.replaceChildren(header, banner.element, tabs.element, chartsPane, stragglersPane, hardwarePane);

    let tab = firstTab;
    let lastState = null;
    let stopped = false;
    let straggling = null;
    labelsMore.addEventListener('click', () => {
      settings.labelRows = Infinity;
      if (runDoc) labelsBody.replaceChildren(labelsTable(runDoc, settings));
      labelsMore.hidden = true;
    });
    settings.onChange((what) => {
      if (runDoc) labelsBody.replaceChildren(labelsTable(runDoc, settings));
      if (what === 'fetch') {
        grid.refresh().catch(ignoreApiErrors);
        system.refresh().catch(ignoreApiErrors);
      } else {
        grid.rerender();
        system.rerender();
      }
    });
    stragglerKey.addEventListener('change', () => refreshStragglers().catch(ignoreApiErrors));
    stragglerValues.addEventListener('change', () => refreshStragglers().catch(ignoreApiErrors));
    // A zoom asks the server again for the range in view, in finer buckets.
    let zooming = null;
    zoom.onChange(() => {
      clearTimeout(zooming);
      zooming = setTimeout(() => grid.refresh().catch(ignoreApiErrors), ZOOM_SETTLE_MS);
    });

    // A tab is filled when first opened, then at each refresh while it is open (a finished run
    // stops refreshing, but a tab opened later is still filled once).
    const filled = new Set();
    function setTab(name) {
      tab = name;
      tabs.select(tab);
      for (const pane of [chartsPane, stragglersPane, hardwarePane]) pane.hidden = pane.dataset.pane !== tab;
      if (runDoc && !filled.has(tab)) fillTab().catch(ignoreApiErrors);
    }

    async function fillTab() {
      const name = tab;
      filled.add(name);
      if (name === 'charts') {
        await refreshKeys();
        await Promise.all([grid.refresh(), system.refresh()]);
      } else if (name === 'stragglers') {
        if (!stragglerKey.options.length) {
          const keys = await sources.keyPage(runId, { limit: 200 });
          stragglerKey.replaceChildren(...keys.keys.map((key) => el('option', { value: key }, key)));
          // A key logged every step gives the finest step times: a loss, most often.
          stragglerKey.value = keys.keys.find((key) => /loss/i.test(key)) ?? keys.keys[0] ?? '';
        }
        await refreshStragglers();
      } else {
        hardwareBody.replaceChildren(...hardwareView(await sources.labelHardware(runId)));
      }
    }

    async function refreshKeys() {
      const keys = await sources.keyPage(runId, { query: keyQuery, offset: keyOffset });
      if (stopped) return keys;
      keyOffset = keys.offset;
      toolbar.setSearchNote(keys.error);
      metricNote.textContent = keys.all ? count(keys.all) + (keys.all === 1 ? ' key' : ' keys') : '';
      keyPager.set({ offset: keys.offset, shown: keys.keys.length, total: keys.total, all: keyQuery ? keys.all : undefined });
      if (!keys.total) {
        grid.setKeys([]);
        grid.element.replaceChildren(el('p', { class: 'empty' }, keys.all ? 'No key matches.' : 'No metrics logged yet.'));
      } else {
        grid.setKeys(keys.keys, { searching: Boolean(keyQuery) });
      }
      return keys;
    }

    async function refreshStragglers() {
      const keys = [...stragglerKey.options].map((o) => o.value);
      if (!keys.length) {
        stragglerBody.replaceChildren(el('p', { class: 'empty' }, 'No metrics logged yet.'));
        return;
      }
      const data = await sources.stragglers(runId, { key: stragglerKey.value, timeKey: stragglerValues.checked });
      if (stopped) return;
      if (straggling) straggling.stop();
      straggling = null;
      if (!data.labels.length || !data.buckets.length) {
        stragglerBody.replaceChildren(el('p', { class: 'empty' }, 'No step times: this key was not logged with steps.'));
        return;
      }
      const hosts = new Map(runDoc.labels.map((lab) => [lab.label, lab.host]));
      straggling = stragglerView(data, { hostOf: (label) => hosts.get(label), labelClicked: (label) => settings.toggleShown(label) });
      stragglerBody.replaceChildren(straggling.element);
    }

    async function refresh() {
      try {
        runDoc = await sources.run(runId);
        runDoc.labels = byLabel(runDoc.labels);
      } catch (error) {
        if (error.status === 404 || error.status === 400) {
          main.replaceChildren(errorCard(error));
          polling.stop();
          return;
        }
        throw error;
      }
      if (stopped) return;
      const names = runDoc.labels.map((lab) => lab.label);
      renderHeader(header, runDoc);
      await banner.refresh().catch(ignoreApiErrors);
      if (stopped) return;
      labelsBody.replaceChildren(labelsTable(runDoc, settings));
      labelsMore.hidden = runDoc.labels.length <= settings.labelRows;
      configBody.replaceChildren(valuesTable(runDoc.config, runDoc.set_by?.config, 'No config set by any label.'));
      summaryBody.replaceChildren(valuesTable(runDoc.summary, runDoc.set_by?.summary, 'No summary values set.'));
      logs.setLabels(names);
      toolbar.setLabels(names, names.length > MAX_LINES);
      system.setRun(runDoc);
      await fillTab();
      // A run that is over changes no more: one last refresh after it ends, then stop.
      if (runDoc.state !== 'running' && lastState !== null && lastState !== 'running') polling.stop();
      lastState = runDoc.state;
    }

    setTab(firstTab);
    const polling = poll(refresh, RUN_EVERY_MS);
    return {
      runId,
      setTab(name) {
        if (name !== tab) setTab(name);
      },
      stop() {
        stopped = true;
        polling.stop();
        logs.stop();
        grid.destroy();
        system.stop();
        if (straggling) straggling.stop();
      },
    };
  }

  // The page's zoom as the sources take it: null, or the x kind and range.
  function zoomed(zoom) {
    return zoom.range ? { kind: zoom.kind, range: zoom.range } : null;
  }

  function ignoreApiErrors(error) {
    if (!(error instanceof ApiError)) throw error;
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
    if (run.name) facts.unshift(['Run id', run.run_id, 'mono']);
    header.replaceChildren(
      el('div', { class: 'run-title' }, el('h1', { class: run.name ? null : 'mono', title: run.name ? 'name set by ' + run.set_by?.name : null },
        run.name || run.run_id), stateBadge(run.state), tagChips(run.tags, run.set_by?.tags)),
      el('dl', { class: 'facts' }, facts.map(([name, text, kind]) =>
        el('div', { class: 'fact' }, el('dt', null, name), el('dd', { class: kind || null }, String(text))))));
  }

  function labelsTable(run, settings) {
    const dead = run.dead_letters.labels || {};
    const head = ['Label', 'State', 'Life', 'Last seq', 'Events', 'Gaps', 'Dead letters', 'Host', 'Last event'];
    return el('table', { class: 'table labels-table' },
      el('thead', null, el('tr', null, head.map((h) => el('th', null, h)))),
      el('tbody', null, run.labels.slice(0, settings.labelRows).map((lab) => {
        const many = run.labels.length > MAX_LINES;
        const on = many ? settings.shown.has(lab.label) : !settings.hidden.has(lab.label);
        const toggle = el('button', {
          type: 'button', class: 'label-toggle' + (on ? ' on' : ''), 'aria-pressed': String(on),
          title: (on ? 'hide ' : 'show ') + lab.label + ' on the charts',
          onclick: () => (many ? settings.toggleShown(lab.label) : settings.toggleHidden(lab.label)),
        }, swatch(labelColor(lab.label)), lab.label);
        return el('tr', { dataset: { label: lab.label } },
          el('td', { class: 'mono nowrap' }, toggle, lab.primary ? el('span', { class: 'primary', title: 'primary' }, 'primary') : null),
          el('td', null, stateBadge(lab.state, lab.exit_code)),
          el('td', { class: 'num', title: 'lease epoch ' + lab.lease_epoch }, lab.life),
          el('td', { class: 'num' }, count(lab.last_seq)),
          el('td', { class: 'num' }, count(lab.events)),
          el('td', { class: 'num' + (lab.missing ? ' warn' : '') }, count(lab.missing)),
          el('td', { class: 'num' + (dead[lab.label] ? ' warn' : '') }, run.dead_letters.total === null ? '–' : count(dead[lab.label] || 0)),
          el('td', { class: 'mono', title: lab.rank === null ? null : 'rank ' + lab.rank }, lab.host ?? '–'),
          el('td', { class: 'nowrap muted' }, lab.last_ts ? clock(lab.last_ts) : '–'));
      })));
  }

  function flatten(object, prefix, out, top) {
    for (const [name, item] of Object.entries(object)) {
      const key = prefix ? prefix + '.' + name : name;
      const first = top ?? name;
      if (item && typeof item === 'object' && !Array.isArray(item) && Object.keys(item).length) flatten(item, key, out, first);
      else out.push([key, configText(item), first]);
    }
    return out;
  }

  // A merged config or summary: key, value, and the label that set it (of its top-level key).
  function valuesTable(values, setBy, emptyText) {
    const rows = values ? flatten(values, '', []) : [];
    if (!rows.length) return el('p', { class: 'empty' }, emptyText);
    return el('table', { class: 'table config-table' }, el('tbody', null,
      rows.map(([key, text, top]) => el('tr', null, el('th', { class: 'mono' }, key), el('td', { class: 'mono' }, text),
        el('td', { class: 'mono set-by', title: 'set by' }, (setBy || {})[top] ?? '–')))));
  }

  // -- system charts: one per figure, a line per label; GPU figures of every index together ----

  // "8 × NVIDIA H100 80GB HBM3 (81,559 MB)": a label's GPUs, alike ones counted together.
  function gpuSummary(gpus) {
    if (!gpus) return '–';
    if (!gpus.length) return 'none';
    const kinds = new Map();
    for (const gpu of gpus) {
      const name = String(gpu.name ?? 'GPU') + (gpu.memory_total_mb ? ' (' + count(Math.round(gpu.memory_total_mb)) + ' MB)' : '');
      kinds.set(name, (kinds.get(name) || 0) + 1);
    }
    return [...kinds].map(([name, n]) => n + ' × ' + name).join(', ');
  }

  // The distinct hardware (how many labels have each), then every label's.
  function hardwareView({ labels, groups, total }) {
    if (!labels.length) return [el('p', { class: 'empty' }, 'No labels yet.')];
    const alike = groups.length ? el('div', { class: 'hw-groups', id: 'hardware-groups' }, groups.map((group) =>
      el('div', { class: 'hw-group' },
        el('span', { class: 'hw-count' }, count(group.count) + (group.count === 1 ? ' label' : ' labels')),
        el('span', null, gpuSummary(group.gpus)),
        [['driver', group.driver], ['CUDA', group.cuda], ['torch', group.torch], ['Python', group.python], ['CPUs', group.cpus]]
          .filter(([, text]) => text !== null && text !== undefined)
          .map(([name, text]) => el('span', { class: 'muted' }, name + ' ', el('span', { class: 'mono' }, String(text))))))) : null;
    const more = total > labels.length ? el('p', { class: 'muted' }, 'The first ' + count(labels.length) + ' of ' + count(total) + ' labels.') : null;
    return [alike, hardwareTable(labels), more].filter(Boolean);
  }

  function hardwareTable(rows) {
    const head = ['Label', 'Rank', 'Host', 'GPUs', 'Driver', 'CUDA', 'torch', 'Python', 'Git', 'Command line'];
    return el('table', { class: 'table hardware-table' },
      el('thead', null, el('tr', null, head.map((h) => el('th', null, h)))),
      el('tbody', null, rows.map((row) => el('tr', { dataset: { label: row.label } },
        el('td', { class: 'mono nowrap' }, swatch(labelColor(row.label)), row.label),
        el('td', { class: 'num' }, row.rank ?? '–'),
        el('td', { class: 'mono hw-host' }, row.host ?? '–'),
        el('td', { class: 'hw-gpus' }, gpuSummary(row.gpus)),
        el('td', { class: 'mono' }, row.driver ?? '–'),
        el('td', { class: 'mono' }, row.cuda ?? '–'),
        el('td', { class: 'mono' }, row.torch ?? '–'),
        el('td', { class: 'mono' }, row.python ?? '–'),
        gitCell(row.git),
        el('td', { class: 'mono hw-argv' }, row.argv ? row.argv.map(String).join(' ') : '–')))));
  }

  // A label's working directory at its start: short commit, branch, dirty; the full commit and
  // the origin URL (its credentials hidden by the API) on hover.
  function gitCell(git) {
    if (!git) return el('td', { class: 'mono hw-git' }, '–');
    const commit = typeof git.commit === 'string' ? git.commit : null;
    const title = [commit, git.remote].filter((part) => typeof part === 'string').join('\n');
    return el('td', { class: 'mono hw-git nowrap', title: title || null },
      commit ? commit.slice(0, 7) : '?',
      ' ', el('span', { class: 'muted' }, typeof git.branch === 'string' ? git.branch : 'detached'),
      git.dirty === true ? [' ', el('span', { class: 'badge hw-dirty' }, 'dirty')] : null);
  }

  // -- runs compared -----------------------------------------------------------------------------

  function compareView(ids) {
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
    let zooming = null;
    zoom.onChange(() => {
      clearTimeout(zooming);
      zooming = setTimeout(() => grid.refresh().catch(ignoreApiErrors), ZOOM_SETTLE_MS);
    });
    modeSelect.addEventListener('change', () => {
      mode = modeSelect.value;
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
      const found = await Promise.all(ids.map((id) => sources.run(id).catch((error) => {
        if (error instanceof ApiError && (error.status === 404 || error.status === 400)) return { run_id: id, missing: error.message };
        throw error;
      })));
      if (stopped) return;
      found.forEach((r, i) => { r.color = runColor(i); });
      runs = found.filter((r) => !r.missing);
      legend.replaceChildren(...found.map((r) => el('span', { class: 'compare-run', dataset: { run: r.run_id } },
        swatch(r.color),
        r.missing ? el('span', { class: 'mono bad' }, r.run_id + ' (' + r.missing + ')')
          : el('a', { class: 'mono', href: '#/run/' + encodeURIComponent(r.run_id) }, r.run_id),
        r.missing ? null : stateBadge(r.state, r.exit_code),
        r.missing ? null : el('span', { class: 'muted' }, count(r.labels.length) + (r.labels.length === 1 ? ' label' : ' labels')))));
      if (runs.length) configBody.replaceChildren(configDiffTable(await sources.compareConfig(runs.map((r) => r.run_id)), runs));
      await refreshKeys();
      await grid.refresh();
      if (runs.every((r) => r.state !== 'running')) polling.stop();
    }, RUN_EVERY_MS);
    return {
      stop() {
        stopped = true;
        polling.stop();
        grid.destroy();
      },
    };
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

  function configText(item) {
    return typeof item === 'string' ? item : JSON.stringify(item);
  }

  window.addEventListener('hashchange', route);
  route();
})();
