// @ts-check
// Building the page and writing numbers and times. Every string from the bus reaches the page
// through el() (textContent, attribute values, dataset): never as markup, and the text people
// read (text, titles, labels) through printable().

export const STATES = new Set(['running', 'finished', 'failed', 'crashed']);

// The characters runbus/terminal.py shows as escapes: C0 controls but tab and newline, DEL, C1
// controls, and the bidi marks, embeddings, overrides and isolates. Obeyed, U+202E makes a key
// read as another (CVE-2021-42574).
const CONTROL = /[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/g;

// `text` with each such character written as its escape (`\x1b`, `\u202e`), as the terminal does.
export function printable(text) {
  return String(text).replace(CONTROL, (c) => {
    const code = c.charCodeAt(0);
    return code < 0x100 ? '\\x' + code.toString(16).padStart(2, '0') : '\\u' + code.toString(16).padStart(4, '0');
  });
}

// Attributes a person reads; the others (value, href, dataset) keep the string as it is.
const READ = new Set(['title', 'aria-label', 'placeholder', 'alt']);

export function el(tag, props, ...children) {
  const node = document.createElement(tag);
  setProps(node, props);
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : printable(child));
  }
  return node;
}

function setProps(node, props) {
  for (const [name, value] of Object.entries(props || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name === 'class') node.className = value;
    else if (name === 'dataset') Object.assign(node.dataset, value);
    else if (name.startsWith('on')) node.addEventListener(name.slice(2), value);
    else if (value === true) node.setAttribute(name, '');
    else node.setAttribute(name, READ.has(name) ? printable(value) : String(value));
  }
}

export function stateBadge(state, exitCode = null) {
  const known = STATES.has(state) ? state : 'unknown';
  const text = exitCode !== null && exitCode !== undefined && exitCode !== 0 ? state + ' · exit ' + exitCode : state;
  return el('span', { class: 'badge state-' + known, title: 'state: ' + text }, text);
}

export function swatch(color) {
  const node = el('span', { class: 'swatch' });
  node.style.background = color;
  return node;
}

export function setStatus(kind, text) {
  const status = document.getElementById('status');
  status.className = 'status status-' + kind;
  status.textContent = printable(text);
}

export function setCrumbs(...items) {
  const nav = document.getElementById('crumbs');
  nav.replaceChildren();
  items.forEach((item, index) => {
    if (index) nav.append(el('span', { class: 'crumb-sep' }, '/'));
    nav.append(item.href ? el('a', { href: item.href }, item.text) : el('span', { class: 'crumb-here' }, item.text));
  });
}

// A file the user asked for (CSV, PNG), handed over as a download without leaving the page.
export function download(name, blob) {
  const url = URL.createObjectURL(blob);
  const link = el('a', { href: url, download: name, hidden: true });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

// -- numbers and times -------------------------------------------------------------------------

// A number as the API writes it ("NaN", "Infinity" and "-Infinity" are strings; null is none).
export function num(value) {
  return value === null || value === undefined ? NaN : Number(value);
}

export function pad(n, width = 2) {
  return String(n).padStart(width, '0');
}

export function clock(ts, millis = false) {
  const d = new Date(ts * 1000);
  const base = pad(d.getHours()) + ':' + pad(d.getMinutes()) + ':' + pad(d.getSeconds());
  return millis ? base + '.' + pad(d.getMilliseconds(), 3) : base;
}

export function dateTime(ts) {
  if (ts === null || ts === undefined) return '–';
  const d = new Date(ts * 1000);
  return d.getFullYear() + '-' + pad(d.getMonth() + 1) + '-' + pad(d.getDate()) + ' ' + clock(ts);
}

export function duration(seconds) {
  if (!Number.isFinite(seconds) || seconds < 0) return '–';
  const s = Math.round(seconds);
  if (s < 60) return s + 's';
  if (s < 3600) return Math.floor(s / 60) + 'm ' + pad(s % 60) + 's';
  if (s < 86400) return Math.floor(s / 3600) + 'h ' + pad(Math.floor((s % 3600) / 60)) + 'm';
  return Math.floor(s / 86400) + 'd ' + Math.floor((s % 86400) / 3600) + 'h';
}

// A relative time on an axis: signed, and down to the second.
export function elapsed(seconds) {
  if (!Number.isFinite(seconds)) return '';
  const sign = seconds < 0 ? '-' : '';
  const s = Math.abs(Math.round(seconds));
  if (s < 60) return sign + s + 's';
  if (s < 3600) return sign + Math.floor(s / 60) + 'm' + (s % 60 ? pad(s % 60) + 's' : '');
  return sign + Math.floor(s / 3600) + 'h' + pad(Math.floor((s % 3600) / 60)) + 'm';
}

export function ago(ts) {
  if (ts === null || ts === undefined) return '–';
  return duration(Date.now() / 1000 - ts) + ' ago';
}

export function count(n) {
  return n === null || n === undefined ? '–' : Number(n).toLocaleString('en-US');
}

export function value(v) {
  if (v === null || v === undefined) return '–';
  if (typeof v === 'string') return v;
  if (!Number.isFinite(v)) return String(v);
  const abs = Math.abs(v);
  if (abs !== 0 && (abs >= 1e6 || abs < 1e-3)) return v.toExponential(3);
  return String(Number(v.toPrecision(5)));
}

export function compact(v) {
  if (!Number.isFinite(v)) return String(v);
  const abs = Math.abs(v);
  if (abs >= 1e9) return Number((v / 1e9).toPrecision(3)) + 'G';
  if (abs >= 1e6) return Number((v / 1e6).toPrecision(3)) + 'M';
  if (abs >= 1e4) return Number((v / 1e3).toPrecision(3)) + 'k';
  if (abs !== 0 && abs < 1e-3) return v.toExponential(1);
  return String(Number(v.toPrecision(4)));
}
