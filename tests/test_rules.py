"""The ordering and finish rules as pure functions, without Redis or storage."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from runbus.storage.rules import (
    CRASHED,
    FAILED,
    FINISHED,
    RUNNING,
    LabelState,
    _fold_each,
    apply_events,
    by_epoch,
    merge_ranges,
    missing_count,
    run_state,
    take_new,
)
from runbus.wire import Event


def ev(label: str, kind: str, epoch: int, seq: int, **data) -> Event:
    return Event("r", label, kind, epoch, seq, float(epoch * 1000 + seq), data)


def fold(label: str, events: list[Event]) -> LabelState:
    return apply_events(LabelState("r", label), events)


def test_finish_before_start_still_finishes():
    events = [ev("rank0", "finish", 1, 3, exit_code=0), ev("rank0", "start", 1, 1, primary=True)]
    state = fold("rank0", events)
    assert (state.state, state.exit_code, state.primary) == (FINISHED, 0, True)
    assert run_state([state]).state == FINISHED


def test_only_the_primary_finishes_the_run():
    primary = fold("rank0", [ev("rank0", "start", 1, 1, primary=True)])
    worker_ok = fold(
        "rank1", [ev("rank1", "start", 1, 1, primary=False), ev("rank1", "finish", 1, 2, exit_code=0)]
    )
    worker_bad = fold(
        "rank2", [ev("rank2", "start", 1, 1, primary=False), ev("rank2", "finish", 1, 2, exit_code=3)]
    )
    assert (worker_ok.state, worker_bad.state, worker_bad.exit_code) == (FINISHED, FAILED, 3)
    assert run_state([primary, worker_ok, worker_bad]).state == RUNNING
    done = apply_events(primary, [ev("rank0", "finish", 1, 9, exit_code=0)])
    derived = run_state([done, worker_ok, worker_bad])
    assert (derived.state, derived.primary, derived.exit_code) == (FINISHED, "rank0", 0)
    failed = apply_events(primary, [ev("rank0", "finish", 1, 9, exit_code=2)])
    assert run_state([failed, worker_ok]).state == FAILED


def test_a_new_epoch_runs_again_and_an_old_finish_does_not_end_it():
    events = [
        ev("rank0", "start", 1, 1, primary=True),
        ev("rank0", "finish", 1, 5, exit_code=1),
        ev("rank0", "start", 2, 1, primary=True),
    ]
    for order in (events, events[::-1]):
        state = fold("rank0", order)
        assert (state.state, state.epoch, state.last_seq) == (RUNNING, 2, 1)


def test_missing_counts_per_epoch():
    assert missing_count({1: 10, 2: 3}, {1: 8, 2: 3}) == 2
    assert missing_count({}, {}) == 0


label_events = st.lists(
    st.tuples(
        st.integers(1, 3),
        st.integers(1, 30),
        st.sampled_from(["metric", "heartbeat", "finish", "start"]),
        st.integers(0, 2),
    ),
    min_size=1,
    max_size=40,
)


@given(label_events, st.randoms(use_true_random=False))
def test_state_does_not_depend_on_arrival_order_or_duplicates(raw, rnd: random.Random):
    by_position = {}
    for epoch, seq, kind, code in raw:
        data = {"exit_code": code} if kind == "finish" else {"primary": True} if kind == "start" else {}
        by_position[epoch, seq] = ev("rank0", kind, epoch, seq, **data)
    events = list(by_position.values())
    expected = fold("rank0", sorted(events, key=lambda e: e.position))
    shuffled = events + rnd.sample(events, k=min(5, len(events)))
    rnd.shuffle(shuffled)
    assert fold("rank0", shuffled) == expected


seq_sets = st.sets(st.integers(1, 60), max_size=40)


# A batch is usually one unbroken run of seqs (take_new's fast path); any list otherwise.
seq_batches = st.one_of(
    st.lists(st.integers(1, 60), max_size=40),
    st.builds(lambda first, size: list(range(first, first + size)), st.integers(1, 60), st.integers(1, 40)),
)


@given(seq_sets, seq_batches, st.booleans())
def test_take_new_agrees_with_a_set_of_seqs(stored, batch, only_near):
    ranges = merge_ranges((seq, seq) for seq in stored)
    events = [ev("rank0", "metric", 1, seq) for seq in sorted(batch)]
    if only_near and events:
        # As the stores ask: only the ranges touching the batch's span, one seq either side.
        low, high = events[0].seq - 1, events[-1].seq + 1
        ranges = tuple((a, b) for a, b in ranges if b >= low and a <= high)
    seen = take_new(events, ranges)
    assert [e.seq for e in seen.fresh] == sorted(set(batch) - stored)
    assert seen.replaced == tuple(sorted(ranges))
    kept = {seq for a, b in seen.replaced for seq in range(a, b + 1)} | set(batch)
    assert seen.ranges == merge_ranges((seq, seq) for seq in kept)


@given(
    st.lists(
        st.tuples(st.integers(1, 3), st.integers(1, 30), st.sampled_from(["metric", "log", "system"])),
        min_size=1,
        max_size=40,
    ),
    st.sampled_from([RUNNING, FINISHED, CRASHED]),
    st.sampled_from([None, 0.5, 5000.0]),
)
def test_folding_events_that_change_no_state_agrees_with_folding_one_by_one(raw, state, ts):
    events = [ev("rank0", kind, epoch, seq) for epoch, seq, kind in raw]
    label = LabelState("r", "rank0", state=state, epoch=2, last_seq=3, first_ts=ts, last_ts=ts)
    assert apply_events(label, events) == _fold_each(label, events)


def test_by_epoch_splits_a_label_s_events_in_order():
    events = [ev("rank0", "metric", epoch, seq) for epoch, seq in [(1, 1), (1, 2), (2, 1), (3, 5)]]
    assert {e: [x.seq for x in xs] for e, xs in by_epoch(events).items()} == {1: [1, 2], 2: [1], 3: [5]}
    assert by_epoch(events[:2]) == {1: events[:2]}
    assert by_epoch([]) == {}
