// @ts-check
// A run's config and summary as rows, without the DOM: nested keys flattened to dotted ones, each
// with the top-level key whose label set it (the API says who set each top-level key).

/**
 * A config value as text: a string as it is, anything else as JSON.
 * @param {unknown} item
 */
export function configText(item) {
  return typeof item === 'string' ? item : JSON.stringify(item);
}

/**
 * [dotted key, value as text, top-level key] for every leaf (an empty object or a list is one).
 * @param {Record<string, unknown>} object
 * @param {string} [prefix]
 * @param {Array<[string, string, string]>} [out]
 * @param {string} [top]
 * @returns {Array<[string, string, string]>}
 */
export function configRows(object, prefix = '', out = [], top = undefined) {
  for (const [name, item] of Object.entries(object)) {
    const key = prefix ? prefix + '.' + name : name;
    const first = top ?? name;
    if (item && typeof item === 'object' && !Array.isArray(item) && Object.keys(item).length) {
      configRows(/** @type {Record<string, unknown>} */ (item), key, out, first);
    } else {
      out.push([key, configText(item), first]);
    }
  }
  return out;
}
