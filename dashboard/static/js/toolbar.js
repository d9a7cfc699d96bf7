// @ts-check
// The controls above a page's charts: panel search (a regular expression), the x axis, smoothing,
// labels to show over an envelope, and zoom reset. They change the page's Settings and Zoom;
// the panels listen.

import { el, swatch } from './dom.js';
import { labelColor } from './colors.js';

const X_NAMES = { step: 'Step', wall: 'Wall time', relative: 'Relative time' };

export function chartToolbar(settings, zoom, { onSearch, showLabels = true, extra = null }) {
  const search = el('input', {
    class: 'input', id: 'panel-search', type: 'search', placeholder: 'Filter panels (regex)', 'aria-label': 'Filter panels by regular expression',
    spellcheck: 'false', autocomplete: 'off',
  });
  const searchNote = el('span', { class: 'search-note muted', id: 'search-note' });
  let typing = null;
  search.addEventListener('input', () => {
    clearTimeout(typing);
    typing = setTimeout(() => onSearch(search.value), 250);
  });

  const xButtons = Object.entries(X_NAMES).map(([mode, name]) => el('button', {
    type: 'button', class: 'segment', dataset: { mode }, 'aria-pressed': String(settings.xMode === mode),
    onclick: () => settings.setX(mode),
  }, name));
  const xGroup = el('span', { class: 'segments', role: 'group', 'aria-label': 'x axis', id: 'x-mode' }, ...xButtons);

  const slider = el('input', { type: 'range', id: 'smoothing', min: '0', max: '0.99', step: '0.01', value: String(settings.smoothing), 'aria-label': 'Smoothing' });
  const shownValue = el('span', { class: 'smoothing-value' }, settings.smoothing.toFixed(2));
  slider.addEventListener('input', () => {
    shownValue.textContent = Number(slider.value).toFixed(2);
    settings.setSmoothing(Number(slider.value));
  });

  const datalist = el('datalist', { id: 'label-names' });
  const pick = el('input', { class: 'input narrow', id: 'show-label', list: 'label-names', placeholder: 'Show a label…', 'aria-label': 'Show a label on the charts', autocomplete: 'off' });
  const chips = el('span', { class: 'chips shown-labels', id: 'shown-labels' });
  let known = new Set();
  pick.addEventListener('change', () => {
    const label = pick.value.trim();
    if (known.has(label) && !settings.shown.has(label)) settings.toggleShown(label);
    pick.value = '';
  });

  const reset = el('button', { type: 'button', class: 'button', id: 'reset-zoom', title: 'Or double-click a chart', onclick: () => zoom.set(null, null) }, 'Reset zoom');

  const element = el('div', { class: 'toolbar chart-toolbar' },
    search, searchNote,
    el('label', { class: 'control' }, el('span', { class: 'control-name' }, 'x'), xGroup),
    el('label', { class: 'control' }, el('span', { class: 'control-name' }, 'Smoothing'), slider, shownValue),
    showLabels ? el('span', { class: 'control', id: 'label-picker', hidden: true }, pick, datalist, chips) : null,
    reset, extra);

  function sync() {
    for (const button of xButtons) button.setAttribute('aria-pressed', String(button.dataset.mode === settings.xMode));
    chips.replaceChildren(...[...settings.shown].map((label) => el('button', {
      type: 'button', class: 'chip shown-chip', dataset: { label }, title: 'stop showing ' + label,
      onclick: () => settings.toggleShown(label),
    }, swatch(labelColor(label)), label, ' ×')));
  }
  settings.onChange(sync);
  sync();

  return {
    element,
    // The labels that can be shown over envelopes (the picker shows only when there are many).
    setLabels(names, many) {
      const picker = element.querySelector('#label-picker');
      if (picker) picker.hidden = !many;
      if (names.length === known.size && names.every((n) => known.has(n))) return;
      known = new Set(names);
      datalist.replaceChildren(...names.map((name) => el('option', { value: name })));
    },
    setSearchNote(text) {
      searchNote.textContent = text || '';
    },
    query: () => search.value,
  };
}

// "1–60 of 3,000 keys", with the previous and next pages.
export function pager(onPage) {
  const text = el('span', { class: 'pager-text muted', id: 'key-count' });
  const prev = el('button', { type: 'button', class: 'button small', id: 'keys-prev', onclick: () => onPage(-1) }, '‹ Prev');
  const next = el('button', { type: 'button', class: 'button small', id: 'keys-next', onclick: () => onPage(1) }, 'Next ›');
  const element = el('div', { class: 'pager' }, text, prev, next);
  return {
    element,
    /** @param {{offset: number, shown: number, total: number, all?: number}} page `all`: every key, when a search narrowed them */
    set({ offset, shown, total, all }) {
      const range = total ? (offset + 1).toLocaleString('en-US') + '–' + (offset + shown).toLocaleString('en-US') + ' of ' : '';
      const matching = total.toLocaleString('en-US') + (total === 1 ? ' key' : ' keys');
      text.textContent = range + matching + (all !== undefined && all !== total ? ' matching (' + all.toLocaleString('en-US') + ' in all)' : '');
      prev.disabled = offset <= 0;
      next.disabled = offset + shown >= total;
      element.hidden = total <= shown && offset === 0;
    },
  };
}
