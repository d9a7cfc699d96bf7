"""A job's ranks as processes started by hand, as torchrun would start them (RANK, LOCAL_RANK,
WORLD_SIZE, a gloo rendezvous on 127.0.0.1), and tests/ddp_watch_job.py under torchrun itself:
for the tests, bench/faults.py, bench/stragglers.py and bench/anomalies.py."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from runbus.ingester.localredis import free_port

WATCH_JOB = Path(__file__).resolve().parent / "ddp_watch_job.py"


def start_ranks(
    script: str, world: int, env: Mapping[str, str], *, output: int | None = subprocess.DEVNULL
) -> list[subprocess.Popen[bytes]]:
    """`python -c SCRIPT` once for each of a job's `world` ranks, in this process's environment
    with `env` over it; their stdout and stderr go to `output` (None: this process's)."""
    job = {
        **os.environ,
        **env,
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    return [
        subprocess.Popen(
            [sys.executable, "-c", script],
            env={**job, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=output,
            stderr=output,
        )
        for rank in range(world)
    ]


def stop_ranks(ranks: list[subprocess.Popen[bytes]], timeout: float = 30) -> None:
    """Kill the ranks still running (a stopped one too) and reap them all."""
    for rank in ranks:
        if rank.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                rank.send_signal(signal.SIGCONT)
                rank.kill()
    for rank in ranks:
        rank.wait(timeout)


@contextlib.contextmanager
def ranks_running(script: str, world: int, env: Mapping[str, str]) -> Iterator[list[subprocess.Popen[bytes]]]:
    """start_ranks, the ranks stopped (stop_ranks) when the block ends."""
    ranks = start_ranks(script, world, env)
    try:
        yield ranks
    finally:
        stop_ranks(ranks)


def watch_job(redis_url: str, run_id: str, *args: str, world: int = 3) -> list[str]:
    """The python argv of tests/ddp_watch_job.py's `world` ranks under torchrun, logging run
    `run_id` into `redis_url`; `args` are the job's own."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    return [*launcher, str(WATCH_JOB), "--redis-url", redis_url, "--run-id", run_id, *args]
