// dom.js's pure half: numbers, durations and text as the page writes them (no document needed).
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { compact, count, duration, elapsed, num, printable, value } from '../../dashboard/static/js/dom.js';

test('printable writes control and bidi characters as escapes, as the terminal does', () => {
  assert.equal(printable('loss\u202e'), 'loss\\u202e');
  assert.equal(printable('a\x1b[31mb'), 'a\\x1b[31mb');
  assert.equal(printable('tab\tand\nnewline'), 'tab\tand\nnewline');
  assert.equal(printable('\x7f\x9f'), '\\x7f\\x9f');
  assert.equal(printable(12), '12');
});

test('the API writes NaN and infinities as strings and nothing as null: all numbers here', () => {
  assert.ok(Number.isNaN(num(null)));
  assert.ok(Number.isNaN(num(undefined)));
  assert.ok(Number.isNaN(num('NaN')));
  assert.equal(num('-Infinity'), -Infinity);
  assert.equal(num(2.5), 2.5);
});

test('durations: seconds, minutes, hours, days; a negative or unknown one is a dash', () => {
  assert.equal(duration(59.4), '59s');
  assert.equal(duration(61), '1m 01s');
  assert.equal(duration(3600 * 2 + 65), '2h 01m');
  assert.equal(duration(86400 * 3 + 7200), '3d 2h');
  assert.equal(duration(-1), '–');
  assert.equal(duration(NaN), '–');
});

test('elapsed time on an axis is signed and down to the second', () => {
  assert.equal(elapsed(-90), '-1m30s');
  assert.equal(elapsed(120), '2m');
  assert.equal(elapsed(3660), '1h01m');
  assert.equal(elapsed(Infinity), '');
});

test('counts, values and compact ticks', () => {
  assert.equal(count(1234567), '1,234,567');
  assert.equal(count(null), '–');
  assert.equal(value(0.000123), '1.230e-4');
  assert.equal(value(3.14159265), '3.1416');
  assert.equal(value(NaN), 'NaN');
  assert.equal(value('text'), 'text');
  assert.equal(compact(1_500_000), '1.5M');
  assert.equal(compact(25_000), '25k');
  assert.equal(compact(2e9), '2G');
  assert.equal(compact(-Infinity), '-Infinity');
});
