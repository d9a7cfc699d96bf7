// @ts-check
// The system card of a run page: one chart per figure (GPU figures of every index together),
// read from the rollups: every label a line up to MAX_LINES series, else the envelope across
// labels and its outliers; a host picker narrows it to one host's labels. The figures are
// listed (one request) only while the card is in view, and each chart is fetched (one request)
// only while it is in view (js/panels.js).

import { el } from './dom.js';
import { PanelGrid } from './panels.js';
import * as sources from './sources.js';

const TITLES = {
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
const ORDER = Object.keys(TITLES);

function rank(key) {
  return ORDER.includes(key) ? ORDER.indexOf(key) : ORDER.length;
}

export function systemCard(runId, page) {
  const note = el('span', { class: 'muted' });
  const hostSelect = el('select', { class: 'input', id: 'system-host', 'aria-label': 'Host' }, el('option', { value: '' }, 'All hosts'));
  const empty = el('p', { class: 'empty', hidden: true }, 'No system samples (the producer samples every 15 s).');
  let runDoc = null;
  const grid = new PanelGrid(page, (figure) => sources.systemChart(runId, figure, { run: runDoc, host: hostSelect.value }), {
    titleOf: (figure) => TITLES[figure] || figure,
    panel: { timed: true },
  });
  const element = el('section', { class: 'card', id: 'system' },
    el('div', { class: 'card-head' }, el('h2', null, 'System'), note),
    el('div', { class: 'toolbar' }, hostSelect), empty, grid.element);
  let inView = false;
  let hosts = [];
  const observer = new IntersectionObserver((entries) => {
    const was = inView;
    inView = entries.some((e) => e.isIntersecting);
    if (inView && !was && runDoc) refresh();
  }, { rootMargin: '200px 0px' });
  observer.observe(element);
  hostSelect.addEventListener('change', () => grid.reload());

  async function refresh() {
    if (!inView || !runDoc) return;
    const figures = await sources.systemFigures(runId);
    figures.sort((a, b) => rank(a) - rank(b) || (a < b ? -1 : 1));
    note.textContent = figures.length ? 'sampled per label' : '';
    empty.hidden = figures.length > 0;
    grid.setKeys(figures);
    await grid.refresh();
  }

  return {
    element,
    setRun(doc) {
      runDoc = doc;
      const names = [...new Set(doc.labels.map((lab) => lab.host).filter((h) => h))].sort();
      if (names.join('\n') !== hosts.join('\n')) {
        hosts = names;
        const chosen = hostSelect.value;
        hostSelect.replaceChildren(el('option', { value: '' }, 'All hosts'), ...names.map((h) => el('option', { value: h }, h)));
        hostSelect.value = names.includes(chosen) ? chosen : '';
      }
      hostSelect.hidden = hosts.length < 2;
    },
    refresh,
    rerender() {
      grid.rerender();
    },
    stop() {
      observer.disconnect();
      grid.destroy();
    },
  };
}
