// route.js: the page's addresses, read as a hostile user might write them.
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { MAX_COMPARED, compareHref, parseRoute, runHref } from '../../dashboard/static/js/route.js';

test('#/ and anything unknown is the runs list', () => {
  for (const hash of ['', '#', '#/', '#/?q=loss&state=running', '#/runs', '#/run/', '#/compare/', '#/compare/,,,']) {
    assert.equal(parseRoute(hash), null, hash);
  }
});

test("a run's page and its tabs; an unknown tab is the charts", () => {
  assert.deepEqual(parseRoute('#/run/exp-1'), { kind: 'run', runId: 'exp-1', tab: 'charts' });
  assert.deepEqual(parseRoute('#/run/exp-1/stragglers'), { kind: 'run', runId: 'exp-1', tab: 'stragglers' });
  assert.deepEqual(parseRoute('#/run/exp-1/hardware'), { kind: 'run', runId: 'exp-1', tab: 'hardware' });
  assert.deepEqual(parseRoute('#/run/exp-1/constructor'), { kind: 'run', runId: 'exp-1', tab: 'charts' });
  assert.equal(parseRoute('#/run/a/b/c'), null);
});

test('ids are decoded; a malformed escape shows the runs rather than throwing', () => {
  assert.equal(parseRoute('#/run/a%2Fb%20c').runId, 'a/b c');
  assert.equal(parseRoute('#/run/%E2%80%AEevil').runId, '\u202eevil');
  assert.equal(parseRoute('#/run/%E0%A4%A'), null);
  assert.equal(parseRoute('#/compare/a,%ZZ'), null);
});

test('runs compared: distinct, non-empty, at most MAX_COMPARED, in the order given', () => {
  assert.deepEqual(parseRoute('#/compare/b,a,b,,c'), { kind: 'compare', ids: ['b', 'a', 'c'] });
  const many = Array.from({ length: 20 }, (_, i) => 'run' + i);
  assert.equal(parseRoute('#/compare/' + many.join(',')).ids.length, MAX_COMPARED);
});

test('the addresses written are read back as they were', () => {
  const ids = ['a,b', 'x/y', 'plain', '名前', '\u202e'];
  assert.deepEqual(parseRoute(compareHref(ids)), { kind: 'compare', ids });
  for (const tab of ['charts', 'stragglers', 'hardware']) {
    assert.deepEqual(parseRoute(runHref('r/1 #x', tab)), { kind: 'run', runId: 'r/1 #x', tab });
  }
  assert.equal(runHref('r1'), '#/run/r1');
  assert.equal(runHref('r1', 'hardware'), '#/run/r1/hardware');
});
