"""The ordering and finish rules as pure functions, without Redis or storage."""

from __future__ import annotations

import dataclasses
import random

from hypothesis import given
from hypothesis import strategies as st

from runbus import wire
from runbus.storage.rules import (
    CRASHED,
    FAILED,
    FINISHED,
    RUNNING,
    SEQ_REACH,
    LabelState,
    RunState,
    Setting,
    _fold_each,
    apply_events,
    by_epoch,
    crash,
    decide_primary,
    latest_settings,
    lives_of,
    merge_ranges,
    merge_settings,
    missing_count,
    out_of_reach,
    primary_claims,
    refuse,
    refused_claims,
    run_state,
    settings_of,
    standing_settings,
    take_new,
)
from runbus.wire import Event, Fence


def ev(label: str, kind: str, epoch: int, seq: int, **data) -> Event:
    return Event("r", label, kind, epoch, seq, float(epoch * 1000 + seq), data)


def fold(label: str, events: list[Event]) -> LabelState:
    return apply_events(LabelState("r", label), events)


def test_finish_before_start_still_finishes():
    events = [ev("rank0", "finish", 1, 3, exit_code=0), ev("rank0", "start", 1, 1, primary=True)]
    state = fold("rank0", events)
    assert (state.state, state.exit_code, state.primary) == (FINISHED, 0, True)
    assert run_state([state], "rank0").state == FINISHED


def test_only_the_primary_finishes_the_run():
    primary = fold("rank0", [ev("rank0", "start", 1, 1, primary=True)])
    worker_ok = fold(
        "rank1", [ev("rank1", "start", 1, 1, primary=False), ev("rank1", "finish", 1, 2, exit_code=0)]
    )
    worker_bad = fold(
        "rank2", [ev("rank2", "start", 1, 1, primary=False), ev("rank2", "finish", 1, 2, exit_code=3)]
    )
    assert (worker_ok.state, worker_bad.state, worker_bad.exit_code) == (FINISHED, FAILED, 3)
    assert run_state([primary, worker_ok, worker_bad], "rank0").state == RUNNING
    done = apply_events(primary, [ev("rank0", "finish", 1, 9, exit_code=0)])
    derived = run_state([done, worker_ok, worker_bad], "rank0")
    assert (derived.state, derived.primary, derived.exit_code) == (FINISHED, "rank0", 0)
    failed = apply_events(primary, [ev("rank0", "finish", 1, 9, exit_code=2)])
    assert run_state([failed, worker_ok], "rank0").state == FAILED


def test_a_new_epoch_runs_again_and_an_old_finish_does_not_end_it():
    events = [
        ev("rank0", "start", 1, 1, primary=True),
        ev("rank0", "finish", 1, 5, exit_code=1),
        ev("rank0", "start", 2, 1, primary=True),
    ]
    for order in (events, events[::-1]):
        state = fold("rank0", order)
        assert (state.state, state.epoch, state.last_seq) == (RUNNING, 2, 1)


def test_a_labels_lives_number_its_epochs_from_one_in_ascending_order():
    restarted = [1_764_190_005_000, 1_764_190_000_000, 1_764_190_005_000, 1_764_190_009_000]
    assert lives_of(restarted) == {1_764_190_000_000: 1, 1_764_190_005_000: 2, 1_764_190_009_000: 3}
    assert lives_of([7]) == {7: 1} and lives_of([]) == {}


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


def lives(events: list[Event]) -> tuple[str, int | None]:
    """The rule as its definition reads, for the property below: events in (epoch, seq) order;
    a finish ends the label, and only a start of a newer epoch than that finish begins a new life."""
    ended: Event | None = None
    for event in sorted(events, key=lambda e: e.position):
        if event.kind == "finish":
            ended = event
        elif event.kind == "start" and ended is not None and event.epoch > ended.epoch:
            ended = None
    if ended is None:
        return RUNNING, None
    code = ended.data["exit_code"]
    return (FINISHED if code == 0 else FAILED), code


every_kind = st.lists(
    st.tuples(
        st.integers(1, 3),
        st.integers(1, 30),
        st.sampled_from(["metric", "log", "system", "heartbeat", "finish", "start"]),
        st.integers(0, 2),
    ),
    min_size=1,
    max_size=40,
)


def rank0_events(raw) -> list:
    """rank0's events of `raw` ((epoch, seq, kind, exit code) tuples), one per position."""
    by_position = {}
    for epoch, seq, kind, code in raw:
        data = {"exit_code": code} if kind == "finish" else {"primary": True} if kind == "start" else {}
        by_position[epoch, seq] = ev("rank0", kind, epoch, seq, **data)
    return list(by_position.values())


def applied_shuffled(events: list, rnd: random.Random, batches: int) -> LabelState:
    """rank0's state after `events`, with duplicates, shuffled and cut into `batches` batches."""
    mixed = events + rnd.sample(events, k=min(5, len(events)))
    rnd.shuffle(mixed)
    label = LabelState("r", "rank0")
    for n in range(batches):
        label = apply_events(label, mixed[n * len(mixed) // batches : (n + 1) * len(mixed) // batches])
    return label


@given(every_kind, st.randoms(use_true_random=False), st.integers(1, 6))
def test_state_is_the_finish_rule_folded_in_position_order(raw, rnd: random.Random, batches):
    """Any arrival order, duplicates and batch cuts give the state the rule defines."""
    events = rank0_events(raw)
    label = applied_shuffled(events, rnd, batches)
    assert (label.state, label.exit_code) == lives(events)


def test_a_finished_label_is_not_revived_by_later_events_of_its_epoch():
    done = fold("rank0", [ev("rank0", "start", 1, 1, primary=True), ev("rank0", "finish", 1, 5, exit_code=0)])
    for kind in ("heartbeat", "metric", "log", "system", "start"):
        later = apply_events(done, [ev("rank0", kind, 1, 6, primary=True)])
        assert (later.state, later.exit_code, later.state_pos) == (FINISHED, 0, (1, 5)), kind
    # Nor by a newer epoch's heartbeat or metrics: only its start is a new life.
    assert apply_events(done, [ev("rank0", "heartbeat", 2, 3), ev("rank0", "metric", 2, 4)]).state == FINISHED
    failed = apply_events(done, [ev("rank0", "finish", 1, 9, exit_code=3)])
    assert (failed.state, failed.exit_code) == (FAILED, 3)  # a later finish of the same life
    again = apply_events(failed, [ev("rank0", "heartbeat", 2, 2), ev("rank0", "start", 2, 1, primary=True)])
    assert (again.state, again.exit_code) == (RUNNING, None)
    # The old life's late finish does not end the new one; the new life's does.
    assert apply_events(again, [ev("rank0", "finish", 1, 12, exit_code=0)]).state == RUNNING
    assert apply_events(again, [ev("rank0", "finish", 2, 7, exit_code=0)]).state == FINISHED


def test_crash_detection_applies_to_running_labels_only():
    running = fold("rank0", [ev("rank0", "start", 1, 1, primary=True), ev("rank0", "heartbeat", 1, 4)])
    crashed = crash(running)
    assert (crashed.state, crashed.state_pos, crashed.state_ts) == (CRASHED, (1, 4), running.last_ts)
    done = apply_events(running, [ev("rank0", "finish", 1, 5, exit_code=0)])
    assert crash(done) == done
    # A late event from before the crash mark does not revive it; anything beyond it does.
    assert apply_events(crashed, [ev("rank0", "metric", 1, 3)]).state == CRASHED
    assert apply_events(crashed, [ev("rank0", "log", 1, 5)]).state == RUNNING
    # Its finish, arriving late, ends it as it ended.
    late = apply_events(crashed, [ev("rank0", "finish", 1, 2, exit_code=7)])
    assert (late.state, late.exit_code) == (FAILED, 7)


def test_a_finish_with_a_null_exit_code_marks_the_label_crashed_at_once():
    """A console keeper's notice (the rank ended, its status unknown): a finish of a new epoch,
    seq 1, with a null exit code. Crashed as silence would mark it, without the wait."""
    life = [ev("rank0", "start", 1, 1, primary=True), ev("rank0", "metric", 1, 4)]
    notice = ev("rank0", "finish", 2, 1, exit_code=None)
    crashed = fold("rank0", [*life, notice])
    assert (crashed.state, crashed.exit_code, crashed.state_pos) == (CRASHED, None, (2, 1))
    assert run_state([crashed], "rank0") == RunState(CRASHED, "rank0", None, notice.ts)
    # Late events of the rank's epoch do not revive it; a restarted process's start does.
    assert apply_events(crashed, [ev("rank0", "log", 1, 9)]).state == CRASHED
    assert apply_events(crashed, [ev("rank0", "start", 3, 1, primary=True)]).state == RUNNING
    # A finish with a code says how the life ended, whichever arrives first.
    finish = ev("rank0", "finish", 1, 5, exit_code=0)
    for events in ([*life, finish, notice], [*life, notice, finish]):
        assert (fold("rank0", events).state, fold("rank0", events).exit_code) == (FINISHED, 0)
    # The notice of a killed rank whose status was read is a plain finish: it ends the label.
    killed = fold("rank0", [*life, ev("rank0", "finish", 2, 1, exit_code=137, signal=9)])
    assert (killed.state, killed.exit_code) == (FAILED, 137)


@given(every_kind, st.randoms(use_true_random=False), st.integers(1, 6))
def test_a_null_finish_after_every_event_gives_crashed_unless_a_finish_said_how(raw, rnd, batches):
    """The notice comes after everything its rank wrote, in a newer epoch: whatever order and
    batch cuts the rank's own events arrive in, the label is crashed unless a finish with a code
    ended its latest life."""
    events = rank0_events(raw)
    label = applied_shuffled(events, rnd, batches)
    label = apply_events(label, [ev("rank0", "finish", 4, 1, exit_code=None)])
    state, code = lives(events)
    assert (label.state, label.exit_code) == ((CRASHED, None) if state == RUNNING else (state, code))


def test_the_first_primary_claim_wins_and_later_ones_are_refused():
    stray = ev("stray", "start", 1, 1, primary=True)
    real = ev("rank0", "start", 1, 1, primary=True)
    worker = ev("rank1", "start", 1, 1, primary=False)
    assert primary_claims([stray, worker, ev("rank1", "heartbeat", 1, 2)]) == [stray]
    assert decide_primary(None, []) is None
    assert decide_primary(None, [worker][:0], "rank0") is None  # no claim seen yet: nothing decided
    # No live claim (a run written by hand): the earliest claim wins, by ts then label.
    assert decide_primary(None, [real, stray]) == "rank0"
    assert decide_primary(None, [stray._replace(ts=real.ts - 1), real]) == "stray"
    # The live claim decides, even when the holder's own start has not arrived.
    assert decide_primary(None, [stray], holder="rank0") == "rank0"
    # Decided once: nothing changes it.
    assert decide_primary("rank0", [stray], holder="stray") == "rank0"
    refused = refused_claims("rank0", [stray, real, stray._replace(seq=9, ts=5000.0)])
    assert refused == {"stray": 5000.0}
    label = refuse(LabelState("r", "stray"), 5000.0)
    assert refuse(label, 10.0) == label and refuse(label, 6000.0).primary_refused_ts == 6000.0


@given(
    st.lists(
        st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.integers(0, 5)), max_size=4),
        max_size=6,
    ),
    st.sampled_from([None, "a", "z"]),
)
def test_a_run_s_primary_is_decided_once_and_every_other_claim_refused(batches, holder):
    """Claims arriving in any batches: the first batch with a claim decides (its live claim's
    holder, else its earliest claim), nothing changes it after, and every other claimant is
    refused at its latest claim."""
    decided, refused, first = None, {}, None
    for batch in batches:
        claims = [ev(label, "start", 1, 1, primary=True)._replace(ts=float(ts)) for label, ts in batch]
        before = decided
        decided = decide_primary(decided, claims, holder)
        if claims and first is None:
            first = holder or min(claims, key=lambda e: (e.ts, e.label)).label
        assert before is None or decided == before
        for label, ts in refused_claims(decided, claims).items():
            refused[label] = max(refused.get(label, ts), ts)
    claimants = {label for batch in batches for label, _ in batch}
    assert decided == first
    assert set(refused) == claimants - {decided}
    for label, ts in refused.items():
        assert ts == max(t for batch in batches for name, t in batch if name == label)


def test_the_run_follows_its_primary_whatever_other_labels_claim():
    rank0 = fold(
        "rank0", [ev("rank0", "start", 1, 1, primary=True), ev("rank0", "finish", 1, 9, exit_code=3)]
    )
    stray = fold(
        "stray", [ev("stray", "start", 1, 1, primary=True), ev("stray", "finish", 1, 2, exit_code=0)]
    )
    derived = run_state([stray, rank0], "rank0")
    assert (derived.state, derived.primary, derived.exit_code, derived.ended_ts) == (
        FAILED,
        "rank0",
        3,
        1009.0,
    )


def label_in(state: str, name: str, code: int | None = None, ts: float | None = None) -> LabelState:
    return LabelState("r", name, state=state, exit_code=code, state_ts=ts)


def test_without_a_known_primary_the_run_follows_its_labels():
    assert run_state([], None).state == run_state([], "rank0").state == RUNNING
    ok, bad, lost = label_in(FINISHED, "a", 0, 10.0), label_in(FAILED, "b", 3, 20.0), label_in(CRASHED, "c")
    late_bad = label_in(FAILED, "d", 4, 30.0)
    assert run_state([ok, label_in(RUNNING, "x")], None).state == RUNNING
    assert (run_state([ok], None).state, run_state([ok], None).exit_code) == (FINISHED, 0)
    assert run_state([ok, lost], None).state == CRASHED
    derived = run_state([late_bad, lost, ok, bad], None)
    assert (derived.state, derived.exit_code, derived.ended_ts) == (FAILED, 3, 30.0)
    # A primary named by its live claim but not heard from: the labels decide, the name stays,
    # and a label refused the primary role is not one of them.
    assert run_state([ok], "rank0") == dataclasses.replace(run_state([ok], None), primary="rank0")
    assert run_state([refuse(ok, 5.0)], "rank0") == RunState(RUNNING, "rank0", None)


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


# -- run metadata -----------------------------------------------------------------------------------


def meta(label: str, seq: int, data: dict, epoch: int = 1, ts: float | None = None) -> Event:
    return Event("r", label, "meta", epoch, seq, float(epoch * 1000 + seq) if ts is None else ts, data)


def test_settings_come_from_start_configs_and_meta_events_redacted():
    found = settings_of(
        [
            ev("rank0", "start", 1, 1, primary=True, config={"lr": 0.1, "api_key": "sekrit"}),
            meta("rank0", 2, {"summary": {"acc": 0.5}, "name": "n", "tags": ["a"]}),
            ev("rank0", "metric", 1, 3, loss=1.0),
        ]
    )
    assert [(s.field, s.key, s.value, s.seq) for s in found] == [
        ("config", "lr", 0.1, 1),
        ("config", "api_key", "***", 1),
        ("summary", "acc", 0.5, 2),
        ("name", "", "n", 2),
        ("tags", "", ["a"], 2),
    ]


def test_the_primary_s_value_wins_else_the_latest_of_the_others():
    settings = [
        Setting("rank1", "config", "lr", 0.5, 1, 9, 30.0),
        Setting("rank0", "config", "lr", 0.1, 1, 2, 10.0),  # earlier, but the primary's
        Setting("rank1", "config", "only1", "a", 1, 3, 20.0),
        Setting("rank2", "config", "only1", "b", 1, 3, 25.0),  # later by ts
        Setting("rank2", "config", "tie", "x", 1, 3, 5.0),
        Setting("rank3", "config", "tie", "y", 1, 3, 5.0),  # the same ts: then by label
    ]
    merged = merge_settings(settings, "rank0")
    assert {key: (s.label, s.value) for (_, key), s in merged.items()} == {
        "lr": ("rank0", 0.1),
        "only1": ("rank2", "b"),
        "tie": ("rank3", "y"),
    }
    # Without a primary, the latest by ts wins.
    assert merge_settings(settings, None)["config", "lr"].label == "rank1"


def test_a_restarted_label_s_config_stands_from_its_latest_start():
    settings = [
        Setting("rank0", "config", "old", 1, 1, 5, 1.0),
        Setting("rank0", "config", "new", 2, 2, 1, 2.0),
        Setting("rank0", "summary", "best", 3, 1, 6, 1.5),
        Setting("rank1", "config", "other", 4, 1, 5, 1.0),
    ]
    standing = standing_settings(settings, {"rank0": (2, 1), "rank1": (1, 1)})
    assert [(s.label, s.key) for s in standing] == [("rank0", "new"), ("rank0", "best"), ("rank1", "other")]


setting_events = st.lists(
    st.tuples(
        st.sampled_from(["rank0", "rank1", "rank2"]),
        st.integers(1, 2),
        st.integers(1, 8),
        st.sampled_from(["config", "summary", "name"]),
        st.sampled_from(["a", "b"]),
        st.integers(0, 9),
    ),
    max_size=30,
)


@given(setting_events, st.randoms(use_true_random=False), st.sampled_from([None, "rank0", "rank1"]))
def test_the_run_s_view_does_not_depend_on_arrival_order_or_duplicates(raw, rnd: random.Random, primary):
    events = []
    for label, epoch, seq, field, key, value in raw:
        data = {field: f"v{value}"} if field == "name" else {field: {key: value}}
        # One position holds one event: its ts follows its position.
        events.append(meta(label, seq, data, epoch=epoch, ts=float(epoch * 100 + seq)))
    unique = list({(e.label, e.epoch, e.seq): e for e in events}.values())

    def view(order: list[Event]) -> dict:
        latest = latest_settings(settings_of(order)).values()
        return {k: (s.label, s.value) for k, s in merge_settings(latest, primary).items()}

    shuffled = unique + rnd.sample(unique, len(unique) // 2)
    rnd.shuffle(shuffled)
    assert view(shuffled) == view(sorted(unique, key=lambda e: (e.label, e.epoch, e.seq)))


# -- fencing: what no lease holder wrote changes nothing ---------------------------------------------


def test_a_seq_beyond_reach_is_refused_and_a_reported_drop_extends_the_reach():
    label = fold("rank0", [ev("rank0", "start", 5, 1, primary=True), ev("rank0", "metric", 5, 2, x=1)])
    assert out_of_reach(label, [ev("rank0", "metric", 5, 2 + SEQ_REACH, x=1)]) is None
    forged = ev("rank0", "finish", 5, 10**9, exit_code=7)
    assert "seq 1000000000 of epoch 5 lies 999,999,998 beyond" in (out_of_reach(label, [forged]) or "")
    # A newer epoch counts from 0; an older one is not judged (its stored top is not known here).
    assert out_of_reach(label, [ev("rank0", "start", 6, 1 + SEQ_REACH, primary=True)]) is not None
    assert out_of_reach(label, [ev("rank0", "metric", 4, 10**9, x=1)]) is None
    # A chain of events within reach of each other passes; the producer's report of a drop too.
    chain = [ev("rank0", "metric", 5, 2 + n * SEQ_REACH, x=1) for n in range(1, 4)]
    assert out_of_reach(label, chain) is None
    report = ev("rank0", "heartbeat", 5, 10**9 - 1, dropped_ranges=[[3, 10**9 - 2]])
    assert out_of_reach(label, [report, forged]) is None


def test_an_epoch_s_seal_covers_its_entry():
    secret = wire.new_seal_secret()
    entry = ev("rank0", "finish", 7, 3, exit_code=0)
    data = b'{"exit_code":0}'
    fields = [b"finish", b"7", b"3", repr(entry.ts).encode(), b"", data]
    stamp = wire.seal_event(secret, "finish", 7, 3, entry.ts, None, data)
    assert stamp == wire.seal(secret, fields) and len(stamp) == 32
    sealed = Fence({7: secret}, 7)
    assert wire.fence_reason(entry, fields, stamp, sealed, require_seal=False) is None
    # Another exit code, seq or kind under the same seal, or another epoch's secret, is refused;
    # so is no seal at all.
    for at, value in [(5, b'{"exit_code":7}'), (2, b"1000000000"), (0, b"start")]:
        other = [*fields[:at], value, *fields[at + 1 :]]
        assert "seal does not match epoch 7" in (wire.fence_reason(entry, other, stamp, sealed, False) or "")
    elsewhere = Fence({7: wire.new_seal_secret()}, 7)
    assert "seal does not match" in (wire.fence_reason(entry, fields, stamp, elsewhere, False) or "")
    assert "carries no seal" in (wire.fence_reason(entry, fields, None, sealed, False) or "")
    assert "carries no seal" in (wire.fence_reason(entry, fields, b"", sealed, False) or "")
    # An epoch never issued (above the counter), or not sealed in a label that seals, is refused.
    late = entry._replace(epoch=99999999999999)
    never = wire.fence_reason(late, fields, stamp, sealed, False)
    assert "epoch 99999999999999 was never issued" in (never or "")
    assert "was not sealed" in (wire.fence_reason(late, fields, stamp, Fence({7: secret}, None), False) or "")


def test_unsealed_entries_are_taken_only_where_no_producer_sealed_yet():
    entry = ev("rank0", "metric", 3, 1, x=1)
    # A label written by an older runbus or by hand (no seals) takes them, up to its counter.
    assert wire.fence_reason(entry, [], None, Fence({}, None), False) is None
    assert wire.fence_reason(entry, [], None, Fence({}, 3), False) is None
    assert "never issued" in (wire.fence_reason(entry, [], None, Fence({}, 2), False) or "")
    # Below the label's first sealed epoch: its history from before the upgrade.
    assert wire.fence_reason(entry, [], None, Fence({4: b"k"}, 4), False) is None
    assert "not sealed" in (wire.fence_reason(entry, [], None, Fence({2: b"k"}, 4), False) or "")
    # Under require_seal, none.
    assert "requires seals" in (wire.fence_reason(entry, [], None, Fence({}, None), True) or "")
