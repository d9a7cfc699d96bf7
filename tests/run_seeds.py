"""Many runs written straight through a store's write API (no Redis): the runs list's tests, of
the store, the CLI, runbus.Api and the page, find and page through them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from runbus.storage import Store, open_store
from runbus.wire import Event

T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z
EVERY = 3600.0  # a run starts each hour: run i starts at T0 + i * EVERY
STATES = ("finished", "failed", "running")  # run i's state: STATES[i % 3]
MODELS = ("resnet", "vit", "llama")  # its config's model: MODELS[i % 3]


def run_id(i: int) -> str:
    return f"run-{i:05d}"


def name_of(i: int) -> str:
    return f"sweep {i // 100} trial {i % 100}"


def tags_of(i: int) -> list[str]:
    return ["nightly" if i % 2 else "manual", f"batch-{i % 7}"]


def run_events(i: int, labels: int = 1) -> Iterator[Event]:
    """Run i's events: its labels' starts (rank0 the primary, with its config), its name and
    tags, and its end as STATES says."""
    run, ts = run_id(i), T0 + i * EVERY
    config = {"model": MODELS[i % 3], "lr": [0.1, 0.01, 0.001][i % 3], "seed": i, "amp": i % 2 == 0}
    for rank in range(labels):
        label = f"rank{rank}"
        yield Event(
            run, label, "start", 1, 1, ts, {"primary": rank == 0, "config": config if rank == 0 else {}}
        )
        yield Event(
            run, label, "meta", 1, 2, ts + 1, {"name": name_of(i), "tags": tags_of(i)} if rank == 0 else {}
        )
        state = STATES[i % 3]
        if state != "running":
            yield Event(run, label, "finish", 1, 3, ts + 60, {"exit_code": 0 if state == "finished" else 1})


def special_events(run: str, ts: float, name: str, tags: list[str], config: dict) -> list[Event]:
    """A finished run of one label with this name, tags and config."""
    return [
        Event(run, "rank0", "start", 1, 1, ts, {"primary": True, "config": config}),
        Event(run, "rank0", "meta", 1, 2, ts + 1, {"name": name, "tags": tags}),
        Event(run, "rank0", "finish", 1, 3, ts + 60, {"exit_code": 0}),
    ]


async def seed_runs(store: Store, count: int, labels: int = 1, batch: int = 3000) -> None:
    """Runs 0 .. count-1 (run_events), written in batches of about `batch` events."""
    events: list[Event] = []
    for i in range(count):
        events += run_events(i, labels)
        if len(events) >= batch:
            await store.write(events)
            events = []
    if events:
        await store.write(events)


async def seed_url(url: str, count: int, extra: Sequence[Event] = (), labels: int = 1) -> None:
    """seed_runs into the store at `url` (created if need be), and `extra` events."""
    store = open_store(url)
    await store.connect()
    try:
        await seed_runs(store, count, labels)
        if extra:
            await store.write(list(extra))
    finally:
        await store.close()


def seed_url_now(url: str, count: int, extra: Sequence[Event] = (), labels: int = 1) -> None:
    """seed_url on an event loop of its own thread: from any caller, Playwright's loop running
    in this thread or not."""
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, seed_url(url, count, extra, labels)).result()
