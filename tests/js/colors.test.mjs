// colors.js: a label's colour from its name alone; the compared runs' colours by their place.
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { ENVELOPE, labelColor, runColor, slotOf, tint, withAlpha } from '../../dashboard/static/js/colors.js';

const HEX = /^#[0-9a-f]{6}$/;

test('a numbered label takes the slot of its number, whatever the common prefix', () => {
  for (const name of ['rank7', 'worker7', 'gpu-7', 'node_7', 'r7', 'w7', '7', 'RANK7']) assert.equal(slotOf(name), 7, name);
  assert.equal(labelColor('rank0'), '#4e79a7', 'the first ten slots are Tableau 10');
  assert.equal(labelColor('rank7'), labelColor('worker7'));
});

test('other names hash to a slot past the palette, the same on every call', () => {
  const slot = slotOf('trainer-main');
  assert.ok(slot >= 10);
  assert.equal(slotOf('trainer-main'), slot);
  assert.notEqual(slotOf('trainer-main'), slotOf('trainer-mainx'));
  assert.ok(slotOf('rank12345678') >= 10, 'past seven digits a number is a name');
});

test('every colour is a hex colour; neighbouring ranks past ten differ', () => {
  const colors = Array.from({ length: 64 }, (_, i) => labelColor('rank' + i));
  assert.ok(colors.every((c) => HEX.test(c)), colors.join(' '));
  for (let i = 11; i < 64; i += 1) assert.notEqual(colors[i], colors[i - 1]);
  assert.equal(new Set(colors).size, 64);
  for (const text of ['', '\u202e', 'a'.repeat(10_000), '名前']) assert.match(labelColor(text), HEX);
});

test('runs compared take Okabe and Ito colours in order, then others, all distinct', () => {
  const runs = Array.from({ length: 12 }, (_, i) => runColor(i));
  assert.equal(runs[0], '#0072b2');
  assert.equal(new Set(runs).size, 12);
  assert.ok(runs.every((c) => HEX.test(c)));
});

test('alpha and tint from a hex colour', () => {
  assert.equal(withAlpha('#ff8000', 0.5), 'rgba(255,128,0,0.5)');
  assert.equal(tint('#000000', 0.5), 'rgb(128,128,128)');
  assert.equal(tint('#ffffff'), 'rgb(255,255,255)');
  assert.match(ENVELOPE, HEX);
});
