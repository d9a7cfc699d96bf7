// @ts-check
// A label's colour comes from its name alone, so it is the same on every chart, every page and
// every load: `rank7` (any name ending in a number under a common prefix) takes slot 7, any other
// name a slot from a hash of its text. The first ten slots are Tableau 10; later ones walk the
// hue circle by the golden angle, so neighbouring ranks never look alike.

const TABLEAU = ['#4e79a7', '#f28e2b', '#e15759', '#59a14f', '#b07aa1', '#76b7b2',
  '#edc948', '#ff9da7', '#9c755f', '#79706e'];
const NUMBERED = /^(?:rank|worker|node|proc|gpu|r|w)?[-_.]?(\d{1,7})$/i;

export const ENVELOPE = '#475569';

function hash(text) {
  let h = 0x811c9dc5;  // FNV-1a, 32 bits
  for (let i = 0; i < text.length; i += 1) {
    h ^= text.charCodeAt(i);
    h = Math.imul(h, 0x01000193) >>> 0;
  }
  return h;
}

export function slotOf(name) {
  const match = NUMBERED.exec(name);
  return match ? Number(match[1]) : 10 + (hash(name) % 9973);
}

function colorOfSlot(slot) {
  if (slot < TABLEAU.length) return TABLEAU[slot];
  const hue = (slot * 137.508) % 360;
  const light = [42, 52, 36][slot % 3];
  return hslToHex(hue, 62, light);
}

const cache = new Map();

export function labelColor(name) {
  let color = cache.get(name);
  if (!color) {
    color = colorOfSlot(slotOf(name));
    cache.set(name, color);
  }
  return color;
}

// The compared runs' colours, by their place in the comparison: Okabe and Ito's palette, told
// apart with any colour vision (pairwise CIEDE2000 above 20: tests/test_compare.py). A hash of
// the id, as labels have, let two of three runs take near greens.
const RUNS = ['#0072b2', '#e69f00', '#009e73', '#cc79a7', '#56b4e9', '#d55e00', '#f0e442', '#000000'];

export function runColor(index) {
  return index < RUNS.length ? RUNS[index] : colorOfSlot(index + 10);
}

export function withAlpha(hex, alpha) {
  const [r, g, b] = channels(hex);
  return `rgba(${r},${g},${b},${alpha})`;
}

// Lighter, for the dark log console.
export function tint(hex, amount = 0.35) {
  return 'rgb(' + channels(hex).map((c) => Math.round(c + (255 - c) * amount)).join(',') + ')';
}

function channels(hex) {
  return [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
}

function hslToHex(h, s, l) {
  const a = (s / 100) * Math.min(l / 100, 1 - l / 100);
  const f = (n) => {
    const k = (n + h / 30) % 12;
    const c = l / 100 - a * Math.max(-1, Math.min(k - 3, 9 - k, 1));
    return Math.round(255 * c).toString(16).padStart(2, '0');
  };
  return '#' + f(0) + f(8) + f(4);
}
