"""The detector's straggler read (ingester/findings.py over storage/steptimes.py) on each backend:
re-read as a stored batch brings steps of its key, counted from the tally's last step on, to the
same seconds lost as one read of the whole run; not re-read before it is due otherwise."""

from __future__ import annotations

import random

from runbus.ingester.findings import FindingsReader
from runbus.storage import steptimes
from runbus.storage.stragglers import Tally
from runbus.wire import Event

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


async def test_the_stragglers_are_re_read_as_their_steps_arrive_and_counted_from_the_last(store):
    run_id, rng = "arrive", random.Random(5)
    await store.write(
        [Event(run_id, label, "start", 1, 1, NOW, {"primary": label == "rank0"}) for label in LABELS]
    )
    await store.write(steps_of(run_id, 0, 29, rng))
    reader = FindingsReader(store, every=3600.0, band_every=3600.0, steps_every=3600.0)
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
