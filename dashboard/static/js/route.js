// @ts-check
// The page's addresses, read and written without the DOM: #/ the runs, #/run/ID[/stragglers|
// /hardware] one run, #/compare/ID,ID,... runs compared.

export const TABS = ['charts', 'stragglers', 'hardware'];
export const MAX_COMPARED = 8;

/**
 * @typedef {{kind: 'run', runId: string, tab: string}} RunRoute
 * @typedef {{kind: 'compare', ids: string[]}} CompareRoute
 */

/**
 * The view an address names; null for the runs list (and for a malformed address).
 * @param {string} hash location.hash
 * @returns {RunRoute|CompareRoute|null}
 */
export function parseRoute(hash) {
  /** @type {RunRoute|CompareRoute|null} */
  let view = null;
  try {
    const match = hash.match(/^#\/run\/([^/]+)(?:\/([a-z]+))?$/);
    if (match) view = { kind: 'run', runId: decodeURIComponent(match[1]), tab: TABS.includes(match[2]) ? match[2] : 'charts' };
    const compare = hash.match(/^#\/compare\/(.+)$/);
    if (compare) {
      const ids = [...new Set(compare[1].split(',').map((id) => decodeURIComponent(id)).filter(Boolean))].slice(0, MAX_COMPARED);
      if (ids.length) view = { kind: 'compare', ids };
    }
  } catch (error) {
    view = null;  // a malformed address: show the runs
  }
  return view;
}

/**
 * @param {string} runId
 * @param {string} [tab]
 */
export function runHref(runId, tab = 'charts') {
  return '#/run/' + encodeURIComponent(runId) + (tab === 'charts' ? '' : '/' + tab);
}

/** @param {string[]} ids */
export function compareHref(ids) {
  return '#/compare/' + ids.map(encodeURIComponent).join(',');
}
