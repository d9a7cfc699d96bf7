"""The first NaN or inf of each label's key (storage/anomalies.py), on SQLite and PostgreSQL, and
where it shows: `runbus show` (a line, and "anomalies" in --json) and GET /api/runs/RUN/anomalies.

Twenty labels log a loss at every step of 3,000 (a key wide enough for the coarse and fine
rollups to matter), in shuffled batches. rank7 goes NaN at step 1234; the others follow at 1240
(the all-reduce spreads it), but for rank3, whose loss goes inf at 1500, and rank19, which logs a
NaN without a step. The first anomaly must be rank7 at step 1234, exactly.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from runbus.dashboard.api import create_app
from runbus.storage import anomalies
from runbus.wire import Event
from tests.helpers import get_json, run_cli

T0 = 1_700_000_000.0
STEPS = 3000
LABELS = [f"rank{i}" for i in range(20)]
RUN = "nan-run"


def loss(label: str, step: int) -> float:
    if label == "rank7" and step >= 1234:
        return math.nan
    if label == "rank3":
        return math.inf if step == 1500 else 1.0 / (step + 1)
    if label != "rank19" and step >= 1240:
        return math.nan
    return 1.0 / (step + 1)


def events() -> list[Event]:
    out = []
    for label in LABELS:
        out.append(Event(RUN, label, "start", 1, 1, T0, {"primary": label == "rank0", "config": {}}, None))
        for step in range(STEPS):
            data: dict[str, Any] = {"loss": loss(label, step), "lr": 0.1}
            out.append(Event(RUN, label, "metric", 1, step + 2, T0 + step, data, step))
    # rank19's NaN without a step, after its steps.
    out.append(Event(RUN, "rank19", "metric", 1, STEPS + 2, T0 + STEPS + 5, {"loss": math.nan}, None))
    return out


async def write(store) -> None:
    batches = [chunk for label in LABELS for chunk in _chunks([e for e in events() if e.label == label])]
    batches.append([e for e in events() if e.label == "rank19" and e.step is None])
    random.Random(7).shuffle(batches)
    for batch in batches:
        await store.write(batch)


def _chunks(mine: list[Event]) -> list[list[Event]]:
    return [mine[i : i + 700] for i in range(0, len(mine), 700)]


EXPECTED_FIRST = ("rank7", "loss", 1234, "nan")


async def test_the_first_anomaly_is_the_injected_rank_and_step(store):
    await write(store)
    found = await anomalies.non_finite(store, RUN)
    rows = [(a.label, a.key, a.step, a.kind) for a in found]
    assert rows[0] == EXPECTED_FIRST
    followers = [f"rank{i}" for i in range(20) if i not in (3, 7, 19)]
    assert rows[1:18] == [(label, "loss", 1240, "nan") for label in followers]  # same step: by ts, label
    assert rows[18] == ("rank3", "loss", 1500, "inf")
    assert rows[19][:3] == ("rank19", "loss", None) and rows[19][3] == "nan"  # no step: last
    assert len(rows) == 20  # one per (label, key); lr never went bad
    limited = await anomalies.first_non_finite(store, RUN, "loss", limit=3)
    assert [(a.label, a.step) for a in anomalies.in_order(limited)] == [
        ("rank7", 1234),
        ("rank0", 1240),
        ("rank1", 1240),
    ]
    assert found[19].ts == T0 + STEPS + 5
    # One key asked for; a key never logged.
    assert [a.label for a in await anomalies.first_non_finite(store, RUN, "lr")] == []
    assert await anomalies.first_non_finite(store, RUN, "absent") == []


async def test_a_run_without_anomalies_has_none(store):
    await store.write([Event("fine", "rank0", "metric", 1, 1, T0, {"loss": 0.5}, 0)])
    assert await anomalies.non_finite(store, "fine") == []


async def test_the_api_and_the_cli_name_it(store):
    await write(store)
    async with TestClient(TestServer(create_app(store.url))) as client:
        doc = await get_json(client, f"/api/runs/{RUN[:5]}/anomalies")
        assert doc["run_id"] == RUN and len(doc["anomalies"]) == 20
        first = {"label": "rank7", "key": "loss", "step": 1234, "kind": "nan", "ts": T0 + 1234}
        assert doc["anomalies"][0] == first
        await get_json(client, "/api/runs/nope/anomalies", status=404)
    shown = json.loads(run_cli("show", RUN, "--store", store.url, "--json").stdout)
    assert shown["anomalies"][0] == doc["anomalies"][0] and shown["run_id"] == RUN
    text = run_cli("show", RUN, "--store", store.url).stdout
    assert "nan/inf  rank7 loss went NaN first, at step 1234 (20 label keys in all" in text


@pytest.mark.parametrize("bad", [math.inf, -math.inf])
async def test_inf_is_named_inf_and_the_open_bucket_is_searched(store, bad):
    # 20,000 steps: the coarse rows are 512 wide, and hold closed 128-step buckets only; rank1's
    # NaN is in its open (highest) bucket.
    steps = 20_000
    for label, at, value in (("rank0", 200, bad), ("rank1", steps - 1, math.nan)):
        await store.write(
            [
                Event("spike", label, "metric", 1, s + 1, T0 + s, {"g": value if s == at else 1.0}, s)
                for s in range(steps)
            ]
        )
    found = await anomalies.non_finite(store, "spike")
    assert [(a.label, a.step, a.kind) for a in found] == [("rank0", 200, "inf"), ("rank1", steps - 1, "nan")]
    # A view of steps: what lies outside is not named.
    assert await anomalies.first_non_finite(store, "spike", "g", 201, steps - 2) == []
    inside = await anomalies.first_non_finite(store, "spike", "g", 150, 250)
    assert [(a.label, a.step) for a in inside] == [("rank0", 200)]
    # A limit keeps the labels that went bad first.
    assert [a.label for a in await anomalies.first_non_finite(store, "spike", "g", limit=1)] == ["rank0"]
