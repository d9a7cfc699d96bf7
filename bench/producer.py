"""Producer cost per call: runbus `Run.log` beside `wandb.log` (offline) and `mlflow.log_metrics`.

For each tracker: per-call time (median and p99 over batches of 1,000 calls), the process's total
CPU per event including background threads, and the time `finish()` (or its equivalent) takes to
flush. wandb and mlflow run only when installed (`pip install -e '.[bench]'`).

    python bench/producer.py [--calls 200000]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Callable

from common import emit, median, percentile, private_redis

BATCH = 1000


def measure(log: Callable[[int], None], calls: int, finish: Callable[[], None]) -> dict:
    """Time `log(step)` in batches of BATCH calls, then `finish()`; CPU covers every thread."""
    for step in range(min(calls // 10, 10_000)):  # warm up
        log(step)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    per_call = []
    for batch in range(calls // BATCH):
        t0 = time.perf_counter_ns()
        for step in range(batch * BATCH, (batch + 1) * BATCH):
            log(step)
        per_call.append((time.perf_counter_ns() - t0) / BATCH / 1000)
    log_wall = time.perf_counter() - wall0
    t0 = time.perf_counter()
    finish()
    finish_s = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    return {
        "calls": calls,
        "log_us_median": round(median(per_call), 3),
        "log_us_p99": round(percentile(per_call, 0.99), 3),
        "cpu_us_per_event": round(cpu / calls * 1e6, 3),
        "calls_per_s": round(calls / log_wall),
        "finish_s": round(finish_s, 3),
    }


def bench_runbus(redis_url: str, calls: int) -> dict:
    import runbus

    run = runbus.init(
        run_id=f"bench-{os.getpid()}",
        label="rank0",
        redis_url=redis_url,
        system_interval=None,
        hardware=False,
        console="off",
    )
    return measure(lambda step: run.log({"loss": 0.5, "lr": 1e-4}, step=step), calls, run.finish)


def bench_wandb(calls: int) -> dict | None:
    try:
        import wandb
    except ImportError:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("WANDB_SILENT", "true")
        run = wandb.init(mode="offline", dir=tmp, project="runbus-bench")
        return measure(lambda step: run.log({"loss": 0.5, "lr": 1e-4}, step=step), calls, run.finish)


def bench_mlflow(calls: int, synchronous: bool) -> dict | None:
    try:
        import mlflow
    except ImportError:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        mlflow.set_tracking_uri(f"sqlite:///{tmp}/mlflow.db")
        with mlflow.start_run():

            def log(step: int) -> None:
                mlflow.log_metrics({"loss": 0.5, "lr": 1e-4}, step=step, synchronous=synchronous)

            def finish() -> None:
                with contextlib.suppress(AttributeError):
                    mlflow.flush_async_logging()

            result = measure(log, calls, finish)
        mlflow.end_run()
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200_000, help="runbus calls (others: see --other-calls)")
    parser.add_argument("--other-calls", type=int, default=20_000, help="wandb calls (mlflow sync: a tenth)")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    with private_redis() as redis_url:
        results = {"runbus": bench_runbus(redis_url, args.calls)}
    results["wandb_offline"] = bench_wandb(args.other_calls)
    results["mlflow_sync"] = bench_mlflow(max(BATCH, args.other_calls // 10), synchronous=True)
    results["mlflow_async"] = bench_mlflow(args.other_calls, synchronous=False)
    ours = results["runbus"]["log_us_median"]
    results["speedup_vs_wandb"] = (
        round(results["wandb_offline"]["log_us_median"] / ours, 1) if results["wandb_offline"] else None
    )
    emit("producer", results)


if __name__ == "__main__":
    main()
