"""The fault bench of issue #24: hangs injected into real gloo jobs on CPU, a live `runbus ingest`
judging them, and the time until the health verdict names the right rank; healthy runs
(a checkpoint pause and an evaluation on every rank) for false alarms.

Each trial is one job of WORLD rank processes (a tiny model, an all_reduce per step, STEP_S
seconds a step) logging into a private Redis, ingested by one `runbus ingest` worker with its
defaults (a 10 s stall floor; the producer's 10 s heartbeats) into a throwaway SQLite store. At
FAULT_STEP one rank (a hang) or every rank (a pause) does what its kind says and writes the time
it did so; the bench reads the run's health from the store every POLL_S seconds until a verdict
names a culprit or the wait is over.

DEVICE=cuda in the environment puts each rank's model and all_reduces on the GPU (gloo over CUDA
tensors: NCCL takes one GPU per rank), for bench/gpu.py.

Hang kinds: `loader` (blocked in Python: a data loader's sleep), `cblock` (blocked in a C call
that lets go of the GIL: `select` on a pipe nobody writes), `gil` (stuck in a C call holding the
GIL: a regular expression backtracking, so even the rank's heartbeat thread stops), `sigstop`,
`sigkill`, `skip` (the rank skips the step's all_reduce and waits in a barrier). Healthy kinds:
`checkpoint` (every rank pauses PAUSE_S in a checkpoint save), `eval` (every rank evaluates for
about PAUSE_S without stepping, then all_reduces the result). A hang is right when the verdict
names the faulty rank and no other; a healthy run raises a false alarm when any verdict while it
runs is stalled, dead or silent, or names a culprit.

    python bench/faults.py --quick                         # a few faults at 4 and 8 ranks
    python bench/faults.py [--worlds 8,32] [--repeats 4]   # every kind, each world, N times
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import textwrap
import time
from typing import Any

from common import TRACKERS_NAMING_A_RANK, emit, live_store, median, percentile

from tests.rank_processes import start_ranks, stop_ranks

HANGS = ("loader", "cblock", "gil", "sigstop", "sigkill", "skip")
HEALTHY = ("checkpoint", "eval")
ALARMS = frozenset({"stalled", "dead", "silent"})
# What names a hang's culprit: an alarm, or the post-mortem of a run that failed after it (a
# SIGKILLed rank under gloo, whose peers fail at once: storage/postmortem.py).
NAMING = ALARMS | {"crashed"}
TARGET_S = 30.0  # the target: the culprit named within 30 s of the hang
POLL_S = 0.2
FAULT_STEP = 40  # after the first heartbeats (0.3 s steps: ~12 s in); each trial adds 0-29 steps
PAUSE_S = 15.0  # a checkpoint or evaluation longer than the 10 s stall floor
ANCHORS = {
    "nccl_watchdog_default_s": 600,
    "holmes_localisation_s": 30.3,
    "trackers_naming_a_rank": TRACKERS_NAMING_A_RANK,
}

RANK = textwrap.dedent(
    """
    import os, re, select, signal, time
    import torch, torch.distributed as dist
    import runbus

    kind, culprit, fault_step = os.environ["KIND"], int(os.environ["CULPRIT"]), int(os.environ["FAULT_STEP"])
    step_s, pause, steps = float(os.environ["STEP_S"]), float(os.environ["PAUSE_S"]), int(os.environ["STEPS"])
    device = torch.device(os.environ.get("DEVICE", "cpu"))
    dist.init_process_group("gloo")
    run = runbus.init(system_interval=None, hardware=False, git=False, console="all")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to(device)

    def injected():
        with open(os.environ["FAULT_FILE"], "w") as out:
            out.write(repr(time.time()))

    def load_batch(step):
        if kind == "loader" and rank == culprit and step == fault_step:
            print(f"rank {rank} reading shard {step}", flush=True)
            injected()
            time.sleep(3600)
        return torch.randn(8, 16, device=device)

    def wait_for_peer(step):
        # A C call that lets go of the GIL and never returns: nobody writes this pipe.
        quiet, _ = os.pipe()
        print(f"rank {rank} waiting for its peer at step {step}", flush=True)
        injected()
        select.select([quiet], [], [])

    def parse_record(step):
        # A C call that holds the GIL for ever: the regular expression backtracks 2**40 times.
        print(f"rank {rank} parsing record {step}", flush=True)
        injected()
        re.match(r"(a+)+$", "a" * 40 + "!")

    def save_checkpoint(step):
        print(f"rank {rank} saving checkpoint {step}", flush=True)
        torch.save(model.state_dict(), os.devnull)
        time.sleep(pause)

    def evaluate(step):
        print(f"rank {rank} evaluating at step {step}", flush=True)
        total, deadline = torch.zeros(1, device=device), time.monotonic() + pause
        with torch.no_grad():
            while time.monotonic() < deadline:
                total += model(torch.randn(8, 16, device=device)).sum()
                time.sleep(0.05)
        dist.all_reduce(total)

    for step in range(steps):
        batch = load_batch(step)
        loss = model(batch).pow(2).mean()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        model.zero_grad()
        if step == fault_step:
            if rank == culprit:
                if kind == "cblock":
                    wait_for_peer(step)
                if kind == "gil":
                    parse_record(step)
                if kind in ("sigstop", "sigkill"):
                    injected()
                    os.kill(os.getpid(), signal.SIGSTOP if kind == "sigstop" else signal.SIGKILL)
                if kind == "skip":
                    injected()
                    dist.barrier()
            if kind == "checkpoint":
                save_checkpoint(step)
            if kind == "eval":
                evaluate(step)
        dist.all_reduce(grads)
        run.log({"loss": float(loss)}, step=step)
        time.sleep(step_s)
    run.finish()
    """
)


def start_job(
    redis_url: str, run_id: str, kind: str, world: int, culprit: int, index: int, args
) -> list[subprocess.Popen[bytes]]:
    """The job's rank processes, started. The fault's step moves from trial to trial, so that it
    falls at every point of the heartbeat's 10 s cycle."""
    fault_step = FAULT_STEP + (index * 7 + world) % 30
    env = {
        "RUNBUS_REDIS_URL": redis_url,
        "RUNBUS_RUN_ID": run_id,
        "RUNBUS_QUIET": "1",
        "KIND": kind,
        "CULPRIT": str(culprit),
        "FAULT_STEP": str(fault_step),
        "STEP_S": str(args.step_s),
        "PAUSE_S": str(PAUSE_S),
        # A hang never gets this far; a healthy run ends some steps after its pause.
        "STEPS": str(fault_step + 10 if kind in HEALTHY else 1_000_000),
        "FAULT_FILE": os.path.join(args.tmp, run_id + ".fault"),
        "OMP_NUM_THREADS": "1",
    }
    return start_ranks(RANK, world, env)


def injected_at(path: str) -> float | None:
    try:
        with open(path) as found:
            return float(found.read())
    except (OSError, ValueError):  # not written yet, or being written
        return None


def named(health: dict[str, Any] | None) -> list[str]:
    """The labels a verdict names as culprits, when it is an alarm or a post-mortem."""
    if not health or health.get("state") not in NAMING:
        return []
    return [c["label"] for c in health.get("culprits") or []]


async def hang_trial(store, redis_url: str, kind: str, world: int, index: int, args) -> dict[str, Any]:
    """One hang: how long after its injection a verdict named a culprit, and whether rightly."""
    run_id = f"{kind}-{world}-{index}"
    culprit = (index * 5 + HANGS.index(kind) * 3 + 1) % world  # not always the same rank
    fault_file = os.path.join(args.tmp, run_id + ".fault")
    ranks = start_job(redis_url, run_id, kind, world, culprit, index, args)
    result: dict[str, Any] = {"kind": kind, "world": world, "culprit": f"rank{culprit}"}
    try:
        began = time.monotonic()
        while (at := injected_at(fault_file)) is None:
            if time.monotonic() - began > args.start_timeout:
                return {**result, "error": "the fault was never injected (start-up too slow?)"}
            await asyncio.sleep(POLL_S)
        health = None
        while time.time() - at < args.wait:
            health = await store.health(run_id)
            if named(health):
                break
            await asyncio.sleep(POLL_S)
        names = named(health)
        result.update(
            seconds=round(time.time() - at, 2) if names else None,
            named=names,
            right=names == [f"rank{culprit}"],
            state=(health or {}).get("state"),
            reason=[c["reason"] for c in (health or {}).get("culprits") or []],
            note=(health or {}).get("note"),
        )
        return result
    finally:
        stop_ranks(ranks, 60)


async def healthy_trial(store, redis_url: str, kind: str, world: int, index: int, args) -> dict[str, Any]:
    """One healthy run to its end: every verdict seen while it ran that was an alarm."""
    run_id = f"{kind}-{world}-{index}"
    ranks = start_job(redis_url, run_id, kind, world, -1, index, args)
    alarms: list[dict[str, Any]] = []
    notes: set[str] = set()
    try:
        deadline = time.monotonic() + args.start_timeout + PAUSE_S + 60
        while any(r.poll() is None for r in ranks) and time.monotonic() < deadline:
            health = await store.health(run_id)
            if health and (health["state"] in ALARMS or health.get("culprits")):
                alarms.append({"state": health["state"], "named": named(health), "note": health.get("note")})
            if health and health.get("note"):
                notes.add(health["note"])
            await asyncio.sleep(POLL_S)
        codes = [r.poll() for r in ranks]
        # Distinct alarms (a verdict is read many times while it holds).
        distinct = [dict(t) for t in {tuple(sorted((k, str(v)) for k, v in a.items())) for a in alarms}]
        return {
            "kind": kind,
            "world": world,
            "false_alarms": distinct,
            "exit_codes_ok": codes == [0] * world,
            "notes": sorted(notes),
        }
    finally:
        stop_ranks(ranks, 60)


def summary(hangs: list[dict[str, Any]], healthy: list[dict[str, Any]]) -> dict[str, Any]:
    """Success within the target, times to the culprit, false alarms; by kind and world too."""
    timed = [h["seconds"] for h in hangs if h.get("right")]
    within = [h for h in hangs if h.get("right") and h["seconds"] <= TARGET_S]
    by: dict[str, dict[str, Any]] = {}
    for h in hangs:
        group = by.setdefault(f"{h['kind']}@{h['world']}", {"injected": 0, "within_30s": 0, "seconds": []})
        group["injected"] += 1
        if h.get("right"):
            group["seconds"].append(h["seconds"])
            group["within_30s"] += h["seconds"] <= TARGET_S
    return {
        "hangs_injected": len(hangs),
        "named_right_within_30s": len(within),
        "success_rate": round(len(within) / len(hangs), 3) if hangs else None,
        "median_s": round(median(timed), 2) if timed else None,
        "p95_s": round(percentile(timed, 0.95), 2) if timed else None,
        "healthy_runs": len(healthy),
        "false_alarms": sum(len(h["false_alarms"]) > 0 for h in healthy),
        "by_kind": by,
    }


def plan(args) -> list[tuple[str, int, int]]:
    """(kind, world, index) of every trial, hangs and healthy runs interleaved by world."""
    trials = []
    for world in args.worlds:
        for index in range(args.repeats):
            trials += [(kind, world, index) for kind in args.kinds]
            trials += [(kind, world, index) for kind in args.healthy]
    return trials


async def bench(args) -> dict[str, Any]:
    hangs: list[dict[str, Any]] = []
    healthy: list[dict[str, Any]] = []
    async with live_store("runbus-faults-") as (tmp, redis_url, store):
        args.tmp = tmp
        for kind, world, index in plan(args):
            trial = hang_trial if kind in HANGS else healthy_trial
            result = await trial(store, redis_url, kind, world, index, args)
            (hangs if kind in HANGS else healthy).append(result)
            print(result, file=sys.stderr, flush=True)
    return {"summary": summary(hangs, healthy), "hangs": hangs, "healthy": healthy}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="every kind once at 4 and 8 ranks")
    parser.add_argument("--worlds", default="8,32", help="rank counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=4, help="trials of each kind at each world")
    parser.add_argument("--kinds", default=",".join(HANGS), help="hang kinds, comma-separated")
    parser.add_argument("--healthy", default=",".join(HEALTHY), help="healthy kinds, comma-separated")
    parser.add_argument("--step-s", type=float, default=0.3, help="seconds each step sleeps")
    parser.add_argument("--wait", type=float, default=45.0, help="seconds to wait for a culprit")
    parser.add_argument(
        "--start-timeout", type=float, default=240.0, help="seconds for a job to reach its fault"
    )
    args = parser.parse_args()
    if args.quick:
        args.worlds, args.repeats = "4,8", 1
    args.worlds = [int(w) for w in args.worlds.split(",")]
    args.kinds = [k for k in args.kinds.split(",") if k]
    args.healthy = [k for k in args.healthy.split(",") if k]
    started = time.monotonic()
    results = asyncio.run(bench(args))
    emit(
        "faults",
        {
            "worlds": args.worlds,
            "repeats": args.repeats,
            "step_s": args.step_s,
            "anchors": ANCHORS,
            "wall_s": round(time.monotonic() - started, 1),
            **results,
        },
    )


if __name__ == "__main__":
    main()
