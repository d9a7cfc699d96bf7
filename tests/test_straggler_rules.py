"""The straggler rules (storage/stragglers.py) without servers: a rank 20% slower is named chronic
within 20 steps across many noisy runs and a healthy rank never is; a one-off slow step is a
one-off; the time lost is the injected delay; and the verdict's state and key follow."""

from __future__ import annotations

import random

from runbus.storage.health import STRAGGLING, HealthSettings, LabelVitals, judge
from runbus.storage.steptimes import Times
from runbus.storage.stragglers import WINDOW, StepTimes, Tally, find, latest

RANKS = 8


def noisy_run(seed: int, slow: int | None, steps: int = 20, slowdown: float = 1.2, noise: float = 0.08):
    """label -> step -> seconds: every rank's compute about 0.1 s with `noise` (relative, normal),
    rank `slow` `slowdown` times slower; and the injected extra seconds."""
    rng = random.Random(seed)
    times: dict[str, dict[int, float]] = {f"rank{r}": {} for r in range(RANKS)}
    injected = 0.0
    for step in range(steps):
        for r in range(RANKS):
            base = 0.1 * max(0.2, rng.gauss(1.0, noise))
            extra = base * (slowdown - 1) if r == slow else 0.0
            injected += extra
            times[f"rank{r}"][step] = base + extra
    return times, injected


def stragglers_of(times: dict[str, dict[int, float]]) -> list[dict]:
    tally = Tally()
    tally.count(Times.of(times))
    return find(StepTimes("perf/compute_s", False, latest(Times.of(times)), tally.lost), {})


def test_a_rank_20_percent_slower_is_named_chronic_within_20_steps_with_99_percent_precision_and_recall():
    trials, named, false = 300, 0, 0
    for seed in range(trials):
        slow = seed % RANKS
        found = [s for s in stragglers_of(noisy_run(seed, slow)[0]) if s["kind"] == "chronic"]
        named += any(s["label"] == f"rank{slow}" for s in found)
        false += sum(1 for s in found if s["label"] != f"rank{slow}")
    assert named / trials >= 0.99
    assert named / max(1, named + false) >= 0.99


def test_healthy_noisy_runs_name_no_chronic_straggler():
    for seed in range(300):
        found = stragglers_of(noisy_run(seed, None)[0])
        assert [s for s in found if s["kind"] == "chronic"] == [], seed


def test_one_slow_step_is_a_one_off_not_chronic():
    times, _ = noisy_run(1, None, noise=0.02)
    times["rank3"][12] *= 3.0
    found = stragglers_of(times)
    assert [(s["label"], s["kind"], s["step"]) for s in found] == [("rank3", "one-off", 12)]
    assert found[0]["behind"] > 2.5


def test_the_time_lost_is_the_injected_delay_within_10_percent():
    for seed in range(20):
        times, injected = noisy_run(seed, 5, steps=60, noise=0.03)
        lost = {s["label"]: s["lost_s"] for s in stragglers_of(times)}
        assert abs(lost["rank5"] - injected) <= 0.1 * injected, (lost, injected)


def test_values_covering_several_steps_count_them_and_steps_arrive_in_pieces():
    # perf/* figures are means over the steps since the last value (every 5 steps here); a step
    # not every label has reached yet is counted when they have.
    times = {"a": {4: 0.1, 9: 0.1, 14: 0.1}, "b": {4: 0.15, 9: 0.15}}
    tally = Tally()
    tally.count(Times.of(times))
    assert tally.done == 9 and abs(tally.lost["b"] - 2 * 5 * 0.05) < 1e-9
    tally.count(Times.of({"a": {14: 0.1, 19: 0.1}, "b": {14: 0.2, 19: 0.1}}))
    assert tally.done == 19 and abs(tally.lost["b"] - (0.5 + 5 * 0.1)) < 1e-9
    assert tally.lost.get("a", 0.0) == 0.0


def test_too_few_steps_or_one_label_name_nobody():
    assert stragglers_of({"a": {1: 0.1, 2: 0.1}, "b": {1: 0.3, 2: 0.3}}) == []
    assert stragglers_of({"a": {s: 0.1 for s in range(30)}}) == []
    assert stragglers_of({}) == []


def test_the_window_forgets_a_rank_that_recovered():
    times, _ = noisy_run(3, None, steps=60, noise=0.02)
    for step in range(30):
        times["rank2"][step] *= 1.5
    early = {label: {s: t for s, t in steps.items() if s < 30} for label, steps in times.items()}
    tally = Tally()
    tally.count(Times.of(early))
    assert [s["kind"] for s in find(StepTimes("k", False, latest(Times.of(early)), tally.lost), {})] == [
        "chronic"
    ]
    tally.count(Times.of(times))
    assert find(StepTimes("k", False, latest(Times.of(times)), tally.lost), {}) == []
    assert tally.lost["rank2"] > 0.1 * 0.5 * 30 * 0.9  # the time it cost is still counted
    assert len(latest(Times.of(times))["rank2"]) == WINDOW


def test_a_chronic_straggler_makes_a_running_run_straggling_below_a_stall():
    now = 1000.0
    beat = {"step": 10, "step_age": 0.1, "step_s": 0.1, "every": 1.0, "host": "node3"}
    labels = [LabelVitals(f"rank{r}", beat, now, now) for r in range(2)]
    slow = [{"label": "rank1", "kind": "chronic", "lost_s": 3.0}]
    verdict = judge("running", labels, now, HealthSettings(), slow)
    assert verdict.state == STRAGGLING and verdict.key == "straggling|slow:rank1"
    assert verdict.document(now)["stragglers"] == slow
    one_off = [{"label": "rank1", "kind": "one-off", "lost_s": 0.2}]
    assert judge("running", labels, now, HealthSettings(), one_off).key == "ok"
    nan = [{"label": "rank0", "key": "loss", "step": 7, "kind": "nan", "ts": now}]
    assert judge("running", labels, now, HealthSettings(), slow, nan).state == "anomaly"
    stacks = [
        [["train.py", 9, "main"], ["torch/distributed/distributed_c10d.py", 1, "all_reduce"]],
        [["train.py", 9, "main"], ["train.py", 3, "load_batch"]],
    ]
    stalled = [
        LabelVitals(f"rank{r}", {**beat, "step_age": 60.0, "stack": stacks[r]}, now, now) for r in range(2)
    ]
    assert judge("running", stalled, now, HealthSettings(), slow).state == "stalled"
    crashed = judge("crashed", labels, now, HealthSettings(), slow)
    assert crashed.state == "crashed" and crashed.ended


def test_the_median_of_the_others_is_each_labels_statistics_median_of_the_rest():
    import random
    import statistics

    from runbus.storage.stragglers import medians_of_others

    rng = random.Random(7)
    for trial in range(300):
        count = rng.randint(2, 40)
        # Ties on purpose now and then: equal values must not confuse which one is left out.
        have = {
            f"rank{i}": float(rng.choice([1, 2, 3])) if trial % 3 == 0 else rng.random() for i in range(count)
        }
        expected = {
            label: statistics.median(v for other, v in have.items() if other != label) for label in have
        }
        assert medians_of_others(have) == expected
