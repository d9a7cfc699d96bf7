// series.js, the page's pure work on series: documents to lines, smoothing, gaps, envelopes.
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { byName, ema, envelopeOf, gapsIn, linesFromSeriesDoc, quantile } from '../../dashboard/static/js/series.js';

test('a series document becomes one line per label and epoch, x and values by column name', () => {
  const doc = {
    x: 'step',
    columns: ['x', 'value', 'epoch', 'min', 'max', 'ts'],
    series: [
      { label: 'rank1', data: [[0, 1, 1, 1, 1, 100], [1, 'NaN', 1, null, 2, 101], [1, 3, 2, 3, 3, 150]] },
      { label: 'rank0', downsampled: true, data: [[0, '-Infinity', 1, 0, 0, 100]] },
    ],
  };
  const lines = linesFromSeriesDoc(doc, (label, series) => label + (series.downsampled ? '*' : ''));
  assert.deepEqual(lines.map((l) => [l.label, l.name, l.epoch, l.downsampled]),
    [['rank1', 'rank1', 1, false], ['rank1', 'rank1', 2, false], ['rank0', 'rank0*', 1, true]]);
  assert.deepEqual(lines[0].step, [0, 1]);
  assert.deepEqual(lines[0].ts, [100, 101]);
  assert.ok(Number.isNaN(lines[0].y[1]), 'the API writes NaN as a string; it is read back as NaN');
  assert.ok(Number.isNaN(lines[0].lo[1]), 'null is no value');
  assert.equal(lines[2].y[0], -Infinity);
});

test('a line lacking the other x for any point has none at all', () => {
  const doc = { x: 'ts', columns: ['x', 'value', 'step'], series: [{ label: 'a', data: [[10, 1, 0], [11, 2, null]] }] };
  const [line] = linesFromSeriesDoc(doc);
  assert.deepEqual(line.ts, [10, 11]);
  assert.equal(line.step, null);
  assert.deepEqual(linesFromSeriesDoc({}), [], 'an empty document has no lines');
});

test('names sort naturally: rank2 before rank10', () => {
  assert.deepEqual(['rank10', 'rank2', 'rank1', 'node1-gpu10', 'node1-gpu9'].sort(byName),
    ['node1-gpu9', 'node1-gpu10', 'rank1', 'rank2', 'rank10']);
});

test('ema is debiased, keeps holes where they were, and is the identity at weight 0', () => {
  const smoothed = ema([4, 4, NaN, null, undefined, 4], 0.9);
  assert.equal(smoothed[0], 4, 'the first value is not pulled towards zero');
  assert.ok(Math.abs(smoothed[1] - 4) < 1e-12);
  assert.deepEqual(smoothed.slice(2, 5), [null, null, undefined]);
  assert.ok(Math.abs(smoothed[5] - 4) < 1e-12);
  assert.deepEqual(ema([1, 5, -2], 0), [1, 5, -2]);
  const step = ema([0, 0, 0, 10], 0.5);
  assert.ok(step[3] > 0 && step[3] < 10, 'a jump is smoothed');
});

test('a gap is a step far above the usual spacing; short or flat lines have none', () => {
  assert.deepEqual(gapsIn([0, 1, 2]), []);
  assert.deepEqual(gapsIn([0, 1, 2, 3, 4, 5]), []);
  assert.deepEqual(gapsIn([0, 1, 2, 3, 100, 101, 102]), [4]);
  assert.deepEqual(gapsIn([5, 5, 5, 5]), []);
});

test('quantile interpolates between sorted values and is NaN for none', () => {
  assert.ok(Number.isNaN(quantile([], 0.5)));
  assert.equal(quantile([1, 2, 3, 4], 0.5), 2.5);
  assert.equal(quantile([1, 2, 3, 4], 0), 1);
  assert.equal(quantile([1, 2, 3, 4], 1), 4);
  assert.ok(Math.abs(quantile([0, 10], 0.1) - 1) < 1e-12);
});

function line(label, ys, { epoch = 1, step0 = 0 } = {}) {
  return {
    label, name: label, epoch, y: ys, lo: ys, hi: ys, downsampled: false,
    step: ys.map((_, i) => step0 + i), ts: ys.map((_, i) => 1000 + step0 + i),
  };
}

test("the envelope of lines: per step min, median, max, and the farthest line as its outlier", () => {
  const lines = [line('r0', [1, 1, 1]), line('r1', [2, 2, 2]), line('r2', [3, 3, 3]), line('r3', [50, 50, 50])];
  const env = envelopeOf(lines);
  assert.deepEqual(env.step, [0, 1, 2]);
  assert.deepEqual(env.ts, [1000, 1001, 1002]);
  assert.deepEqual(env.count, [4, 4, 4]);
  assert.deepEqual(env.min, [1, 1, 1]);
  assert.deepEqual(env.max, [50, 50, 50]);
  assert.deepEqual(env.median, [2.5, 2.5, 2.5]);
  assert.equal(env.labels, 4);
  assert.equal(env.outliers[0], 'r3');
});

test('lines all alike have no outlier, and NaN and inf are counted but never in the quantiles', () => {
  const alike = envelopeOf([line('a', [1, 1]), line('b', [1, 1]), line('c', [1, 1])]);
  assert.deepEqual(alike.outliers, []);
  const env = envelopeOf([line('a', [1, NaN]), line('b', [3, Infinity]), line('c', [2, 2])]);
  assert.deepEqual(env.count, [3, 2], 'NaN is no value; inf is one');
  assert.equal(env.max[1], Infinity);
  assert.equal(env.median[1], 2, 'only finite values make the median');
});

test('a restarted label replays steps: its latest epoch wins at each step', () => {
  const env = envelopeOf([line('a', [1, 1, 1]), line('a', [9, 9], { epoch: 2, step0: 1 })]);
  assert.deepEqual(env.median, [1, 9, 9]);
  assert.equal(env.labels, 1);
});

test('many steps fall into at most `bins` buckets, each at its last step', () => {
  const ys = Array.from({ length: 1000 }, (_, i) => i);
  const env = envelopeOf([line('a', ys), line('b', ys)], { bins: 10 });
  assert.equal(env.step.length, 10);
  assert.equal(env.step.at(-1), 999);
  assert.ok(env.step.every((s, i) => i === 0 || s > env.step[i - 1]));
});
