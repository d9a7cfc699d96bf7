// @ts-check
// What a run page shows of the run document itself: the header (state, times, counts, gaps,
// dead letters), the labels table (each label's state and counts, a toggle to show or hide it on
// the charts) and the merged config and summary tables.

import { labelColor } from './colors.js';
import { configRows } from './config.js';
import { clock, count, dateTime, duration, el, stateBadge, swatch } from './dom.js';
import { tagChips } from './runs.js';
import { MAX_LINES } from './series.js';

/**
 * @param {HTMLElement} header
 * @param {any} run the run document (GET /api/runs/ID)
 */
export function renderHeader(header, run) {
  header.replaceChildren(
    el('div', { class: 'run-title' }, el('h1', { class: run.name ? null : 'mono', title: run.name ? 'name set by ' + run.set_by?.name : null },
      run.name || run.run_id), stateBadge(run.state), tagChips(run.tags, run.set_by?.tags)),
    el('dl', { class: 'facts' }, runFacts(run).map(([name, text, kind]) =>
      el('div', { class: 'fact' }, el('dt', null, name), el('dd', { class: kind || null }, String(text))))));
}

// [name, text, kind]: the header's facts, a kind ('mono', 'bad', 'warn') styling the text.
function runFacts(run) {
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
  return facts;
}

/**
 * The first `settings.labelRows` labels; each one's toggle hides it (a few labels, each a line)
 * or shows it over the envelope (past MAX_LINES labels).
 * @param {any} run the run document
 * @param {import('./settings.js').Settings} settings
 */
export function labelsTable(run, settings) {
  const head = ['Label', 'State', 'Life', 'Last seq', 'Events', 'Gaps', 'Dead letters', 'Host', 'Last event'];
  return el('table', { class: 'table labels-table' },
    el('thead', null, el('tr', null, head.map((h) => el('th', null, h)))),
    el('tbody', null, run.labels.slice(0, settings.labelRows).map((lab) => labelRow(run, lab, settings))));
}

function labelRow(run, lab, settings) {
  const dead = run.dead_letters.labels || {};
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
}

/**
 * A merged config or summary: key, value, and the label that set it (of its top-level key).
 * @param {Record<string, unknown>|null|undefined} values
 * @param {Record<string, string>|null|undefined} setBy top-level key -> the label that set it
 * @param {string} emptyText
 */
export function valuesTable(values, setBy, emptyText) {
  const rows = values ? configRows(values) : [];
  if (!rows.length) return el('p', { class: 'empty' }, emptyText);
  return el('table', { class: 'table config-table' }, el('tbody', null,
    rows.map(([key, text, top]) => el('tr', null, el('th', { class: 'mono' }, key), el('td', { class: 'mono' }, text),
      el('td', { class: 'mono set-by', title: 'set by' }, (setBy || {})[top] ?? '–')))));
}
