// @ts-check
// The runs list: a page of the store's runs at a time, searched (id, name, tag, label), filtered
// (state, start dates), sorted by a column, with the count of every run that matches. The list's
// question lives in the address (#/?q=…&state=…&sort=…&offset=…), so going back to the list finds
// it as it was left, and a link to it finds the same runs.

import { ApiError, api, poll } from './api.js';
import { STATES, ago, count, dateTime, duration, el, setCrumbs, stateBadge } from './dom.js';
import { byName } from './series.js';

const RUNS_EVERY_MS = 3000;
const TYPING_MS = 250;
const PAGE_SIZES = [25, 50, 100, 200];
const PAGE_SIZE = 50;
const CHIPS = 8;
// The columns, and what each sorts by (none: not sortable).
const COLUMNS = [
  ['', null], ['Run', 'id'], ['State', 'state'], ['Primary', null], ['Labels', 'labels'], ['Metrics', null],
  ['Logs', null], ['Started', 'started'], ['Duration', null], ['Last event', 'last'],
];
// Each sort's first order, as the API has it: the latest or the most first, names A to Z.
const FIRST_ORDER = { started: 'desc', last: 'desc', labels: 'desc', id: 'asc', state: 'asc' };
// The address's parameters, as the API names them.
const PARAMS = ['q', 'state', 'since', 'until', 'sort', 'order', 'limit', 'offset'];

export function tagChips(tags, setBy) {
  if (!tags || !tags.length) return null;
  return el('span', { class: 'chips tags', title: setBy ? 'tags set by ' + setBy : null },
    tags.map((tag) => el('span', { class: 'chip tag' }, tag)));
}

// The list's question from the address: only what is there (a missing one is the API's default).
// What the page's controls cannot show (a sort, order, state, page size or offset written by hand
// that the API would refuse) is left out.
export function listQuery(hash) {
  const at = hash.indexOf('?');
  const params = new URLSearchParams(at < 0 ? '' : hash.slice(at + 1));
  const query = {};
  for (const name of PARAMS) {
    const value = params.get(name);
    if (value && fits(name, value)) query[name] = value;
  }
  if (query.order && !query.sort) delete query.order;
  return query;
}

function fits(name, value) {
  if (name === 'sort') return Object.hasOwn(FIRST_ORDER, value);
  if (name === 'order') return value === 'asc' || value === 'desc';
  if (name === 'state') return STATES.has(value);
  if (name === 'limit') return PAGE_SIZES.includes(Number(value));
  if (name === 'offset') return /^\d{1,12}$/.test(value);
  return true;
}

function listHash(query) {
  const params = new URLSearchParams();
  for (const name of PARAMS) if (query[name] !== undefined && query[name] !== '') params.set(name, String(query[name]));
  const text = params.toString();
  return '#/' + (text ? '?' + text : '');
}

// A date input's day (this browser's local time) as seconds since the epoch: its start, or the
// start of the next day for an `until`, so that the day is included.
function dayStart(day, next) {
  const [y, m, d] = day.split('-').map(Number);
  return String(new Date(y, m - 1, d + (next ? 1 : 0)).getTime() / 1000);
}

function secondsToDay(seconds, next) {
  if (!seconds || !Number.isFinite(Number(seconds))) return '';
  const d = new Date((Number(seconds) - (next ? 86400 : 0)) * 1000);
  return d.getFullYear() + '-' + String(d.getMonth() + 1).padStart(2, '0') + '-' + String(d.getDate()).padStart(2, '0');
}

// `picked` and `maxCompared`: the runs ticked to compare (kept across pages) and how many may be;
// `compareHref(ids)`: the address of those runs compared.
export function runsView({ picked, maxCompared, compareHref }) {
  setCrumbs({ text: 'Runs' });
  document.title = 'runbus · runs';
  let query = listQuery(location.hash);
  const rows = el('tbody');
  const total = el('span', { class: 'muted', id: 'runs-total' });
  const compare = el('a', { class: 'button compare-button', id: 'compare', href: '#/', 'aria-disabled': 'true' }, 'Compare');
  const empty = el('p', { class: 'empty', id: 'runs-empty', hidden: true });

  function pickedChanged() {
    const ids = [...picked];
    compare.textContent = ids.length ? 'Compare ' + ids.length + (ids.length === 1 ? ' run' : ' runs') : 'Compare';
    compare.href = ids.length >= 2 ? compareHref(ids) : '#/';
    compare.setAttribute('aria-disabled', String(ids.length < 2));
    compare.title = ids.length >= 2 ? '' : 'tick two runs or more (at most ' + maxCompared + ')';
  }

  const search = el('input', {
    class: 'input', id: 'runs-search', type: 'search', placeholder: 'Search id, name, tag, label',
    'aria-label': 'Search runs by id, name, tag or label', spellcheck: 'false', autocomplete: 'off', value: query.q || '',
  });
  let typing = null;
  search.addEventListener('input', () => {
    clearTimeout(typing);
    typing = setTimeout(() => change({ q: search.value.trim() }), TYPING_MS);
  });
  const state = el('select', { class: 'input', id: 'runs-state', 'aria-label': 'Only runs in this state' },
    el('option', { value: '' }, 'Any state'), [...STATES].map((s) => el('option', { value: s }, s)));
  state.value = query.state || '';
  state.addEventListener('change', () => change({ state: state.value }));
  const since = el('input', { class: 'input narrow', id: 'runs-since', type: 'date', 'aria-label': 'Started on or after', value: secondsToDay(query.since, false) });
  const until = el('input', { class: 'input narrow', id: 'runs-until', type: 'date', 'aria-label': 'Started on or before', value: secondsToDay(query.until, true) });
  since.addEventListener('change', () => change({ since: since.value ? dayStart(since.value, false) : '' }));
  until.addEventListener('change', () => change({ until: until.value ? dayStart(until.value, true) : '' }));
  const size = el('select', { class: 'input', id: 'runs-limit', 'aria-label': 'Runs per page' },
    PAGE_SIZES.map((n) => el('option', { value: String(n) }, n + ' a page')));
  size.value = String(query.limit || PAGE_SIZE);
  size.addEventListener('change', () => change({ limit: size.value }));

  const pages = pager((to) => change({ offset: String(to) }, false));
  const heads = COLUMNS.map(([name, sort]) => (sort ? sortHead(name, sort) : el('th', null, name)));

  function sortHead(name, sort) {
    const button = el('button', { type: 'button', class: 'sort', dataset: { sort }, onclick: () => {
      const current = query.sort || 'started';
      const order = current === sort ? (currentOrder() === 'desc' ? 'asc' : 'desc') : FIRST_ORDER[sort];
      change({ sort, order });
    } }, name);
    return el('th', { dataset: { sort } }, button);
  }

  function currentOrder() {
    return query.order || FIRST_ORDER[query.sort || 'started'];
  }

  function showSort() {
    const current = query.sort || 'started';
    for (const th of heads) {
      if (!th.dataset.sort) continue;
      const on = th.dataset.sort === current;
      th.setAttribute('aria-sort', on ? (currentOrder() === 'desc' ? 'descending' : 'ascending') : 'none');
      th.querySelector('button').textContent = th.textContent.replace(/ [▲▼]$/, '') + (on ? (currentOrder() === 'desc' ? ' ▼' : ' ▲') : '');
    }
  }

  // A new question: back to its first page unless only the page changed; the address follows
  // (replaced: paging is not a step of the browser's history).
  function change(update, fromStart = true) {
    query = { ...query, ...update, ...(fromStart ? { offset: '' } : {}) };
    for (const name of PARAMS) if (query[name] === '' || query[name] === undefined) delete query[name];
    history.replaceState(null, '', listHash(query));
    showSort();
    polling.now();
  }

  main().replaceChildren(el('section', { class: 'card' },
    el('div', { class: 'card-head' }, el('h2', null, 'Runs'), total, el('span', { class: 'spacer' }), compare),
    el('div', { class: 'toolbar runs-toolbar' }, search, state,
      el('label', { class: 'control' }, el('span', { class: 'control-name' }, 'From'), since),
      el('label', { class: 'control' }, el('span', { class: 'control-name' }, 'To'), until),
      el('span', { class: 'spacer' }), size, pages.element),
    el('div', { class: 'table-wrap' }, el('table', { class: 'table runs-table' }, el('thead', null, el('tr', null, heads)), rows)),
    empty));
  pickedChanged();
  showSort();

  // A reply to an older question than the latest is dropped: it would show the wrong runs.
  let asked = 0;
  const polling = poll(async () => {
    const mine = ++asked;
    const limit = Number(query.limit || PAGE_SIZE);
    let doc;
    try {
      doc = await api('/api/runs', { ...query, limit });
    } catch (error) {
      // A refused question (a date written by hand in the address): say why, list nothing.
      if (mine === asked && error instanceof ApiError && error.status === 400) {
        rows.replaceChildren();
        empty.hidden = false;
        empty.textContent = 'Cannot list these runs: ' + error.message;
      }
      throw error;
    }
    if (mine !== asked) return;
    if (doc.runs.length === 0 && doc.total > 0 && doc.offset > 0) {
      // The page is past the end (runs matched fewer since): show the last one.
      change({ offset: String(Math.floor((doc.total - 1) / limit) * limit) }, false);
      return;
    }
    const filtered = Boolean(query.q || query.state || query.since || query.until);
    total.textContent = count(doc.total) + (doc.total === 1 ? ' run' : ' runs') + (filtered ? ' match' + (doc.total === 1 ? 'es' : '') : '');
    empty.hidden = doc.total > 0;
    empty.textContent = filtered ? 'No runs match.'
      : 'No runs yet. Log from your job with runbus.init(), and keep `runbus ingest` running.';
    pages.set({ offset: doc.offset, shown: doc.runs.length, total: doc.total, limit });
    rows.replaceChildren(...doc.runs.map((run) => runRow(run, picked, pickedChanged, maxCompared)));
  }, RUNS_EVERY_MS);
  return { stop: polling.stop };
}

function main() {
  return document.getElementById('main');
}

// "51–100 of 2,000", with the first, previous, next and last pages; `onPage(offset)`.
function pager(onPage) {
  const text = el('span', { class: 'pager-text muted', id: 'runs-range' });
  let at = { offset: 0, total: 0, limit: PAGE_SIZE };
  const button = (id, label, title, to) => el('button', { type: 'button', class: 'button small', id, title, onclick: () => onPage(to()) }, label);
  const last = () => Math.max(0, Math.floor((at.total - 1) / at.limit) * at.limit);
  const first = button('runs-first', '«', 'First page', () => 0);
  const prev = button('runs-prev', '‹ Prev', 'Previous page', () => Math.max(0, at.offset - at.limit));
  const next = button('runs-next', 'Next ›', 'Next page', () => Math.min(last(), at.offset + at.limit));
  const end = button('runs-last', '»', 'Last page', last);
  return {
    element: el('div', { class: 'pager', id: 'runs-pager' }, text, first, prev, next, end),
    set(page) {
      at = page;
      text.textContent = page.shown ? count(page.offset + 1) + '–' + count(page.offset + page.shown) + ' of ' + count(page.total) : '';
      first.disabled = prev.disabled = page.offset <= 0;
      next.disabled = end.disabled = page.offset + page.shown >= page.total;
    },
  };
}

function runRow(run, picked, pickedChanged, maxCompared) {
  const href = '#/run/' + encodeURIComponent(run.run_id);
  const labels = [...run.labels].sort((a, b) => byName(a.label, b.label));
  const chips = labels.slice(0, CHIPS).map((lab) => el('span', { class: 'chip', title: lab.label + ': ' + lab.state },
    el('span', { class: 'dot dot-' + (STATES.has(lab.state) ? lab.state : 'unknown') }), lab.label));
  if (labels.length > CHIPS) chips.push(el('span', { class: 'chip more' }, '+' + (labels.length - CHIPS)));
  const end = run.state === 'running' ? Date.now() / 1000 : (run.ended_ts ?? run.last_ts);
  const tick = el('input', {
    type: 'checkbox', class: 'compare-pick', 'aria-label': 'compare ' + run.run_id, checked: picked.has(run.run_id),
    disabled: !picked.has(run.run_id) && picked.size >= maxCompared,
  });
  tick.addEventListener('change', () => {
    if (tick.checked) picked.add(run.run_id);
    else picked.delete(run.run_id);
    pickedChanged();
  });
  return el('tr', { class: 'run-row', dataset: { run: run.run_id }, onclick: (event) => {
    if (!event.target.closest('a, input, label')) location.hash = href;
  } },
  el('td', { class: 'pick' }, tick),
  el('td', null, el('a', { class: 'run-link mono', href }, run.run_id),
    run.name ? el('div', { class: 'run-name' }, run.name) : null, tagChips(run.tags)),
  el('td', null, stateBadge(run.state, run.exit_code)),
  el('td', { class: 'mono' }, run.primary ?? '–'),
  el('td', null, el('div', { class: 'chips' }, chips)),
  el('td', { class: 'num' }, count(run.counts.metric)),
  el('td', { class: 'num' }, count(run.counts.log)),
  el('td', { class: 'nowrap' }, dateTime(run.started_ts)),
  el('td', { class: 'nowrap' }, run.started_ts ? duration(end - run.started_ts) : '–'),
  el('td', { class: 'nowrap muted' }, ago(run.last_ts)));
}
