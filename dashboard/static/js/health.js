// @ts-check
// The health banner of a run's page: shown while `GET /api/runs/RUN/health` says the run needs
// attention (stalled, dead, silent, straggling, anomaly, crashed), naming the culprits and the state, each
// culprit's stack and last console lines one click away (a <details>), and how far the cross-rank
// band is checked. Every string from the bus goes through el() as text, never as markup.

import { api, runPath } from './api.js';
import { clock, el } from './dom.js';

/**
 * @typedef {{file?: string, line?: number, function?: string, code?: string}} Frame
 * @typedef {{label: string, reason?: string, step?: number | null, step_age?: number | null,
 *   host?: string | null, pid?: number | null, stack?: Frame[] | null, last_lines?: string[] | null}} Culprit
 * @typedef {{label: string, in?: string, step?: number | null}} Waiting
 * @typedef {{label: string, kind?: string, behind?: number | null, lost_s?: number | null}} Straggler
 * @typedef {{label: string, key?: string, step?: number | null, kind?: string}} Anomaly
 * @typedef {{label: string, state?: string, exit_code?: number | null, after_s?: number | null}} Follower
 * @typedef {{state: string, since?: number | null, culprits?: Culprit[], waiting?: Waiting[],
 *   stragglers?: Straggler[], anomalies?: Anomaly[], band_to?: number | null, followers?: Follower[],
 *   note?: string | null}} Health
 */

// The states that raise no banner: all is well, or nothing has been judged yet.
const QUIET = new Set(['ok', 'unknown']);
// The states that stop the job (red) rather than slow it (amber).
const STOPPED = new Set(['stalled', 'dead', 'silent']);

/** @param {Frame} frame */
function frameText(frame) {
  const where = String(frame.file ?? '?') + ':' + String(frame.line ?? '?') + ' in ' + String(frame.function ?? '?');
  return frame.code ? where + '\n    ' + String(frame.code) : where;
}

/** One culprit: its label and reason, then a <details> with its stack and last lines.
 * @param {Culprit} culprit */
function culpritItem(culprit) {
  const stack = culprit.stack || [];
  const lines = culprit.last_lines || [];
  const facts = [
    culprit.step !== undefined && culprit.step !== null ? 'step ' + culprit.step : null,
    culprit.host ? 'on ' + culprit.host + (culprit.pid ? ' (pid ' + culprit.pid + ')' : '') : null,
  ].filter(Boolean).join(' · ');
  const details = el('details', { class: 'health-details' },
    el('summary', null, 'Stack and last lines'),
    el('div', { class: 'health-part' }, el('h3', null, 'Stack (innermost last)'),
      stack.length ? el('pre', { class: 'mono health-stack' }, stack.map(frameText).join('\n')) : el('p', { class: 'muted' }, 'No stack in its last heartbeat.')),
    el('div', { class: 'health-part' }, el('h3', null, 'Last lines'),
      lines.length ? el('pre', { class: 'mono health-lines' }, lines.join('\n')) : el('p', { class: 'muted' }, 'No console lines captured.')));
  return el('li', { class: 'health-culprit', dataset: { label: culprit.label } },
    el('span', { class: 'mono health-label' }, culprit.label), ' ', el('span', null, culprit.reason ?? ''),
    facts ? el('span', { class: 'muted' }, ' · ' + facts) : null, details);
}

/** The banner's headline: the state, since when, and the culprits, waiting, stragglers, anomalies.
 * @param {Health} health */
function headline(health) {
  const parts = [health.state];
  if (health.since) parts[0] += ' since ' + clock(health.since);
  const culprits = health.culprits || [];
  if (culprits.length) parts.push(culprits.map((c) => c.label + ' ' + (c.reason ?? '')).join('; '));
  const waiting = health.waiting || [];
  if (waiting.length) {
    const places = [...new Set(waiting.map((w) => String(w.in ?? '?')))].sort();
    parts.push(waiting.length + ' waiting in ' + places.join(', '));
  }
  const followers = health.followers || [];
  if (followers.length) {
    // An ended run's labels that went after its culprit (docs/health.md, the post-mortem).
    parts.push('after it: ' + followers.map((f) => f.label + ' ' + (f.state ?? '') + (typeof f.after_s === 'number' ? ' +' + f.after_s.toFixed(1) + ' s' : '')).join(', '));
  }
  for (const s of health.stragglers || []) {
    parts.push(s.label + ' straggling' + (s.kind ? ' (' + s.kind + ')' : '') + (s.lost_s ? ', ' + s.lost_s.toFixed(1) + ' s lost' : ''));
  }
  for (const a of health.anomalies || []) {
    parts.push(a.label + ' ' + (a.kind ?? 'anomaly') + (a.key ? ' in ' + a.key : '') + (a.step !== undefined && a.step !== null ? ' at step ' + a.step : ''));
  }
  return parts.join(': ');
}

/** How far the cross-rank band is checked (docs/health.md, "Anomalies"): every rank that left it
 * up to that step is named, and a first anomaly after it may yet be preceded by one. Null where
 * the run has no band (band_to null: fewer than four labels), and while no step is checked
 * (negative: the slowest rank's second 128-step bucket is open) unless an anomaly was found.
 * @param {Health} health
 * @returns {string | null} */
export function bandText(health) {
  const to = health.band_to;
  const first = (health.anomalies || [])[0];
  if (typeof to !== 'number' || !Number.isInteger(to) || (to < 0 && !first)) return null;
  const unsettled = ': a rank leaving it before the first anomaly may yet be named.';
  if (to < 0) return 'Cross-rank band not checked yet (every rank must pass step 255 first)' + unsettled;
  const after = first && typeof first.step === 'number' && first.step > to;
  return 'Cross-rank band checked to step ' + to + (after ? ', before the first anomaly' + unsettled : '.');
}

/** The banner's content for `health`, or null when the run needs no attention.
 * @param {Health} health
 * @returns {Node[] | null} */
export function bannerContent(health) {
  if (!health || QUIET.has(health.state)) return null;
  const culprits = health.culprits || [];
  /** @type {Node[]} */
  const nodes = [el('p', { class: 'health-head' }, el('strong', null, 'Health: '), headline(health))];
  if (health.note) nodes.push(el('p', { class: 'muted health-note' }, health.note));
  const band = bandText(health);
  if (band) nodes.push(el('p', { class: 'muted health-band' }, band));
  if (culprits.length) nodes.push(el('ul', { class: 'health-culprits' }, culprits.map(culpritItem)));
  return nodes;
}

/**
 * The banner of run `runId`: its element (hidden while the run is fine) and refresh(), which
 * reads the health again (the page calls it at each of its refreshes). A <details> a person
 * opened stays open across refreshes while its culprit stays named.
 * @param {string} runId
 * @returns {{element: HTMLElement, refresh: () => Promise<void>}}
 */
export function healthBanner(runId) {
  const element = el('section', { class: 'card health-banner', id: 'health', role: 'alert', hidden: true });
  async function refresh() {
    /** @type {Health} */
    const health = await api(runPath(runId, '/health'));
    const open = new Set([...element.querySelectorAll('.health-culprit')]
      .filter((item) => item.querySelector('details')?.open)
      .map((item) => /** @type {HTMLElement} */ (item).dataset.label));
    const content = bannerContent(health);
    element.hidden = content === null;
    element.dataset.state = health.state;
    element.classList.toggle('stopped', STOPPED.has(health.state));
    element.replaceChildren(...(content || []));
    for (const item of element.querySelectorAll('.health-culprit')) {
      const details = item.querySelector('details');
      if (details && open.has(/** @type {HTMLElement} */ (item).dataset.label)) details.open = true;
    }
  }
  return { element, refresh };
}
