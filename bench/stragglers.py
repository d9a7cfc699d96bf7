"""The straggler bench of issue #24: a rank 20% slower in compute, in real DDP jobs on CPU, named by a
live `runbus ingest`; how soon, how often rightly, and the time lost to it against the truth.

Each trial is tests/ddp_watch_job.py under torchrun: WORLD ranks (gloo), a tiny MLP whose training
forward sleeps FORWARD_S, every rank calling run.watch(ddp) with every_n_steps=1 (so each step logs
its own perf/compute_s), logging into a private Redis, ingested by one `runbus ingest` worker with
its defaults into a throwaway SQLite store. Half the trials (every other one) have one random rank
whose forward sleeps SLOWDOWN times as long; the others have none. While a job runs the bench
reads its health from the store every POLL_S seconds (as bench/faults.py does), and once it ended
the final verdict: for each label the step (0-based, of the run, from its first logged step) of
the first verdict that names it a chronic straggler (the entry's `step`: the last step judged).

The detector re-reads a run's step times as their steps are stored, at most every 0.25 s
(ingester/health.py SOONEST), so a live verdict comes a few steps after the rules could have
named the rank (ingest's own delay among them). To tell the two apart the bench also
replays the stored perf/compute_s through the same rules (storage/stragglers.py), step by step:
the first step at which the rules, given only the values up to it, name each label.

A trial with a slow rank is a true positive when that rank is named by the end of step
WITHIN + WARMUP (live) or WITHIN (replayed), a false negative otherwise; any other rank named
chronic in any trial, healthy ones included, is a false positive. The truth for the time lost: the
fast ranks wait, each step, for the slow rank's extra forward sleep, FORWARD_S x (SLOWDOWN - 1);
every one of the job's STEPS training steps has one such forward (the evaluation forward between
steps does not sleep), so injected = STEPS x FORWARD_S x (SLOWDOWN - 1); the bench divides the
final verdict's `lost_s` by it.

    python bench/stragglers.py [--trials 10] [--world 8] [--steps 100] [--forward-s 0.05]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

import orjson
from common import emit, live_store, median, percentile

from runbus.storage import steptimes
from runbus.storage.steptimes import Times
from runbus.storage.stragglers import MAD_SCALE, StepTimes, Tally, find, latest, ratios
from tests.integration_runs import clean_env
from tests.rank_processes import watch_job

KEY = "perf/compute_s"
WAIT_KEY = "perf/comm_wait_s"
WITHIN = 20  # the target: named within 20 steps
# Steps allowed on top for the live verdict: ingest, the detector's next check (at most every
# 0.25 s once steps arrive) and the bench's poll; `named_within_20` holds the live verdict to 20.
WARMUP = 20
TARGET = 0.99  # precision and recall
LOST_TOLERANCE = 0.10  # lost_s within 10% of the injected truth
POLL_S = 0.2


def start_job(
    redis_url: str, run_id: str, slow: int, log: str, args: argparse.Namespace
) -> subprocess.Popen[bytes]:
    argv = watch_job(
        redis_url, run_id, "--every", "1", "--steps", str(args.steps), "--slow-rank", str(slow),
        "--forward-s", str(args.forward_s), "--slowdown", str(args.slowdown), world=args.world,
    )  # fmt: skip
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, *argv], env=clean_env(), stdout=out, stderr=out)


def first_named(found: dict[str, int], health: Mapping[str, Any] | None) -> None:
    """Add to `found` each label a verdict names a chronic straggler, at the step it was judged at."""
    for entry in (health or {}).get("stragglers") or []:
        if entry.get("kind") == "chronic":
            found.setdefault(entry["label"], entry["step"])


async def live(store: Any, run_id: str, job: subprocess.Popen[bytes], wait: float) -> dict[str, Any]:
    """Poll the run's health while the job runs, then until its final verdict: the first step each
    label was named chronic at, and the final verdict."""
    named: dict[str, int] = {}
    health = None
    while job.poll() is None:
        health = await store.health(run_id)
        first_named(named, health)
        await asyncio.sleep(POLL_S)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        health = await store.health(run_id)
        first_named(named, health)
        if health and "finished" in (health.get("note") or ""):
            break
        await asyncio.sleep(POLL_S)
    return {"named": named, "final": health}


def replayed(times: Mapping[str, Mapping[int, float]]) -> dict[str, dict[str, Any]]:
    """Each label the straggler rules name chronic, given each label's values up to each step in
    turn: the first step it is named at, at how many steps it is, and its largest `behind`."""
    named: dict[str, dict[str, Any]] = {}
    for step in sorted({s for steps in times.values() for s in steps}):
        upto = {label: {s: t for s, t in steps.items() if s <= step} for label, steps in times.items()}
        for entry in find(StepTimes(KEY, False, latest(Times.of(upto)), {}), {}):
            if entry["kind"] == "chronic":
                seen = named.setdefault(entry["label"], {"first": step, "steps_named": 0, "behind_max": 0.0})
                seen["steps_named"] += 1
                seen["behind_max"] = max(seen["behind_max"], entry["behind"])
    return named


def noise(times: Mapping[str, Mapping[int, float]], slow: str | None) -> float | None:
    """The healthy ranks' per-step noise: the scaled MAD of their ratios to the others' median."""
    values = [r for label, rows in ratios(times).items() if label != slow for _, r, _ in rows]
    if len(values) < 2:
        return None
    centre = statistics.median(values)
    return round(MAD_SCALE * statistics.median(abs(v - centre) for v in values), 4)


def judged(named: Mapping[str, int], slow: str | None, budget: int) -> dict[str, Any]:
    """A trial's outcome: the slow rank's naming step, whether within `budget` steps (a true
    positive), and the other labels named (false positives)."""
    step = named.get(slow) if slow else None
    return {
        "slow_named_at": step,
        "tp": step is not None and step < budget,
        "false_named": sorted(label for label in named if label != slow),
    }


async def trial(
    store: Any, redis_url: str, index: int, slow: int, args: argparse.Namespace
) -> dict[str, Any]:
    run_id = f"straggler-{index}-{os.getpid()}"
    label = f"rank{slow}" if slow >= 0 else None
    load_before = os.getloadavg()[0]
    began = time.monotonic()
    job = start_job(redis_url, run_id, slow, os.path.join(args.tmp, run_id + ".log"), args)
    try:
        seen = await live(store, run_id, job, args.wait)
    finally:
        if job.poll() is None:
            job.kill()
        job.wait(60)
    times = (await steptimes.read(store, run_id, KEY, True, 10**6, since=0)).by_label()
    waits = (await steptimes.read(store, run_id, WAIT_KEY, True, 10**6, since=0)).by_label()
    if args.times:
        keep(args.times, {"index": index, "slow": label, "times": times, "waits": waits})
    return {
        "index": index,
        "slow": label,
        "exit_code": job.returncode,
        "wall_s": round(time.monotonic() - began, 1),
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        **outcome(times, seen, label, args),
        **({"waited_s": waited(waits, label)} if label else {}),
    }


def waited(waits: Mapping[str, Mapping[int, float]], slow: str) -> float | None:
    """What the fast ranks measured they waited for the slow one: over the steps, the median of
    their perf/comm_wait_s less the slow rank's (its own all-reduce, which every rank spends)."""
    if slow not in waits:
        return None
    total = 0.0
    for step, mine in waits[slow].items():
        fast = [steps[step] for label, steps in waits.items() if label != slow and step in steps]
        if fast:
            total += statistics.median(fast) - mine
    return round(total, 3)


def keep(path: str, record: dict[str, Any]) -> None:
    with open(path, "ab") as out:
        out.write(orjson.dumps(record, option=orjson.OPT_NON_STR_KEYS) + b"\n")


def outcome(
    times: Mapping[str, Mapping[int, float]],
    seen: dict[str, Any],
    label: str | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """What a trial found: live and replayed naming, noise, and lost_s against the truth."""
    measured = Tally()
    measured.count(Times.of(times))
    rules = replayed(times)
    for name, found in rules.items():
        found["measured_excess_s"] = round(measured.lost.get(name, 0.0), 3)
    final = seen["final"] or {}
    result: dict[str, Any] = {
        "steps_stored": min((len(steps) for steps in times.values()), default=0),
        "compute_s_median": round(median([t for steps in times.values() for t in steps.values()]), 4)
        if times
        else None,
        "noise": noise(times, label),
        "final_state": final.get("state"),
        "live": judged(seen["named"], label, WITHIN + WARMUP),
        "rules": judged({name: found["first"] for name, found in rules.items()}, label, WITHIN),
        "rules_false": {name: found for name, found in rules.items() if name != label},
    }
    if label:
        reported = {s["label"]: s["lost_s"] for s in final.get("stragglers") or []}.get(label)
        injected = args.steps * args.forward_s * (args.slowdown - 1)
        result.update(
            lost_s=reported,
            injected_s=round(injected, 3),
            lost_ratio=round(reported / injected, 3) if reported is not None else None,
            measured_excess_s=round(measured.lost.get(label, 0.0), 3),
        )
    return result


def scores(trials: list[dict[str, Any]], how: str) -> dict[str, Any]:
    """Precision and recall of naming the slow rank in time, by `how` ("live" or "rules")."""
    slow = [t for t in trials if t["slow"]]
    tp = sum(t[how]["tp"] for t in slow)
    fp = sum(len(t[how]["false_named"]) for t in trials)
    steps = [t[how]["slow_named_at"] for t in slow if t[how]["slow_named_at"] is not None]
    return {
        "within_steps": WITHIN + (WARMUP if how == "live" else 0),
        "tp": tp,
        "fn": len(slow) - tp,
        "fp": fp,
        "precision": round(tp / (tp + fp), 3) if tp + fp else None,
        "recall": round(tp / len(slow), 3) if slow else None,
        "named_within_20": sum(step < WITHIN for step in steps),
        "median_step": median(steps) if steps else None,
        "p95_step": percentile(steps, 0.95) if steps else None,
    }


def summary(trials: list[dict[str, Any]]) -> dict[str, Any]:
    ratios_ = [t["lost_ratio"] for t in trials if t.get("lost_ratio") is not None]
    return {
        "trials": len(trials),
        "with_slow_rank": sum(1 for t in trials if t["slow"]),
        "live": scores(trials, "live"),
        "rules": scores(trials, "rules"),
        "lost_ratio": ratios_,
        "lost_to_waited": [
            round(t["lost_s"] / t["waited_s"], 3) for t in trials if t.get("lost_s") and t.get("waited_s")
        ],
        "lost_within_10pct": sum(abs(r - 1) <= LOST_TOLERANCE for r in ratios_),
        "noise_median": median([t["noise"] for t in trials if t["noise"] is not None]) if trials else None,
        "load_avg_1m": [min(t["load_avg_1m"][0] for t in trials), max(t["load_avg_1m"][1] for t in trials)]
        if trials
        else None,
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    trials: list[dict[str, Any]] = []
    async with live_store("runbus-stragglers-") as (tmp, redis_url, store):
        args.tmp = tmp
        for index in range(args.trials):
            slow = rng.randrange(args.world) if index % 2 == 0 else -1
            result = await trial(store, redis_url, index, slow, args)
            trials.append(result)
            print(result, file=sys.stderr, flush=True)
    return {"summary": summary(trials), "trials": trials}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=10, help="jobs; every other one has a slow rank")
    parser.add_argument("--world", type=int, default=8, help="ranks per job")
    parser.add_argument("--steps", type=int, default=100, help="training steps per job")
    parser.add_argument("--forward-s", type=float, default=0.05, help="seconds each training forward sleeps")
    parser.add_argument("--slowdown", type=float, default=1.2, help="the slow rank's forward, times as long")
    parser.add_argument("--seed", type=int, default=24, help="picks the slow ranks")
    parser.add_argument("--times", help="append each trial's perf/compute_s (JSON lines) to this file")
    parser.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the final verdict")
    args = parser.parse_args()
    started = time.monotonic()
    results = asyncio.run(bench(args))
    emit(
        "stragglers",
        {
            "world": args.world,
            "steps": args.steps,
            "forward_s": args.forward_s,
            "slowdown": args.slowdown,
            "warmup_steps": WARMUP,
            "wall_s": round(time.monotonic() - started, 1),
            **results,
        },
    )


if __name__ == "__main__":
    main()
