"""Producer cost per call: runbus `Run.log` beside `wandb.log` (offline) and `mlflow.log_metrics`.

For each tracker: per-call time (median and p99 over batches of 1,000 calls), the process's total
CPU per event including background threads, and the time `finish()` (or its equivalent) takes to
flush. wandb and mlflow run only when installed (`pip install -e '.[bench]'`).

The burst case: several processes each call `log()` in a tight loop, faster than the shipper
can encode and ship, with Redis healthy; then `runbus ingest --burst` and `runbus show`. It
reports what was dropped (must be 0: a full outbox makes `log()` wait while Redis answers),
whether every label finished, each `finish()` result, the longest single `log()` call (the
back-pressure wait), how many calls waited, and each process's peak RSS.

    python bench/producer.py [--calls 200000]
    python bench/producer.py --burst [--processes 4] [--calls 200000] [--max-buffer-events 50000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable

from common import ROOT, emit, median, percentile, private_redis

BATCH = 1000
WARM_UP = 10_000


def measure(log: Callable[[int], None], calls: int, finish: Callable[[], None]) -> dict:
    """Time `log(step)` in batches of BATCH calls, then `finish()`; CPU covers every thread."""
    for step in range(min(calls // 10, WARM_UP)):
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
    """The normal case: the outbox has room for every call, so no call meets back-pressure (a
    tight loop of 200k calls outruns the shipper: with the default bound, most batches would
    time the wait for the shipper rather than log(); that is the burst case)."""
    import runbus

    run = runbus.init(
        run_id=f"bench-{os.getpid()}",
        label="rank0",
        redis_url=redis_url,
        system_interval=None,
        hardware=False,
        console="off",
        max_buffer_events=calls + WARM_UP,
    )
    result = measure(lambda step: run.log({"loss": 0.5, "lr": 1e-4}, step=step), calls, run.finish)
    return {**result, "calls_that_waited": run._outbox.waits, "dropped": run.dropped}


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


# One process of the burst: every call timed alone (for the longest), peak RSS from the kernel
# (VmHWM: getrusage's ru_maxrss would include the parent's RSS at fork).
BURST_CHILD = textwrap.dedent(
    """
    import json, os, sys, time, runbus
    rank, calls, max_events = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    run = runbus.init(
        run_id=os.environ["BURST_RUN"], label=f"rank{rank}", primary=rank == 0,
        redis_url=os.environ["BURST_REDIS"], system_interval=None, hardware=False, console="off",
        max_buffer_events=max_events,
    )
    def rss_mb(field="VmRSS"):
        line = next(line for line in open("/proc/self/status") if line.startswith(field + ":"))
        return int(line.split()[1]) / 1024
    print("ready", flush=True)
    sys.stdin.readline()
    rss_before = rss_mb()
    log, clock, longest = run.log, time.perf_counter_ns, 0
    started = time.perf_counter()
    for step in range(calls):
        t0 = clock()
        log({"loss": 0.5, "acc": 0.25}, step=step)
        took = clock() - t0
        if took > longest:
            longest = took
    log_s = time.perf_counter() - started
    t0 = time.perf_counter()
    finished = run.finish()
    print(json.dumps({
        "label": run.label, "finish": finished, "dropped": run.dropped, "waits": run._outbox.waits,
        "longest_log_ms": longest / 1e6, "log_s": log_s, "finish_s": time.perf_counter() - t0,
        "rss_before_mb": rss_before, "peak_rss_mb": rss_mb("VmHWM"),
    }), flush=True)
    """
)


def bench_burst(redis_url: str, processes: int, calls: int, max_events: int) -> dict:
    """`processes` tight loops of `calls` log() each, started together; then ingest and show."""
    run_id = f"burst-{os.getpid()}"
    env = {**os.environ, "BURST_RUN": run_id, "BURST_REDIS": redis_url, "PYTHONPATH": ROOT}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", BURST_CHILD, str(rank), str(calls), str(max_events)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(processes)
    ]
    for child in children:
        if child.stdout.readline().strip() != "ready":
            raise SystemExit("a burst process did not start")
    started = time.perf_counter()
    for child in children:
        child.stdin.write("go\n")
        child.stdin.flush()
    results = [json.loads(child.communicate(timeout=600)[0]) for child in children]
    wall = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as tmp:
        store = f"sqlite:///{tmp}/burst.db"
        cli = [sys.executable, "-m", "runbus", "--store", store]
        ingest = [*cli, "--log-level", "WARNING", "ingest", "--redis", redis_url, "--burst"]
        subprocess.run(ingest, check=True)
        show = subprocess.run([*cli, "show", run_id, "--json"], check=True, capture_output=True)
        shown = json.loads(show.stdout)
    labels = shown["labels"]
    return {
        "processes": processes,
        "calls_per_process": calls,
        "max_buffer_events": max_events,
        "wall_s": round(wall, 2),
        "dropped": sum(r["dropped"] for r in results),
        "missing_in_store": sum(label["missing"] for label in labels),
        "labels_finished": sum(label["state"] == "finished" for label in labels),
        "metric_events_stored": shown["counts"].get("metric", 0),
        "finish_results": [r["finish"] for r in results],
        "longest_log_ms": round(max(r["longest_log_ms"] for r in results), 2),
        "per_process": [
            {
                "longest_log_ms": round(r["longest_log_ms"], 2),
                "calls_that_waited": r["waits"],
                "log_s": round(r["log_s"], 2),
                "finish_s": round(r["finish_s"], 2),
                "rss_before_mb": round(r["rss_before_mb"], 1),
                "peak_rss_mb": round(r["peak_rss_mb"], 1),
            }
            for r in results
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200_000, help="runbus calls (others: see --other-calls)")
    parser.add_argument("--other-calls", type=int, default=20_000, help="wandb calls (mlflow sync: a tenth)")
    parser.add_argument("--burst", action="store_true", help="the burst case only (see above)")
    parser.add_argument("--processes", type=int, default=4, help="burst: processes logging at once")
    parser.add_argument("--max-buffer-events", type=int, default=50_000, help="burst: the outbox's bound")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    if args.burst:
        with private_redis() as redis_url:
            normal = bench_runbus(redis_url, args.calls)
            burst = bench_burst(redis_url, args.processes, args.calls, args.max_buffer_events)
        emit("producer_burst", {"runbus_normal": normal, "burst": burst})
        return
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
