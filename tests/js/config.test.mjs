// config.js and hardware.js's pure part: a run's config as rows, a label's GPUs in a line.
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { configRows, configText } from '../../dashboard/static/js/config.js';
import { gpuSummary } from '../../dashboard/static/js/hardware.js';

test('nested keys are flattened to dotted ones, each with the top-level key that says who set it', () => {
  const rows = configRows({ lr: 0.1, model: { layers: 12, act: { name: 'gelu' } }, tags: ['a', 'b'], empty: {}, none: null });
  assert.deepEqual(rows, [
    ['lr', '0.1', 'lr'],
    ['model.layers', '12', 'model'],
    ['model.act.name', 'gelu', 'model'],
    ['tags', '["a","b"]', 'tags'],
    ['empty', '{}', 'empty'],
    ['none', 'null', 'none'],
  ]);
  assert.deepEqual(configRows({}), []);
});

test('a string is shown as it is, anything else as JSON', () => {
  assert.equal(configText('<b>x</b>'), '<b>x</b>');
  assert.equal(configText('3'), '3');
  assert.equal(configText(3), '3');
  assert.equal(configText(true), 'true');
  assert.equal(configText({ a: [1] }), '{"a":[1]}');
});

test("a label's GPUs: alike ones counted together, with their memory", () => {
  assert.equal(gpuSummary(null), '–');
  assert.equal(gpuSummary([]), 'none');
  const h100 = { name: 'NVIDIA H100 80GB HBM3', memory_total_mb: 81559.4 };
  assert.equal(gpuSummary([h100, h100, { name: 'NVIDIA A10' }, {}]),
    '2 × NVIDIA H100 80GB HBM3 (81,559 MB), 1 × NVIDIA A10, 1 × GPU');
});
