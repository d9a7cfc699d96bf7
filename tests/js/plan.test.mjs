// plan.js: what a chart draws, from lines, envelopes and the chart settings, without the DOM.
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { labelColor, withAlpha } from '../../dashboard/static/js/colors.js';
import { envelopesOf, plan, xKindFor } from '../../dashboard/static/js/plan.js';

function line(label, ys, { epoch = 1, step0 = 0, ts = true, step = true, downsampled = false } = {}) {
  return {
    label, name: label, epoch, y: ys, lo: ys.map((y) => y - 1), hi: ys.map((y) => y + 1), downsampled,
    step: step ? ys.map((_, i) => step0 + i) : null, ts: ts ? ys.map((_, i) => 1000 + 10 * (step0 + i)) : null,
  };
}

function envelope(n, { generation = 1, gaps = [] } = {}) {
  const ramp = Array.from({ length: n }, (_, i) => i);
  return {
    step: ramp, ts: ramp.map((i) => 1000 + i), count: ramp.map(() => 8), gaps, generation,
    min: ramp.map((i) => i - 2), p10: ramp.map((i) => i - 1), median: ramp, p90: ramp.map((i) => i + 1), max: ramp.map((i) => i + 2),
  };
}

test('the x asked for when every line has it, else steps, else wall time', () => {
  const both = [{ lines: [line('a', [1, 2])] }];
  assert.equal(xKindFor(both, 'relative'), 'relative');
  assert.equal(xKindFor([{ lines: [line('a', [1]), line('b', [1], { ts: false })] }], 'wall'), 'step');
  assert.equal(xKindFor([{ lines: [line('a', [1], { step: false })] }], 'step'), 'wall');
  assert.deepEqual(envelopesOf({ lines: [] }), []);
  assert.equal(envelopesOf({ lines: [], envelope: envelope(2) }).length, 1);
});

test("one line: a table [x, y] and a series in the label's own colour", () => {
  const out = plan([{ lines: [line('rank3', [5, 6, 7])] }]);
  assert.equal(out.xKind, 'step');
  assert.deepEqual(out.tables, [[[0, 1, 2], [5, 6, 7]]]);
  assert.equal(out.series.length, 1);
  assert.deepEqual({ ...out.series[0] }, { label: 'rank3', epoch: 1, name: 'rank3', color: labelColor('rank3'), role: 'line', stroke: labelColor('rank3'), width: 1.6 });
  assert.deepEqual(out.bands, []);
});

test('relative x counts from the part t0; a hidden label is not drawn', () => {
  const out = plan([{ lines: [line('a', [1, 2]), line('b', [3, 4])], t0: 1000 }], { xMode: 'relative', hidden: new Set(['b']) });
  assert.equal(out.xKind, 'relative');
  assert.deepEqual(out.tables, [[[0, 10], [1, 2]]]);
  assert.deepEqual(out.series.map((s) => s.label), ['a']);
});

test('a later epoch of a label is marked as its restart; a hole becomes a null and a gap mark', () => {
  const first = line('a', [1, 1, 1, 1]);
  const again = line('a', [2, 2], { epoch: 2, step0: 10 });
  const out = plan([{ lines: [first, again] }]);
  assert.deepEqual(out.marks.restarts.map((r) => [r.x, r.label, r.epoch, r.text]), [[10, 'a', 2, 'a restarted']]);
  const holed = { ...line('b', [1, 1, 1, 1, 1]), step: [0, 1, 2, 3, 100] };
  const gapped = plan([{ lines: [holed] }]);
  assert.deepEqual(gapped.tables[0][0], [0, 1, 2, 3, 51.5, 100]);
  assert.equal(gapped.tables[0][1][4], null, 'the line stops across the hole');
  assert.deepEqual(gapped.marks.gaps.map((g) => [g.x0, g.x1, g.label]), [[3, 100, 'b']]);
});

test('non-finite values are holes with a mark; a log scale drops what it cannot draw', () => {
  const out = plan([{ lines: [line('a', [1, NaN, Infinity, -3, 0.5])] }], { log: true });
  assert.deepEqual(out.tables[0][1], [1, null, null, null, 0.5]);
  assert.deepEqual(out.marks.nonFinite.map((m) => [m.x, m.what]), [[1, 'NaN'], [2, 'Infinity']]);
});

test('smoothing draws the raw line faintly under its smoothed one; a downsampled line gets a band', () => {
  const smooth = plan([{ lines: [line('a', [1, 2, 3])] }], { smoothing: 0.5 });
  assert.deepEqual(smooth.series.map((s) => s.role), ['raw', 'line']);
  assert.equal(smooth.series[0].stroke, withAlpha(labelColor('a'), 0.22));
  const banded = plan([{ lines: [line('a', [1, 2, 3], { downsampled: true })] }]);
  assert.deepEqual(banded.series.map((s) => s.role), ['line', 'hi', 'lo']);
  assert.deepEqual(banded.bands.map((b) => b.series), [[2, 3]]);
  assert.deepEqual(banded.tables[0].slice(2), [[2, 3, 4], [0, 1, 2]]);
});

test('an envelope: max/min and p90/p10 bands under the median, its restarts and gaps marked', () => {
  const part = { lines: [], envelope: [envelope(3), envelope(2, { generation: 2, gaps: [[1005, 1010]] })], t0: 1000, prefix: 'run-a', color: '#0072b2' };
  const out = plan([part], { xMode: 'relative' });
  assert.equal(out.xKind, 'relative');
  assert.deepEqual(out.series.slice(0, 5).map((s) => [s.role, s.name]),
    [['max', 'run-a · max'], ['min', 'run-a · min'], ['p90', 'run-a · p90'], ['p10', 'run-a · p10'], ['median', 'run-a · median']]);
  assert.deepEqual(out.bands.map((b) => b.series), [[1, 2], [3, 4], [6, 7], [8, 9]]);
  assert.deepEqual(out.marks.restarts.map((r) => r.text), ['run-a · restart 1']);
  assert.deepEqual(out.marks.gaps.map((g) => [g.x0, g.x1, g.color]), [[5, 10, '#0072b2']]);
  assert.ok(out.series.every((s) => s.color === '#0072b2'));
});

test("a band's labels that went NaN or inf are named on the chart, unless drawn as lines or hidden", () => {
  const nonFinite = [
    { label: 'r7', kind: 'nan', step: 40, ts: 1040 },
    { label: 'r8', kind: 'inf', step: null, ts: 1050 },
    { label: 'r1', kind: 'nan', step: 3, ts: 1003 },
    { label: 'r9', kind: 'nan', step: 9, ts: 1009 },
  ];
  const part = { lines: [line('r1', [1, 1])], envelope: envelope(2), nonFinite };
  const marks = plan([part], { hidden: new Set(['r9']) }).marks.nonFinite;
  assert.deepEqual(marks.map((m) => m.text), ['r7 NaN @40']);
  const byTime = plan([part], { xMode: 'wall' }).marks.nonFinite;
  assert.deepEqual(byTime.map((m) => [m.x, m.text]), [[1040, 'r7 NaN @40'], [1050, 'r8 inf'], [1009, 'r9 NaN @9']]);
});
