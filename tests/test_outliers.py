"""A label that leaves the cross-rank band (storage/outliers.py, storage/bands.py), on SQLite and
PostgreSQL with real ingest: named at its exact step, merged with the NaN/inf anomalies; healthy
noisy ranks (bench/columns.py's noisy losses: each rank's loss decays at its own rate) never.

Losses are logged at every step of 2,000 by 12 labels in shuffled batches; the step of a 5x jump
must come back exactly, a slow drift at the first bucket where its mean is out of the band.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from runbus.dashboard.api import create_app
from runbus.storage import bands, outliers
from runbus.storage.bands import Band, band_of, departures, split
from runbus.wire import Event
from tests.helpers import get_json, run_cli

T0 = 1_700_000_000.0
STEPS = 2000
JUMP = 700

Values = dict[str, np.ndarray]


def noisy(labels: int, steps: int = STEPS, seed: int = 0) -> Values:
    """bench/columns.py's noisy key: a decay at each rank's own rate, noise at every step."""
    rng = np.random.default_rng(seed)
    s = np.arange(steps, dtype=np.float64)
    return {
        f"rank{i}": 2.5 * np.exp(-s / (700 + 300 * rng.random())) + 0.3 + rng.normal(0, 0.05, steps)
        for i in range(labels)
    }


def grad_norms(labels: int, seed: int = 1) -> Values:
    rng = np.random.default_rng(seed)
    s = np.arange(STEPS, dtype=np.float64)
    decay = 1 + 5 * np.exp(-s / 100)
    return {f"rank{i}": np.abs(rng.normal(1.0, 0.3, STEPS)) * decay for i in range(labels)}


async def write(store, run_id: str, keys: dict[str, Values], nan_at: tuple[str, int] | None = None) -> None:
    """Every label's values of `keys` at every step, in shuffled batches of 500 events; `nan_at`:
    a label's loss NaN at one step."""
    labels = list(next(iter(keys.values())))
    batches: list[list[Event]] = []
    for label in labels:
        mine = []
        for step in range(len(keys["loss"][label])):
            data = {key: float(values[label][step]) for key, values in keys.items()}
            if nan_at == (label, step):
                data["loss"] = math.nan
            mine.append(Event(run_id, label, "metric", 1, step + 1, T0 + step, data, step))
        batches.extend(mine[i : i + 500] for i in range(0, len(mine), 500))
    random.Random(3).shuffle(batches)
    for batch in batches:
        await store.write(batch)


def rows(found: list) -> list[tuple[str, str, int | None, str]]:
    return [(a.label, a.key, a.step, a.kind) for a in found]


# -- the rules, without servers ------------------------------------------------------------------


def test_no_band_below_four_labels_and_identical_ranks_do_not_flag_float_noise():
    assert band_of([1.0, 1.0, 5.0]) is None
    same = band_of([0.1] * 8)
    assert same is not None and same.side(0.1 + 1e-9) == 0 and same.side(0.5) == 1
    zeros = band_of([0.0] * 8)
    assert zeros is not None and zeros.side(1e-15) == 0 and zeros.side(-1e-3) == -1
    # One rank far off moves neither the median nor the MAD much.
    band = band_of([1.0, 1.01, 0.99, 1.02, 0.98, 5.0])
    assert band is not None and band.side(5.0) == 1 and band.side(1.02) == 0


def test_one_bucket_out_is_no_departure_and_a_label_out_from_the_first_never_left():
    band = {(1, b): Band(1.0, 0.1) for b in range(6)}
    spike = {(1, b): {"a": 2.0 if b == 2 else 1.0} for b in range(6)}
    assert departures("a", spike, band) == []
    left = {(1, b): {"a": 2.0 if b >= 3 else 1.0} for b in range(6)}
    assert [(d.cell, d.side, d.was_inside) for d in departures("a", left, band)] == [((1, 3), 1, True)]
    always = {(1, b): {"a": 0.5} for b in range(6)}
    assert [(d.cell, d.was_inside) for d in departures("a", always, band)] == [((1, 0), False)]
    # The exact split: noise outside before it and inside after it does not move it.
    assert split([0, 0, 1, 0, 0, 1, 1, 1, 0, 1, 1], 1) == 5
    assert split([1, 1, 1], 1) == 0


@pytest.mark.parametrize("seed", range(40))
def test_healthy_noisy_ranks_leave_no_band(seed):
    # The rules alone on many seeds (the store tests below take one): 4 to 16 labels.
    values = noisy([4, 6, 8, 12, 16][seed % 5], seed=seed)
    means: dict[tuple[int, int], dict[str, float]] = {}
    for label, v in values.items():
        for b in range(STEPS // 128):
            means.setdefault((1, b), {})[label] = float(v[b * 128 : (b + 1) * 128].mean())
    band = bands.bands(means)
    assert [d for label in values for d in departures(label, means, band)] == []


# -- on the stores -------------------------------------------------------------------------------


async def test_healthy_noisy_ranks_are_not_flagged(store):
    steps = np.arange(STEPS)
    tokens = {f"rank{i}": (steps + 1) * (1000.0 + 400 * i) for i in range(12)}  # ranks differ by design
    await write(store, "healthy", {"loss": noisy(12), "grad_norm": grad_norms(12), "tokens": tokens})
    assert await outliers.outliers(store, "healthy") == []
    assert await outliers.every_anomaly(store, "healthy") == []


async def test_a_rank_that_jumps_is_named_at_its_exact_step_before_a_later_nan(store):
    losses = noisy(12)
    losses["rank5"][JUMP:] *= 5
    await write(store, "jump", {"loss": losses, "grad_norm": grad_norms(12)}, nan_at=("rank2", 1500))
    found = await outliers.outliers(store, "jump")
    assert rows(found) == [("rank5", "loss", JUMP, "outlier")]
    first = found[0]
    assert first.value == float(losses["rank5"][JUMP]) and first.ts == T0 + JUMP
    assert first.lo is not None and first.hi is not None and first.median is not None
    assert first.lo < first.median < first.hi < first.value
    doc = first.document()
    assert doc["kind"] == "outlier" and doc["band"] == [first.lo, first.hi] and doc["value"] == first.value
    # With the NaN anomalies, by step.
    assert rows(await outliers.every_anomaly(store, "jump")) == [
        ("rank5", "loss", JUMP, "outlier"),
        ("rank2", "loss", 1500, "nan"),
    ]


async def test_how_far_band_leavers_are_known_is_the_slowest_label_s_bucket_before_its_open_one(store):
    """A departure is named once the label's next bucket has closed: up to the step before the
    slowest label's last closed bucket, every band leaver is known; past it, a NaN found first
    may yet be preceded by one."""
    losses = noisy(5, steps=1000)
    losses["rank3"] = losses["rank3"][:700]  # behind: its open bucket is 5 (steps 640-767)
    await write(store, "reach", {"loss": losses})
    assert (await outliers.band_leavers(store, "reach"))[1] == 4 * 128 - 1
    await write(store, "few", {"loss": noisy(3, steps=1000)})
    assert (await outliers.band_leavers(store, "few"))[1] is None  # no band below four labels


async def test_a_jump_in_a_bucket_s_last_steps_is_named_at_its_step(store):
    losses = noisy(8, seed=4)
    losses["rank1"][765:] *= 5  # 3 steps of its bucket (640-767): that bucket's mean is inside
    await write(store, "late", {"loss": losses})
    assert rows(await outliers.outliers(store, "late")) == [("rank1", "loss", 765, "outlier")]


async def test_a_slow_drift_is_named_at_the_first_bucket_out_of_the_band(store):
    losses = noisy(16, seed=2)
    losses["rank9"] *= 1 + np.arange(STEPS) / 800  # ends at 3.5x
    await write(store, "drift", {"loss": losses})
    found = await outliers.outliers(store, "drift")
    assert rows(found)[0][:2] == ("rank9", "loss") and len(found) == 1
    out = first_bucket_out(losses, "rank9")
    step = found[0].step
    assert step is not None and out * 128 <= step < (out + 1) * 128, (step, out)


def first_bucket_out(values: Values, label: str) -> int:
    for b in range(STEPS // 128):
        band = band_of(float(v[b * 128 : (b + 1) * 128].mean()) for v in values.values())
        if band is not None and band.side(float(values[label][b * 128 : (b + 1) * 128].mean())):
            return b
    raise AssertionError("never out")


async def test_the_api_and_the_cli_show_it_beside_the_nan(store):
    losses = noisy(8)
    losses["rank5"][JUMP:] *= 5
    await write(store, "shown", {"loss": losses}, nan_at=("rank2", 1500))
    expected = (await outliers.outliers(store, "shown"))[0].document()
    assert expected["label"] == "rank5" and expected["step"] == JUMP
    async with TestClient(TestServer(create_app(store.url))) as client:
        doc = await get_json(client, "/api/runs/shown/anomalies")
    assert doc["anomalies"][0] == expected and doc["anomalies"][1]["kind"] == "nan"
    shown = json.loads(run_cli("show", "shown", "--store", store.url, "--json").stdout)
    assert shown["anomalies"] == doc["anomalies"]
    text = run_cli("show", "shown", "--store", store.url).stdout
    assert f"outlier  rank5 loss left the cross-rank band first, at step {JUMP} (" in text


async def test_three_labels_make_no_band(store):
    losses = noisy(3)
    losses["rank0"][JUMP:] *= 5
    await write(store, "three", {"loss": losses})
    assert await outliers.outliers(store, "three") == []


@pytest.mark.parametrize(("pass_", "at"), [("coarse", 7001), ("whole", 7001), ("coarse", 7160)])
async def test_a_long_run_is_read_coarse_first_and_names_the_same_step(store, pass_, at):
    # 10,000 steps: coarse rows of 512 steps; a jump at 7,001, inside a coarse bucket (6,656 to
    # 7,167), or at 7,160, whose coarse bucket's mean stays inside: the next one is found out.
    steps = 10_000
    losses = noisy(6, steps, seed=5)
    losses["rank4"][at:] *= 5
    await write(store, "long", {"loss": losses})
    reads: list[tuple[int, int, int]] = []
    spy = _counting(store, reads)
    fine_rows = 0 if pass_ == "coarse" else 10**6
    found = await outliers.first_outliers(spy, "long", "loss", fine_rows=fine_rows)
    assert rows(found) == [("rank4", "loss", at, "outlier")]
    fine = [r for r in reads if r[0] == 128]
    if pass_ == "coarse":
        assert any(r[0] == 512 for r in reads)
        # Only the 128-step rows around the jump are read, not the run's 79 buckets.
        assert sum(hi - lo + 1 for _, lo, hi in fine) <= 3 * 4 + 1
    else:
        assert fine == [(128, 0, (steps - 1) >> 7)]


def _counting(store, reads: list[tuple[int, int, int]]) -> object:
    """The store, its label_buckets reads recorded as (width, lo, hi)."""

    class Counting:
        def __getattr__(self, name: str) -> Callable:
            return getattr(store, name)

        async def label_buckets(self, run_id, key, axis, width, lo, hi, labels, table="metrics"):
            reads.append((width, lo, hi))
            return await store.label_buckets(run_id, key, axis, width, lo, hi, labels, table)

    return Counting()
