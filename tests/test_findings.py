"""The detector's straggler read (ingester/findings.py over storage/steptimes.py) on each backend:
re-read as a stored batch brings steps of its key, counted from the tally's last step on, to the
same seconds lost as one read of the whole run; not re-read before it is due otherwise; and the
detector checks the run soon after such a batch instead of at its interval."""

from __future__ import annotations

import asyncio
import random

from runbus.ingester.findings import FindingsReader
from runbus.ingester.health import HealthKeeper
from runbus.storage import steptimes
from runbus.storage.stragglers import Tally
from runbus.wire import Event
from tests.helpers import wait_for_async

NOW = 1_800_000_000.0
KEY = "perf/compute_s"
LABELS = [f"rank{i}" for i in range(4)]


def steps_of(run_id: str, first: int, last: int, rng: random.Random) -> list[Event]:
    """Each label's compute time at steps first..last (rank1 a quarter slower), seq = step + 2."""
    return [
        Event(run_id, label, "metric", 1, step + 2, NOW + step * 0.1, {KEY: t, "loss": 1.0}, step)
        for step in range(first, last + 1)
        for label in LABELS
        for t in [0.1 * rng.uniform(0.97, 1.03) * (1.25 if label == "rank1" else 1.0)]
    ]


async def start(store, run_id: str) -> None:
    """Each label's start, rank0 the primary."""
    await store.write(
        [Event(run_id, label, "start", 1, 1, NOW, {"primary": label == "rank0"}) for label in LABELS]
    )


def idle_reader(store) -> FindingsReader:
    """A reader that re-reads nothing on its own within a test: only a noted batch makes it."""
    return FindingsReader(store, every=3600.0, band_every=3600.0, steps_every=3600.0)


async def test_the_stragglers_are_re_read_as_their_steps_arrive_and_counted_from_the_last(store):
    run_id, rng = "arrive", random.Random(5)
    await start(store, run_id)
    await store.write(steps_of(run_id, 0, 29, rng))
    reader = idle_reader(store)
    found = await reader.read(run_id, {})
    assert found.source == KEY and found.tally.done == 29
    assert [(s["label"], s["kind"]) for s in found.stragglers] == [("rank1", "chronic")]
    later = steps_of(run_id, 30, 59, rng)
    await store.write(later)
    # Not due: neither this worker's batch noted nor steps_every past.
    assert (await reader.read(run_id, {})).tally.done == 29
    other_run = [event._replace(run="another") for event in later]
    assert not reader.note(other_run) and not reader.note([e for e in later if e.label == "nothing"])
    assert reader.note(later)
    found = await reader.read(run_id, {})
    assert found.tally.done == 59 and found.stragglers[0]["step"] == 59
    whole = Tally()
    whole.count(await steptimes.read(store, run_id, KEY, True, 20, since=0))
    assert found.tally.lost == whole.lost and found.tally.last == whole.last
    assert found.stragglers[0]["lost_s"] == round(whole.lost["rank1"], 3) > 0.025 * 60 * 0.9


async def test_the_detector_checks_a_run_soon_after_a_batch_brings_steps_not_at_its_interval(store):
    run_id, rng = "soon", random.Random(6)
    await start(store, run_id)
    await store.write(steps_of(run_id, 0, 4, rng))  # too few steps to name anyone
    keeper = HealthKeeper(store, interval=600.0)  # without the steps, no check for 10 minutes
    stop = asyncio.Event()
    task = asyncio.create_task(keeper.run(stop))
    try:
        await wait_for_async("the first check", lambda: run_id in keeper.live)
        assert await named(store, run_id) == []
        later = steps_of(run_id, 5, 29, rng)
        await store.write(later)
        await keeper.note(later)
        found = await wait_for_async("rank1 named", lambda: named(store, run_id), timeout=10.0)
        assert found == [("rank1", "chronic", 29)]
    finally:
        stop.set()
        await task


async def named(store, run_id: str) -> list[tuple[str, str, int]]:
    health = await store.health(run_id) or {}
    return [(s["label"], s["kind"], s["step"]) for s in health.get("stragglers") or []]


async def test_a_better_key_logged_later_is_read_from_the_batch_that_brings_it(store):
    # watch() logs perf/compute_s from a run's second step on: a first read may find the loss only.
    run_id, rng = "better", random.Random(7)
    await start(store, run_id)
    await store.write([Event(run_id, label, "metric", 1, 2, NOW, {"loss": 1.0}, 0) for label in LABELS])
    reader = idle_reader(store)
    assert (await reader.read(run_id, {})).source == "loss"
    later = steps_of(run_id, 1, 30, rng)
    await store.write(later)
    assert reader.note(later)
    found = await reader.read(run_id, {})
    assert found.source == KEY and found.time_key
    assert [(s["label"], s["kind"], s["step"]) for s in found.stragglers] == [("rank1", "chronic", 30)]


async def test_a_batch_is_noted_by_the_stepped_metrics_of_a_run_s_key_alone(store):
    run_id, rng = "noted", random.Random(7)
    await start(store, run_id)
    await store.write(steps_of(run_id, 0, 9, rng))
    reader = idle_reader(store)
    assert (await reader.read(run_id, {})).source == KEY
    step = steps_of(run_id, 10, 10, rng)[0]
    others = [
        step._replace(kind="system"),  # not a metric, though it has the key and a step
        step._replace(step=None),  # a metric at no step
        step._replace(data={"loss": 1.0}),  # a step without the key
        step._replace(run="another"),  # a run the reader does not know
    ]
    assert not reader.note(others)
    assert reader.note([*others[:2], step, *others[2:]])
