// @ts-check
// The logs card of a run page: filters by label, level and text, paging, and follow mode.

import { api, poll, runPath } from './api.js';
import { labelColor, tint } from './colors.js';
import { clock, count, dateTime, el } from './dom.js';
import { byName } from './series.js';

const LEVELS = ['DEBUG', 'INFO', 'WARNING', 'ERROR', 'CRITICAL'];
const FOLLOW_EVERY_MS = 1500;
const LOG_PAGE = 500;
const LOG_CATCH_UP = 5000;
const LOG_KEEP = 5000;
const LOG_OVERLAP = 50;

export function logsPanel(runId) {
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
    name.style.color = tint(labelColor(line.label));
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
        const id = line.label + '/' + line.lease_epoch + '/' + line.seq;
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
  const following = poll(async () => {
    if (follow.checked) await load(false, true);
  }, FOLLOW_EVERY_MS);

  return {
    element,
    setLabels(given) {
      const names = [...given].sort(byName);
      if (names.join('\n') === known.join('\n')) return;
      known = names;
      const chosen = labelSelect.value;
      labelSelect.replaceChildren(el('option', { value: '' }, 'All labels'), ...names.map((n) => el('option', { value: n }, n)));
      labelSelect.value = names.includes(chosen) ? chosen : '';
    },
    stop: following.stop,
  };
}
