"""Redis not taking events under a training loop: log()'s longest wait and what is dropped.

Four cases, each with its own throwaway redis-server and one producer process logging
`{"loss", "acc"}` per call, in a tight loop or at `--rate` events/s:

- `pause8`, `pause30`: `CLIENT PAUSE 8000` / `30000` (all clients, as a failover does);
- `kill3`, `kill1`: redis-server SIGKILLed and restarted 3 s (1 s) later on the same port (AOF,
  fsync always);
- `maxmemory`: a 16 MB Redis with `noeviction` and `runbus ingest` (default `--retain 3600`)
  running: the stream fills Redis up to maxmemory, and Redis answers `-OOM`.

The loop runs 2 s before the fault and 3 s after it (`maxmemory`: 20 s in all); then finish().
The producer has its default buffers (50,000 queued events, 128 MiB encoded; `--spool` adds a
spool directory). Reported per case: calls, the longest log() and how many took over 100 ms,
dropped events, finish()'s result and time, the entries in Redis afterwards; for `maxmemory`,
whether the producer met -OOM and what the ingester trimmed.

    python bench/outage.py [--cases pause8,pause30,kill3,kill1,maxmemory] [--rates 0,20000] [--spool]

A rate of 0 is a tight loop: it logs faster than 128 MiB can hold for long, so a long outage
fills the buffer and drops (counted) by design; a real training loop logs far less.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator

import redis
from common import ROOT, emit

from runbus import wire
from runbus.ingester.localredis import LocalRedis

LOOP = textwrap.dedent(
    """
    import json, os, sys, time, runbus
    stop_file, rate, options = sys.argv[1], float(sys.argv[2]), json.loads(sys.argv[3])
    run = runbus.init(system_interval=None, hardware=False, console="off", quiet=True, **options)
    print("ready", flush=True)
    clock, sleep = time.perf_counter, time.sleep
    longest, slow, step, began = 0.0, 0, 0, clock()
    while not os.path.exists(stop_file):
        for _ in range(100):
            t0 = clock()
            run.log({"loss": 0.5, "acc": step}, step=step)
            took = clock() - t0
            longest = max(longest, took)
            slow += took > 0.1
            step += 1
        if rate:
            ahead = began + step / rate - clock()
            if ahead > 0:
                sleep(ahead)
    t0 = clock()
    finished = run.finish(timeout=60)
    print(json.dumps({
        "calls": step, "longest_log_ms": round(longest * 1000, 1), "calls_over_100ms": slow,
        "dropped": run.dropped, "finished": finished, "finish_s": round(clock() - t0, 1),
    }), flush=True)
    """
)
BEFORE, AFTER, MAXMEMORY_RUN = 2.0, 3.0, 20.0


@contextlib.contextmanager
def server(case: str) -> Iterator[LocalRedis]:
    if case.startswith("kill"):
        options: dict = {"appendonly": True, "appendfsync": "always"}
    elif case == "maxmemory":
        options = {"extra_args": ("--maxmemory", "16mb", "--maxmemory-policy", "noeviction")}
    else:
        options = {}
    with LocalRedis(**options) as redis_server:
        yield redis_server


@contextlib.contextmanager
def ingester(redis_url: str, store: str, log_path: str) -> Iterator[None]:
    """`runbus ingest` (default --retain) until the block ends; its log lines go to `log_path`."""
    cli = [sys.executable, "-m", "runbus", "--store", store, "--log-level", "INFO"]
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([*cli, "ingest", "--redis", redis_url], stderr=log_file, env=_env())
        try:
            yield
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": ROOT}


def fault(case: str, redis_server: LocalRedis) -> None:
    """Inflict the case's fault and return once Redis is back (or the run is over)."""
    if case.startswith("pause"):
        seconds = int(case.removeprefix("pause"))
        with redis.Redis.from_url(redis_server.url) as client:
            client.execute_command("CLIENT", "PAUSE", seconds * 1000, "ALL")
        time.sleep(seconds)
    elif case.startswith("kill"):
        redis_server.kill()
        time.sleep(int(case.removeprefix("kill")))
        redis_server.start()
    else:
        time.sleep(MAXMEMORY_RUN - BEFORE - AFTER)


def run_case(case: str, rate: float, spool: bool) -> dict:
    run_id = f"outage-{case}"
    with tempfile.TemporaryDirectory() as tmp, server(case) as redis_server:
        options = {"max_backoff": 0.5, **({"spool_dir": f"{tmp}/spool"} if spool else {})}
        stop_file = f"{tmp}/stop"
        env = {**_env(), "RUNBUS_REDIS_URL": redis_server.url, "RUNBUS_RUN_ID": run_id}
        with contextlib.ExitStack() as stack:
            ingester_log = f"{tmp}/ingester.log" if case == "maxmemory" else None
            if ingester_log is not None:
                stack.enter_context(ingester(redis_server.url, f"sqlite:///{tmp}/store.db", ingester_log))
            producer = subprocess.Popen(
                [sys.executable, "-c", LOOP, stop_file, str(rate), json.dumps(options)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            assert producer.stdout is not None and producer.stdout.readline() == "ready\n"
            time.sleep(BEFORE)
            fault(case, redis_server)
            time.sleep(AFTER)
            open(stop_file, "w").close()
            out, err = producer.communicate(timeout=900)
            result = {"case": case, "rate": rate or "tight", "spool": spool, **json.loads(out)}
            with redis.Redis.from_url(redis_server.url) as client:
                result["entries_in_redis"] = client.xlen(wire.stream_key(run_id, "rank0"))
        if ingester_log is not None:
            result["producer_met_oom"] = "maxmemory" in err or "out of memory" in err
            with open(ingester_log) as log_file:
                trimmed = re.findall(r", (\d+) trimmed,", log_file.read())  # its shutdown line
            result["ingester_trimmed"] = int(trimmed[-1]) if trimmed else None
        return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", default="pause8,pause30,kill3,kill1,maxmemory")
    parser.add_argument("--rates", default="0,20000", help="events/s per case; 0: a tight loop")
    parser.add_argument("--spool", action="store_true", help="give the producer a spool directory")
    args = parser.parse_args()
    results = []
    for rate in (float(r) for r in args.rates.split(",")):
        for case in args.cases.split(","):
            result = run_case(case, rate, args.spool)
            print(json.dumps(result), file=sys.stderr, flush=True)
            results.append(result)
    emit("outage", {"results": results})


if __name__ == "__main__":
    main()
