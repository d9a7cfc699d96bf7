// The system card of a run page: one chart per figure (GPU figures of every index together), a
// line per label and GPU, or the envelope past MAX_LINES; a host picker narrows it to one host.
// Fetched (one request) only while the card is in view.

import { Panel } from './chart.js';
import { el } from './dom.js';
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
  const grid = el('div', { class: 'grid' });
  const element = el('section', { class: 'card', id: 'system' },
    el('div', { class: 'card-head' }, el('h2', null, 'System'), note),
    el('div', { class: 'toolbar' }, hostSelect), grid);
  const panels = new Map();
  let inView = false;
  let runDoc = null;
  let hosts = [];
  const observer = new IntersectionObserver((entries) => {
    const was = inView;
    inView = entries.some((e) => e.isIntersecting);
    if (inView && !was && runDoc) refresh();
  }, { rootMargin: '200px 0px' });
  observer.observe(element);
  hostSelect.addEventListener('change', () => {
    for (const panel of panels.values()) panel.destroy();
    panels.clear();
    grid.replaceChildren();
    refresh();
  });

  async function refresh() {
    if (!inView || !runDoc) return;
    const charts = await sources.systemCharts(runId, { run: runDoc, host: hostSelect.value, shown: page.settings.shown });
    charts.sort((a, b) => rank(a.key) - rank(b.key) || (a.key < b.key ? -1 : 1));
    note.textContent = charts.length ? 'sampled per label' : '';
    if (!charts.length) {
      grid.replaceChildren(el('p', { class: 'empty' }, 'No system samples (the producer samples every 15 s).'));
      return;
    }
    if (!panels.size) grid.replaceChildren();
    for (const chart of charts) {
      let panel = panels.get(chart.key);
      if (!panel) {
        panel = new Panel(chart.key, TITLES[chart.key] || chart.key, page, { timed: true });
        panels.set(chart.key, panel);
        grid.append(panel.element);
      }
      panel.show(chart.parts, chart.info);
    }
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
      for (const panel of panels.values()) panel.render();
    },
    stop() {
      observer.disconnect();
      for (const panel of panels.values()) panel.destroy();
    },
  };
}
