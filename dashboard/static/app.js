// @ts-check
// The runbus dashboard: the runs list, one run's page (charts, stragglers, hardware), and runs
// compared, over the JSON API of `runbus serve`. Every string that came from the bus (labels,
// metric names, hosts, log text, config, argv) reaches the page through textContent or an
// attribute value, never as markup; the server's Content-Security-Policy forbids inline scripts
// as a second wall. Charts are drawn by uPlot (static/vendor/uplot); their data comes through
// js/sources.js alone. This file only routes: each view is its own module.
'use strict';

import { compareView } from './js/compare.js';
import { MAX_COMPARED, compareHref, parseRoute } from './js/route.js';
import { runView } from './js/runpage.js';
import { runsView } from './js/runs.js';

(() => {
  // The view shown: {stop()}, and for a run's page {runId, setTab(tab)}.
  let current = null;

  // A new address: the same run's page changes tab, anything else replaces the view.
  function route() {
    const view = parseRoute(location.hash);
    if (current && view && view.kind === 'run' && current.runId === view.runId) {
      current.setTab(view.tab);
      return;
    }
    if (current) current.stop();
    if (!view) current = runsView({ picked: new Set(), maxCompared: MAX_COMPARED, compareHref });
    else if (view.kind === 'run') current = runView(view.runId, view.tab);
    else current = compareView(view.ids);
  }

  window.addEventListener('hashchange', route);
  route();
})();
