"""The first-anomaly bench of issue #24: a rank's loss going NaN, its grad norm +inf, or its loss
leaving the other ranks' band, injected into real multi-process jobs; whether the live detector's
first anomaly is exactly the injected rank, key and step, and how soon it is reported.

Each trial is one job of WORLD rank processes (plain `runbus.init()` producers, no torch), each
logging `loss` (a decay at the rank's own rate plus noise at every step, as bench/columns.py's
noisy keys), `grad_norm` (noisy, decaying from a warm-up) and `lr` (warm-up and cosine, the same
on every rank) at every step of STEPS, STEP_S seconds a step, the ranks in step as DDP keeps them
(each step at a start time they share plus step x STEP_S). One `runbus ingest` worker with its
defaults ingests every job into a throwaway SQLite store. At a random step one random rank goes
bad by the trial's kind:

- `nan`: its loss is NaN from that step on (the grad norm stays finite: the logged reduction
  overflowed, not the model);
- `inf`: its grad norm is +inf at that step only (an AMP scaler's overflow, the step skipped);
- `outlier`: its loss is 5x from that step on (it left the band).

Every other trial of a kind (its first too) a second rank goes bad 1 to 8 steps later, the same
way (or by `--second`): the first anomaly must still be the first rank's. The bench reads the
run's health from the store every POLL_S seconds while the job runs and until its final verdict:
the seconds from the injected value's log() to the first verdict whose first anomaly is the
injected (label, key, step, kind), and any verdict whose first anomaly was something else. A
trial is exact when the first anomaly ever shown is the injected one and the final verdict's is
too; any anomaly not injected, in any trial, is a false one. Healthy trials (nobody goes bad)
count the anomalies named.

The injected step leaves two closed 128-step buckets after it within the job (a band leaver is
named only once they are: docs/health.md), and falls at least MIN_STEP steps in; `--offsets`
puts it at given steps of its bucket (a jump at a bucket's edges is the hardest to place).

    python bench/anomalies.py --quick                                   # each kind once at 8 ranks
    python bench/anomalies.py [--worlds 8,32] [--trials 20] [--healthy 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import textwrap
import time
from typing import Any

from common import TRACKERS_NAMING_A_RANK, emit, live_store, median, percentile

from runbus.storage.rollups import FINE_SHIFT
from tests.rank_processes import start_ranks, stop_ranks

KINDS = ("nan", "inf", "outlier")
KEY_OF = {"nan": "loss", "inf": "grad_norm", "outlier": "loss"}
POLL_S = 0.2
MIN_STEP = 16
SECOND_AFTER = (1, 8)  # the second bad rank's steps after the first's, at least and at most
ANCHORS = {"trackers_naming_a_rank": TRACKERS_NAMING_A_RANK}

RANK = textwrap.dedent(
    """
    import glob, math, os, random, time
    import runbus

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    steps, step_s, folder = int(os.environ["STEPS"]), float(os.environ["STEP_S"]), os.environ["TRIAL_DIR"]
    faults = {int(r): (int(s), k) for r, s, k in (f.split(":") for f in os.environ["FAULTS"].split(",") if f)}
    run = runbus.init(system_interval=None, hardware=False, git=False)
    rng = random.Random(os.environ["RUNBUS_RUN_ID"] + str(rank))
    rate = 700 + 300 * rng.random()

    # In step as under DDP: step k at a start time every rank reads alike, once all are up.
    open(os.path.join(folder, f"ready{rank}"), "w").close()
    while len(ready := glob.glob(os.path.join(folder, "ready*"))) < world:
        time.sleep(0.01)
    start = max(os.path.getmtime(path) for path in ready) + 0.5
    at, kind = faults.get(rank, (steps, ""))

    for step in range(steps):
        time.sleep(max(0.0, start + step * step_s - time.time()))
        loss = 2.5 * math.exp(-step / rate) + 0.3 + rng.gauss(0, 0.05)
        grad_norm = abs(rng.gauss(1.0, 0.3)) * (1 + 5 * math.exp(-step / 100))
        lr = 3e-4 * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / steps))
        if step >= at:
            loss = math.nan if kind == "nan" else loss * 5 if kind == "outlier" else loss
            grad_norm = math.inf if kind == "inf" and step == at else grad_norm
        if step == at:
            with open(os.path.join(folder, f"injected{rank}"), "w") as out:
                out.write(repr(time.time()))
        run.log({"loss": loss, "grad_norm": grad_norm, "lr": lr}, step=step)
    run.finish()
    """
)

Row = tuple[str, str, int | None, str]  # (label, key, step, kind)


def row(anomaly: dict[str, Any]) -> Row:
    return anomaly["label"], anomaly["key"], anomaly["step"], anomaly["kind"]


def first_steps(steps: int, offsets: list[int] | None) -> list[int]:
    """The steps the first rank may go bad at: those that leave two closed 128-step buckets after
    their own (or after the next: a departure late in a bucket is found from the bucket after),
    the second rank's included; with `offsets`, only those at these steps of their bucket."""
    last_bucket = ((steps - 1) >> FINE_SHIFT) - 3  # the highest bucket is open; two closed after
    last = ((last_bucket + 1) << FINE_SHIFT) - 1 - SECOND_AFTER[1]
    width = 1 << FINE_SHIFT
    return [s for s in range(MIN_STEP, last + 1) if offsets is None or s % width in offsets]


def faults_of(
    kind: str | None, world: int, second: str | None, steps: list[int], rng: random.Random
) -> list[tuple[int, int, str]]:
    """(rank, step, kind) of the ranks going bad, the first first: a random rank at a random step
    of `steps`, and (`second`: its kind) another SECOND_AFTER steps later."""
    if kind is None:
        return []
    first = (rng.randrange(world), rng.choice(steps), kind)
    if not second:
        return [first]
    other = rng.choice([r for r in range(world) if r != first[0]])
    return [first, (other, first[1] + rng.randint(*SECOND_AFTER), second)]


class Seen:
    """What the verdicts read while a job ran said of its anomalies: the wall time each anomaly
    and each first anomaly was first seen, and the final verdict's."""

    def __init__(self) -> None:
        self.named: dict[Row, float] = {}
        self.firsts: dict[Row, float] = {}
        self.final: list[Row] = []

    def add(self, health: dict[str, Any] | None) -> None:
        rows = [row(a) for a in (health or {}).get("anomalies") or []]
        now = time.time()
        for found in rows:
            self.named.setdefault(found, now)
        if rows:
            self.firsts.setdefault(rows[0], now)
        self.final = rows


async def watch(store: Any, run_id: str, ranks: list, expected: list[Row], wait: float) -> Seen:
    """Read the run's health while its ranks run, then until its verdict is final (the run ended)
    and names every anomaly expected, or `wait` seconds passed."""
    seen = Seen()
    while any(r.poll() is None for r in ranks):
        seen.add(await store.health(run_id))
        await asyncio.sleep(POLL_S)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        health = await store.health(run_id)
        seen.add(health)
        if (health or {}).get("ended") and set(expected) <= set(seen.final):
            break
        await asyncio.sleep(POLL_S)
    return seen


def injected_at(folder: str, rank: int) -> float | None:
    try:
        with open(os.path.join(folder, f"injected{rank}")) as found:
            return float(found.read())
    except (OSError, ValueError):  # never injected (the job ended early)
        return None


def judged(seen: Seen, expected: list[Row], at: float | None, step_s: float) -> dict[str, Any]:
    """The trial's figures from what was seen: exact (the first anomaly ever shown and the final
    one are the injected first), seconds to it, other firsts shown and for how long before it,
    anomalies not injected."""
    firsts = sorted(seen.firsts, key=seen.firsts.__getitem__)
    result: dict[str, Any] = {
        "false": [list(r) for r in seen.named if r not in expected],
        "final_first": list(seen.final[0]) if seen.final else None,
    }
    if not expected:
        return result
    first = expected[0]
    shown = seen.firsts.get(first)
    seconds = None if shown is None or at is None else round(shown - at, 2)
    result.update(
        exact=bool(firsts) and firsts[0] == first and seen.final[:1] == [first],
        seconds=seconds,
        steps_after=None if seconds is None else round(seconds / step_s),
        other_firsts=[list(r) for r in firsts if r != first],
        # How long another first anomaly was shown before the injected one (None: none was).
        other_first_s=round(shown - seen.firsts[firsts[0]], 2) if shown and firsts[0] != first else None,
        second_named=len(expected) < 2 or expected[1] in seen.final,
    )
    return result


async def trial(
    store: Any, redis_url: str, fault: tuple[str | None, str | None], world: int, index: int, args
) -> dict[str, Any]:
    """One job: its ranks started, one going bad by `kind` (None: healthy) and, with `second`,
    another a few steps later by `second` (a kind), watched to its final verdict."""
    kind, second = fault
    run_id = f"{kind or 'healthy'}-{world}-{index}"
    rng = random.Random(f"{args.seed}-{run_id}")
    bad = faults_of(kind, world, second, first_steps(args.steps, args.offsets), rng)
    folder = os.path.join(args.tmp, run_id)
    os.makedirs(folder)
    env = {
        "RUNBUS_REDIS_URL": redis_url,
        "RUNBUS_RUN_ID": run_id,
        "RUNBUS_QUIET": "1",
        "STEPS": str(args.steps),
        "STEP_S": str(args.step_s),
        "TRIAL_DIR": folder,
        "FAULTS": ",".join(f"{rank}:{step}:{how}" for rank, step, how in bad),
    }
    expected = [(f"rank{rank}", KEY_OF[how], step, how) for rank, step, how in bad]
    ranks = start_ranks(RANK, world, env)
    try:
        seen = await watch(store, run_id, ranks, expected, args.wait)
    finally:
        stop_ranks(ranks, 60)
    at = injected_at(folder, bad[0][0]) if bad else None
    return {
        "kind": kind or "healthy",
        "world": world,
        "injected": [list(r) for r in expected],
        "exit_codes_ok": [r.returncode for r in ranks] == [0] * world,
        **judged(seen, expected, at, args.step_s),
    }


def by_kind(injected: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Trials, exact firsts and seconds to them (median, max) by kind and world."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for t in injected:
        groups.setdefault(f"{t['kind']}@{t['world']}", []).append(t)
    found: dict[str, dict[str, Any]] = {}
    for name, group in groups.items():
        times = [t["seconds"] for t in group if t["seconds"] is not None]
        found[name] = {
            "injected": len(group),
            "exact": sum(t["exact"] for t in group),
            "median_s": round(median(times), 2) if times else None,
            "max_s": max(times, default=None),
        }
    return found


def firsts(injected: list[dict[str, Any]]) -> dict[str, Any]:
    """Of the injected trials: the first anomaly exact live and at the end, exact at the end only
    (another shown first meanwhile: for how long at most), and the second bad rank named."""
    twice = [t for t in injected if len(t["injected"]) > 1]
    late = [t["other_first_s"] for t in injected if t["other_first_s"] is not None]
    return {
        "exact_first": sum(t["exact"] for t in injected),
        "exact_final": sum(t["final_first"] == t["injected"][0] for t in injected),
        "other_first_shown": len(late),
        "other_first_max_s": max(late, default=None),
        "with_second": len(twice),
        "second_named": sum(t["second_named"] for t in twice),
    }


def summary(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Exact firsts and seconds to them, overall and by kind and world; anomalies named falsely."""
    injected = [t for t in trials if t["kind"] != "healthy"]
    healthy = [t for t in trials if t["kind"] == "healthy"]
    seconds = [t["seconds"] for t in injected if t["exact"] and t["seconds"] is not None]
    return {
        "injected": len(injected),
        **firsts(injected),
        "median_s": round(median(seconds), 2) if seconds else None,
        "p95_s": round(percentile(seconds, 0.95), 2) if seconds else None,
        "healthy_runs": len(healthy),
        "healthy_with_anomalies": sum(bool(t["false"]) for t in healthy),
        "false_anomalies": sum(len(t["false"]) for t in trials),
        "by_kind": by_kind(injected),
    }


def plan(args) -> list[tuple[str | None, int, int, str | None]]:
    """(kind, world, index, second) of every trial: at each world the kinds in turn and the healthy
    runs, shuffled; every other trial of a kind (its first too) with a second bad rank, going bad
    by `--second` (`same`: the trial's kind)."""
    trials: list[tuple[str | None, int, int, str | None]] = []
    for world in args.worlds:
        kinds = [args.kinds[i % len(args.kinds)] for i in range(args.trials)] + [None] * args.healthy
        random.Random(f"{args.seed}-{world}").shuffle(kinds)
        for index, kind in enumerate(kinds):
            second = kind is not None and kinds[:index].count(kind) % 2 == 0
            how = kind if args.second == "same" else args.second
            trials.append((kind, world, index, how if second else None))
    return trials


async def bench(args) -> dict[str, Any]:
    trials: list[dict[str, Any]] = []
    async with live_store("runbus-anomalies-") as (tmp, redis_url, store):
        args.tmp = tmp
        for kind, world, index, second in plan(args):
            result = await trial(store, redis_url, (kind, second), world, index, args)
            trials.append(result)
            print(result, file=sys.stderr, flush=True)
    return {"summary": summary(trials), "trials": trials}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="each kind once and one healthy job, 8 ranks")
    parser.add_argument("--worlds", default="8", help="rank counts, comma-separated")
    parser.add_argument(
        "--trials", type=int, default=20, help="injected trials at each world (kinds in turn)"
    )
    parser.add_argument("--healthy", type=int, default=5, help="healthy trials at each world")
    parser.add_argument("--kinds", default=",".join(KINDS), help="injected kinds, comma-separated")
    parser.add_argument(
        "--second", default="same", choices=("same", *KINDS), help="how the second bad rank goes bad"
    )
    parser.add_argument("--steps", type=int, default=768, help="steps per job (at least 512)")
    parser.add_argument("--step-s", type=float, default=0.03, help="seconds a step")
    parser.add_argument(
        "--offsets",
        help="the first bad step only at these steps of its 128-step bucket (its edges: 0,1,126,127)",
    )
    parser.add_argument("--seed", type=int, default=24, help="picks the ranks and steps")
    parser.add_argument("--wait", type=float, default=30.0, help="seconds to wait for the final verdict")
    args = parser.parse_args()
    if args.quick:
        args.worlds, args.trials, args.healthy = "8", 3, 1
    args.worlds = [int(w) for w in args.worlds.split(",")]
    args.kinds = [k for k in args.kinds.split(",") if k]
    args.offsets = [int(o) for o in args.offsets.split(",")] if args.offsets else None
    started = time.monotonic()
    results = asyncio.run(bench(args))
    emit(
        "anomalies",
        {
            "worlds": args.worlds,
            "steps": args.steps,
            "step_s": args.step_s,
            "anchors": ANCHORS,
            "wall_s": round(time.monotonic() - started, 1),
            **results,
        },
    )


if __name__ == "__main__":
    main()
