// @ts-check
// What the user chose for the charts of a page: x axis, smoothing, log scales (per key), labels
// hidden, labels shown over an envelope. The x axis, smoothing and log scales are kept in
// localStorage, so they hold on the next load.

import { X_KINDS } from './plan.js';

const STORE = 'runbus.charts';
const KEEP_LOG_KEYS = 500;

function stored() {
  try {
    return JSON.parse(localStorage.getItem(STORE) || '{}') || {};
  } catch (error) {
    return {};
  }
}

export class Settings {
  constructor() {
    const saved = stored();
    this.xMode = X_KINDS.includes(saved.xMode) ? saved.xMode : 'step';
    const smoothing = Number(saved.smoothing);
    this.smoothing = smoothing >= 0 && smoothing < 1 ? smoothing : 0;
    this.logKeys = new Set(Array.isArray(saved.logKeys) ? saved.logKeys.filter((k) => typeof k === 'string') : []);
    this.hidden = new Set();
    this.shown = new Set();
    /** How many rows the run page's labels table shows (it starts with a page of them). */
    this.labelRows = Infinity;
    this.listeners = [];
    this.frame = null;
  }

  // listener(what): what is 'draw' (redraw from the data held) or 'fetch' (ask for data again).
  onChange(listener) {
    this.listeners.push(listener);
  }

  changed(what) {
    this.save();
    if (what === 'draw') {
      // A slider sends many changes a second: one redraw per frame.
      if (this.frame) return;
      this.frame = requestAnimationFrame(() => {
        this.frame = null;
        for (const listener of this.listeners) listener('draw');
      });
      return;
    }
    for (const listener of this.listeners) listener(what);
  }

  save() {
    try {
      localStorage.setItem(STORE, JSON.stringify({
        xMode: this.xMode, smoothing: this.smoothing, logKeys: [...this.logKeys].slice(-KEEP_LOG_KEYS),
      }));
    } catch (error) {
      // Storage full or refused: the choice holds for this page only.
    }
  }

  setX(mode) {
    if (!X_KINDS.includes(mode) || mode === this.xMode) return;
    this.xMode = mode;
    this.changed('fetch');  // steps and times are asked for separately
  }

  setSmoothing(weight) {
    this.smoothing = Math.max(0, Math.min(0.99, weight));
    this.changed('draw');
  }

  toggleLog(key) {
    if (this.logKeys.has(key)) this.logKeys.delete(key);
    else this.logKeys.add(key);
    this.changed('draw');
  }

  toggleHidden(label) {
    if (this.hidden.has(label)) this.hidden.delete(label);
    else this.hidden.add(label);
    if (this.shown.has(label) && this.hidden.has(label)) {
      this.shown.delete(label);
      this.hidden.delete(label);
      this.changed('fetch');
      return;
    }
    this.changed('draw');
  }

  toggleShown(label) {
    if (this.shown.has(label)) this.shown.delete(label);
    else this.shown.add(label);
    this.hidden.delete(label);
    this.changed('fetch');
  }
}
