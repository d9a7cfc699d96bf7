"""What a person reads back, on SQLite and PostgreSQL: labels in their natural order (rank2
before rank10) in `runbus show`, `metrics`, `logs`, runbus.Api and the dashboard's API.

Each store is written through the Store interface; the CLI runs as its own process.
"""

from __future__ import annotations

import json

import pytest

import runbus
from runbus.storage import Store
from runbus.storage.rules import natural_key
from runbus.wire import Event
from tests.helpers import OpenStore, run_cli

RUN = "natural-run"
T0 = 1_700_000_000.0
RANKS = 12
NATURAL = [f"rank{i}" for i in range(RANKS)]  # rank0, rank1, rank2, ..., rank10, rank11


def labelled_run(run: str = RUN, ranks: int = RANKS) -> list[Event]:
    """`ranks` labels, each a start, a metric at step 0 and a log line, all at one ts."""
    events = []
    for rank in range(ranks):
        label = f"rank{rank}"
        events += [
            Event(run, label, "start", 1, 1, T0, {"primary": rank == 0, "config": {}}, None),
            Event(run, label, "metric", 1, 2, T0 + 1, {"loss": float(rank)}, 0),
            Event(run, label, "log", 1, 3, T0 + 2, {"stream": "stdout", "text": "hi", "level": "INFO"}, None),
        ]
    return events


@pytest.fixture
async def store(open_stores: OpenStore) -> Store:
    return await open_stores()


def test_the_natural_key_orders_numbers_as_numbers():
    shuffled = ["rank10", "rank2", "node10.rank0", "rank1", "node2.rank11", "node2.rank3", "rank01", "a"]
    assert sorted(shuffled, key=natural_key) == [
        "a",
        "node2.rank3",
        "node2.rank11",
        "node10.rank0",
        "rank01",
        "rank1",
        "rank2",
        "rank10",
    ]


async def test_a_run_lists_its_labels_in_natural_order(store: Store):
    await store.write(labelled_run())
    run = await store.run(RUN)
    assert run is not None and [lab.label for lab in run.labels] == NATURAL


async def test_show_metrics_and_logs_list_labels_in_natural_order(store: Store, any_store_url: str):
    await store.write(labelled_run())
    show = run_cli("--store", any_store_url, "show", RUN).stdout
    table = show.split("LABEL", 1)[1].splitlines()[1:]
    assert [line.split()[0] for line in table if line.startswith("rank")] == NATURAL
    shown = json.loads(run_cli("--store", any_store_url, "show", RUN, "--json").stdout)
    assert [lab["label"] for lab in shown["labels"]] == NATURAL
    metrics = json.loads(run_cli("--store", any_store_url, "metrics", RUN, "--json").stdout)
    assert [point["label"] for point in metrics] == NATURAL
    listed = run_cli("--store", any_store_url, "metrics", RUN).stdout.splitlines()[1:]
    assert [line.split()[0] for line in listed] == NATURAL
    logs = run_cli("--store", any_store_url, "logs", RUN).stdout.splitlines()
    assert [line.split(" | ")[0].strip() for line in logs] == NATURAL


async def test_the_api_lists_labels_in_natural_order(store: Store, any_store_url: str):
    await store.write(labelled_run())
    with runbus.Api(any_store_url) as api:
        run = api.run(RUN)
        assert run.labels == NATURAL
        assert list(dict.fromkeys(run.history()["label"])) == NATURAL
        assert list(dict.fromkeys(run.history(labels=["rank10", "rank2", "rank1"])["label"])) == [
            "rank1",
            "rank2",
            "rank10",
        ]
