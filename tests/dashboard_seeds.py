"""Runs the dashboard's browser tests draw besides RUN and HOSTILE (tests/test_dashboard_api.py):
many labels with a straggler, an outlier and an elastic restart; thousands of keys; hostile text
where the hardware tab shows it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import redis

from tests.helpers import xadd_event

SWEEP = "sweep-24"
SWEEP_RANKS = 24
SWEEP_STEPS = 60
SWEEP_T0 = 1_763_800_000.0
STRAGGLER = "rank5"  # every step 1.6x the others'
ONE_OFF = "rank11"  # steps 20-25 at 3 s each, else like the others
OUTLIER = "rank17"  # its loss well above everyone's
RESTARTED = "rank3"  # restarted after step 39 (epoch 2), resumed from step 30
GAPPED = "rank20"  # steps 12-27 lost on the way (their seqs never arrive)
SWEEP_FAST = "sweep-8-fast"  # 8 ranks, the same keys, learning 1.6x as fast
STEPPED = "long-16"  # 16 ranks, 2048 steps of one key: step times over many 128-step buckets
STEPPED_RANKS = 16
STEPPED_STEPS = 2048
SLOW_RANK = "rank13"  # every step 1.3x the others'
HICCUP_RANK = "rank6"  # steps 512-767 at 3x, else like the others
WIDE = "wide-keys"
WIDE_KEYS = 3000
HOSTILE_HW = "hostile-hardware"
SECRET = "hf_Zq81mXv0dPq3NlLr7"  # a token on the command line: never on the page
HOSTILE_TEXT = "<img src=x onerror=\"window.__pwned='hw'\">"
COMMIT = "5413b390d46ade5b483a374e1028002836f8143e"
DIRTY_RANK = "rank9"  # started with uncommitted changes


def git_state(label: str) -> dict:
    """A start event's `git`, as runbus.producer.gitstate records it, its remote's token written
    as a stray producer would (runbus hides it before it leaves the process)."""
    remote = f"https://ci:{SECRET}@github.com/acme/llama.git"
    return {"commit": COMMIT, "branch": "main", "dirty": label == DIRTY_RANK, "remote": remote}


def hardware(rank: int) -> dict:
    """A start event's `hardware`, as runbus.producer.hardware describes a GPU node."""
    return {
        "host": f"node-{rank // 8}",
        "cpu_count": 96,
        "memory_total_mb": 2_063_000,
        "platform": "Linux-5.15.0-x86_64-with-glibc2.35",
        "python_version": "3.11.9",
        "torch_version": "2.5.1+cu124",
        "driver_version": "550.54.15",
        "cuda_version": "12.4",
        "gpus": [{"index": rank % 8, "name": "NVIDIA H100 80GB HBM3", "memory_total_mb": 81559}],
        "argv": ["train.py", "--config", "configs/llama-1b.yaml", "--hf-token", SECRET],
    }


@dataclass
class LabelWriter:
    """Writes one label's events in order: seq counts up within the current epoch."""

    pipe: Any
    run: str
    label: str
    epoch: int = 1
    seq: int = 0

    def add(self, kind: str, data: dict, step: int | None = None, ts: float | None = None) -> None:
        self.seq += 1
        xadd_event(self.pipe, self.run, self.label, kind, self.epoch, self.seq, data, step=step, ts=ts)

    def restart(self) -> None:
        self.epoch, self.seq = self.epoch + 1, 0


def seed_sweep(client: redis.Redis, run: str = SWEEP, ranks: int = SWEEP_RANKS, rate: float = 1.0) -> None:
    """`ranks` ranks on hosts of 8 logging the keys of sweep_metrics (learning `rate` times as
    fast), RESTARTED restarting; in SWEEP also a straggler, a one-off slow stretch, an outlier
    loss and a gap."""
    pipe = client.pipeline(transaction=False)
    quirks = run == SWEEP
    for rank in range(ranks):
        label = f"rank{rank}"
        writer = LabelWriter(pipe, run, label)
        start = {
            "primary": rank == 0,
            "rank": rank,
            "local_rank": rank % 8,
            "world_size": ranks,
            "restart_count": 0,
            "pid": 7000 + rank,
            "host": f"node-{rank // 8}",
            "hardware": hardware(rank),
            "git": git_state(label),
        }
        if rank == 0:
            start["config"] = sweep_config(rate)
        writer.add("start", start, ts=SWEEP_T0)
        ts = SWEEP_T0 + 1
        for step in range(SWEEP_STEPS):
            if label == RESTARTED and step == 40:
                # The process dies after step 39; its restart resumes from the step-30 checkpoint.
                writer.restart()
                ts += 20
                writer.add("start", {**start, "restart_count": 1, "primary": False}, ts=ts)
                for again in range(30, SWEEP_STEPS):
                    ts += 1.0
                    writer.add("metric", sweep_metrics(rank, again, rate, outlier=quirks), step=again, ts=ts)
                break
            if not quirks:
                ts += 1.0
                writer.add("metric", sweep_metrics(rank, step, rate, outlier=False), step=step, ts=ts)
                continue
            if label == GAPPED and 12 <= step <= 27:
                writer.seq += 1  # written, never delivered: a gap of seqs the store reports
                ts += 1.0
                continue
            ts += 1.6 if label == STRAGGLER else 3.0 if label == ONE_OFF and 20 <= step <= 25 else 1.0
            ts += ((rank * 31 + step * 17) % 10) * 0.004
            writer.add("metric", sweep_metrics(rank, step), step=step, ts=ts)
            if step % 10 == 0:
                system = {
                    f"gpu.{rank % 8}.util": 88 + (rank % 5) + 4 * math.sin(step / 6 + rank),
                    "proc.cpu_percent": 97 + math.sin(step + rank),
                }
                writer.add("system", system, ts=ts + 0.01)
        writer.add("finish", {"exit_code": 0}, ts=ts + 1)
    pipe.execute()


def sweep_config(rate: float) -> dict:
    """A sweep's config: its learning rate by `rate`, and a token only where `rate` is not 1."""
    config: dict = {
        "model": "llama-1b",
        "lr": 3e-4 * rate,
        "optimizer": {"name": "adamw", "betas": [0.9, 0.95]},
        "data": {"seq_len": 2048},
    }
    if rate != 1.0:
        config["hf_token"] = SECRET
    return config


def sweep_metrics(rank: int, step: int, rate: float = 1.0, outlier: bool = True) -> dict:
    wobble = ((rank * 7919 + step * 104729) % 101) / 101 * 0.08
    off = outlier and f"rank{rank}" == OUTLIER
    loss = 2.4 * math.exp(-step * rate / 25) + 0.4 + wobble + (0.6 if off else 0.0)
    data = {
        "train/loss": loss,
        "train/lr": 3e-4 * rate * (1 - step / SWEEP_STEPS),
        "throughput": 1800 - rank * 3 + 40 * math.sin(step / 5),
    }
    if step % 10 == 0:
        data["eval/accuracy"] = 0.5 + 0.4 * (1 - math.exp(-step * rate / 20)) - (0.05 if off else 0)
    return data


def seed_stepped(client: redis.Redis) -> None:
    """STEPPED_RANKS ranks logging a loss every step for STEPPED_STEPS steps, a chronic straggler
    and a one-off among them."""
    pipe = client.pipeline(transaction=False)
    for rank in range(STEPPED_RANKS):
        label = f"rank{rank}"
        writer = LabelWriter(pipe, STEPPED, label)
        writer.add("start", {"primary": rank == 0, "rank": rank, "host": f"node-{rank // 8}"}, ts=SWEEP_T0)
        ts = SWEEP_T0 + 1
        for step in range(STEPPED_STEPS):
            ts += 1.3 if label == SLOW_RANK else 3.0 if label == HICCUP_RANK and 512 <= step < 768 else 1.0
            ts += ((rank * 31 + step * 17) % 10) * 0.002
            writer.add("metric", {"loss": 2.0 * math.exp(-step / 600) + 0.3}, step=step, ts=ts)
        writer.add("finish", {"exit_code": 0}, ts=ts + 1)
    pipe.execute()


def seed_wide(client: redis.Redis) -> None:
    """2 labels logging WIDE_KEYS keys (in 10 sections) for 2 steps."""
    pipe = client.pipeline(transaction=False)
    for rank in range(2):
        label = f"rank{rank}"
        xadd_event(pipe, WIDE, label, "start", 1, 1, {"primary": rank == 0, "rank": rank}, ts=SWEEP_T0)
        for step in range(2):
            data = {
                f"layer{i % 10}/param{i:04d}/grad_norm": (i % 97) / 10 + step + rank for i in range(WIDE_KEYS)
            }
            xadd_event(pipe, WIDE, label, "metric", 1, step + 2, data, step=step, ts=SWEEP_T0 + 1 + step)
    pipe.execute()


def seed_hostile_hardware(client: redis.Redis) -> None:
    """Hostile text in a key, a host, an argv, a git state and a config, where the hardware tab
    shows them."""
    start = {
        "primary": True,
        "rank": 0,
        "host": HOSTILE_TEXT,
        "hardware": {
            **hardware(0),
            "host": HOSTILE_TEXT,
            "argv": ["train.py", HOSTILE_TEXT, "<script>window.__pwned='argv'</script>"],
            "gpus": [{"index": 0, "name": HOSTILE_TEXT, "memory_total_mb": 1}],
            "torch_version": HOSTILE_TEXT,
        },
        "git": {"commit": HOSTILE_TEXT, "branch": HOSTILE_TEXT, "dirty": True, "remote": HOSTILE_TEXT},
    }
    xadd_event(client, HOSTILE_HW, "rank0", "start", 1, 1, start, ts=SWEEP_T0)
    for step in range(3):
        xadd_event(
            client,
            HOSTILE_HW,
            "rank0",
            "metric",
            1,
            step + 2,
            {HOSTILE_TEXT: float(step), '=HYPERLINK("http://x")': 1.0 + step},
            step=step,
            ts=SWEEP_T0 + step,
        )


NAN_RUN = "nan-20"  # 20 ranks, one key; NAN_RANK's loss is NaN at NAN_STEP, INF_RANK's inf at INF_STEP
NAN_RANKS, NAN_STEPS = 20, 2600  # 52,000 values: past the exact reads, the band comes from rollups
NAN_RANK, NAN_STEP = "rank13", 1337
INF_RANK, INF_STEP = "rank4", 2000


async def write_nan_run(store_url: str) -> None:
    """NAN_RUN written straight into the store at `store_url` (created)."""
    from runbus.storage import open_store
    from runbus.wire import Event

    store = open_store(store_url)
    await store.connect()
    try:
        for rank in range(NAN_RANKS):
            label = f"rank{rank}"
            events = [
                Event(NAN_RUN, label, "start", 1, 1, SWEEP_T0, {"primary": rank == 0, "rank": rank}, None)
            ]
            for step in range(NAN_STEPS):
                value = 2.0 * math.exp(-step / 600) + 0.3 + rank * 0.001
                if (label, step) == (NAN_RANK, NAN_STEP):
                    value = math.nan
                elif (label, step) == (INF_RANK, INF_STEP):
                    value = math.inf
                events.append(
                    Event(NAN_RUN, label, "metric", 1, step + 2, SWEEP_T0 + 1 + step, {"loss": value}, step)
                )
            events.append(
                Event(
                    NAN_RUN,
                    label,
                    "finish",
                    1,
                    NAN_STEPS + 2,
                    SWEEP_T0 + NAN_STEPS + 2,
                    {"exit_code": 0},
                    None,
                )
            )
            await store.write(events)
    finally:
        await store.close()


STALLED_RUN = "hang-6"  # 6 ranks, stalled: HUNG_RANK in a data loader, the others in all_reduce
STALLED_STEPS = 300  # the band is checked to step 127 (each rank's bucket 2, from step 256, is open)
NAN_AT = ("rank3", 250)  # STALLED_RUN's rank3 goes NaN there: after the band's reach, not settled
HEALTHY_RUN = "fine-2"  # 2 ranks, judged ok
HUNG_RANK = "rank5"
HUNG_CODE = "load_batch()  # <img src=x onerror=\"window.__pwned='health'\">"
HUNG_LINE = "rank 5 reading shard <b>20</b>"


def stalled_health(now: float) -> dict[str, Any]:
    """The stalled verdict of STALLED_RUN as the detector records it (docs/health.md)."""
    frames = [
        {"file": "/work/train.py", "line": 48, "function": "main", "code": HUNG_CODE},
        {"file": "/work/train.py", "line": 21, "function": "load_batch", "code": "time.sleep(3600)"},
    ]
    waiting = [{"label": f"rank{r}", "in": "all_reduce", "step": STALLED_STEPS - 1} for r in range(5)]
    culprit = {
        "label": HUNG_RANK,
        "reason": "in a data loader (load_batch)",
        "step": STALLED_STEPS - 1,
        "step_age": 14.0,
        "silent_s": 0.5,
        "host": "node3",
        "pid": 4121,
        "stack": frames,
        "last_lines": [HUNG_LINE],
    }
    return {
        "state": "stalled",
        "since": now - 12,
        "culprits": [culprit],
        "waiting": waiting,
        "note": None,
        "threshold": 10.0,
    }


async def write_health_runs(store_url: str) -> None:
    """STALLED_RUN and HEALTHY_RUN, running, each with its recorded health verdict."""
    import time

    from runbus.storage import open_store, outliers
    from runbus.storage.beats import RunVitals
    from runbus.wire import Event

    def loss(label: str, step: int) -> float:
        return math.nan if label == NAN_AT[0] and step >= NAN_AT[1] else 1.0 / (step + 1)

    now = time.time()
    store = open_store(store_url)
    await store.connect()
    try:
        for run, ranks, steps in ((STALLED_RUN, 6, STALLED_STEPS), (HEALTHY_RUN, 2, 41)):
            events = []
            for rank in range(ranks):
                label = f"rank{rank}"
                events.append(
                    Event(run, label, "start", 1, 1, now - 600, {"primary": rank == 0, "rank": rank}, None)
                )
                events.extend(
                    Event(
                        run, label, "metric", 1, step + 2, now - 600 + step, {"loss": loss(label, step)}, step
                    )
                    for step in range(steps)
                )
            await store.write(events)
        # The anomalies and the band's reach as the detector reads them (ingester/findings.py).
        anomalies = await outliers.every_anomaly(store, STALLED_RUN)
        band_to = (await outliers.band_leavers(store, STALLED_RUN))[1]
        stalled = {**stalled_health(now), "anomalies": [a.document() for a in anomalies], "band_to": band_to}
        await store.record_health(
            RunVitals(STALLED_RUN, "running", None, None), "stalled", f"stalled|{HUNG_RANK}", stalled, now
        )
        ok = {
            "state": "ok",
            "since": now - 30,
            "culprits": [],
            "waiting": [],
            "note": None,
            "threshold": 10.0,
        }
        await store.record_health(RunVitals(HEALTHY_RUN, "running", None, None), "ok", "ok", ok, now)
    finally:
        await store.close()
