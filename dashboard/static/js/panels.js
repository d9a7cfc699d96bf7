// @ts-check
// A page of chart panels, in sections by key prefix (`train/`, `eval/`), fetched only while in
// view: a panel scrolled into view is fetched once, and each refresh fetches at most
// REFRESH_LIMIT of the panels in view, whatever the number of keys.

import { ignoreApiErrors } from './api.js';
import { el, count } from './dom.js';
import { Panel } from './chart.js';

export const REFRESH_LIMIT = 24;
const SETTLE_MS = 150;        // a panel must stay in view this long before it is fetched
const OPEN_SECTIONS = 8;      // more sections than this: only the first two start open
const ZOOM_SETTLE_MS = 250;   // a zoom asks again once the dragging has stopped this long

export function sectionOf(key) {
  const slash = key.indexOf('/');
  return slash > 0 ? key.slice(0, slash) : '';
}

// A zoom asks the server again for the range in view, in finer buckets.
export function refreshOnZoom(zoom, grid) {
  let zooming = null;
  zoom.onChange(() => {
    clearTimeout(zooming);
    zooming = setTimeout(() => grid.refresh().catch(ignoreApiErrors), ZOOM_SETTLE_MS);
  });
}

export class PanelGrid {
  // fetch(key) -> Promise<{parts, info}>; titleOf(key) -> text; panel: each Panel's options
  constructor(page, fetch, { titleOf = (key) => key, panel = {} } = {}) {
    this.page = page;
    this.fetch = fetch;
    this.titleOf = titleOf;
    this.panelOptions = panel;
    this.panels = new Map();
    this.visible = new Set();
    this.loaded = new Set();
    this.pending = new Map();
    this.latest = new Map();      // key -> the number of its latest load
    this.sectionsOpen = new Map();
    this.shape = null;
    this.element = el('div', { class: 'sections' });
    this.observer = new IntersectionObserver((entries) => this.seen(entries), { rootMargin: '200px 0px' });
  }

  destroy() {
    this.observer.disconnect();
    for (const panel of this.panels.values()) panel.destroy();
    this.panels.clear();
  }

  // The keys of the current page: panels kept for keys still listed, made for new ones.
  setKeys(keys, { searching = false } = {}) {
    const shape = JSON.stringify([keys, searching]);
    if (shape === this.shape && this.element.isConnected) return;  // the same page: leave it be
    this.shape = shape;
    const wanted = new Set(keys);
    for (const [key, panel] of this.panels) {
      if (wanted.has(key)) continue;
      this.observer.unobserve(panel.element);
      panel.destroy();
      this.panels.delete(key);
      this.visible.delete(key);
      this.loaded.delete(key);
    }
    const sections = new Map();
    for (const key of keys) {
      const name = sectionOf(key);
      if (!sections.has(name)) sections.set(name, []);
      sections.get(name).push(key);
    }
    const many = sections.size > OPEN_SECTIONS;
    const built = [...sections].map(([name, sectionKeys], index) => {
      const grid = el('div', { class: 'grid' });
      for (const key of sectionKeys) {
        let panel = this.panels.get(key);
        if (!panel) {
          panel = new Panel(key, this.titleOf(key), this.page, this.panelOptions);
          this.panels.set(key, panel);
          this.observer.observe(panel.element);
        }
        grid.append(panel.element);
      }
      const open = searching || (this.sectionsOpen.get(name) ?? (!many || index < 2));
      const details = el('details', { class: 'section', dataset: { section: name }, open },
        el('summary', null, el('span', { class: 'section-name' }, name || 'other'),
          el('span', { class: 'section-count' }, count(sectionKeys.length))),
        grid);
      details.addEventListener('toggle', () => this.sectionsOpen.set(name, details.open));
      return details;
    });
    // One section and no prefix to name: no heading.
    if (built.length === 1 && sections.has('')) built[0].classList.add('lone');
    this.element.replaceChildren(...built);
  }

  seen(entries) {
    for (const entry of entries) {
      const key = entry.target.dataset.key;
      if (entry.isIntersecting) {
        this.visible.add(key);
        if (!this.loaded.has(key) && !this.pending.has(key)) {
          this.pending.set(key, setTimeout(() => {
            this.pending.delete(key);
            if (this.visible.has(key) && !this.loaded.has(key)) this.load(key);
          }, SETTLE_MS));
        }
      } else {
        this.visible.delete(key);
        clearTimeout(this.pending.get(key));
        this.pending.delete(key);
      }
    }
  }

  async load(key) {
    const panel = this.panels.get(key);
    if (!panel) return;
    this.loaded.add(key);
    // Loads of a key overlap (a label turned on, then another): only the latest one is shown.
    const number = (this.latest.get(key) || 0) + 1;
    this.latest.set(key, number);
    const current = () => this.panels.get(key) === panel && this.latest.get(key) === number;
    try {
      const { parts, info } = await this.fetch(key);
      if (current()) panel.show(parts, info);
    } catch (error) {
      if (current()) panel.failed('could not load: ' + error.message);
    }
  }

  // The refresh: the panels in view (at most REFRESH_LIMIT, top first) fetched again; those
  // scrolled out are fetched when they come back.
  async refresh() {
    const inView = [...this.panels.keys()].filter((key) => this.visible.has(key)).slice(0, REFRESH_LIMIT);
    for (const key of this.loaded) if (!this.visible.has(key)) this.loaded.delete(key);
    await Promise.all(inView.map((key) => this.load(key)));
  }

  // Every panel fetched again as it is next in view (what they show has changed).
  async reload() {
    this.loaded.clear();
    await this.refresh();
  }

  rerender() {
    for (const panel of this.panels.values()) panel.render();
  }
}
