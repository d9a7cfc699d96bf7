"""PyTorch: tensors as metrics, the DDP example under torchrun, and an elastic restart."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest
import redis

import runbus
from runbus import wire
from runbus.ingester.localredis import free_port
from runbus.producer import devicevalues
from tests.conftest import missing_package
from tests.helpers import ingest, read_store, run_cli, wait_for

try:
    import numpy as np
    import torch
    import torch.distributed as dist
except ImportError:
    missing_package("torch")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ddp_train.py"
STEPS = 20


def init(redis_url, run_id, **kw):
    return runbus.init(
        run_id=run_id,
        label="rank0",
        redis_url=redis_url,
        system_interval=None,
        hardware=False,
        console="off",
        **kw,
    )


def test_tensors_and_numpy_scalars_are_logged(redis_url, store_url):
    weight = torch.tensor(2.0, requires_grad=True)
    loss = weight * 3  # has a grad_fn
    running = torch.tensor(1.5)
    with init(redis_url, "tensors") as run:
        run.log(
            {
                "loss": loss,
                "running": running,
                "one_element": torch.tensor([0.25]),
                "half": torch.tensor(0.5, dtype=torch.bfloat16),
                "count": torch.tensor(7),
                "flag": torch.tensor(True),
                "np_float": np.float32(0.125),
                "np_int": np.int64(-3),
                "np_bool": np.bool_(True),
                "np_array": np.array(4.0),
            },
            step=torch.tensor(5),
        )
        running.add_(100.0)  # an in-place update after log() does not change what was logged
        with pytest.raises(TypeError, match="not a scalar"):
            run.log({"vector": torch.ones(2)})
        with pytest.raises(TypeError, match="complex"):
            run.log({"z": torch.tensor(1 + 2j)})
    ingest(redis_url, store_url)
    points = {p.key: (p.step, p.value) for p in read_store(store_url, "metrics", "tensors")}
    assert points == {
        "loss": (5, 6.0),
        "running": (5, 1.5),
        "one_element": (5, 0.25),
        "half": (5, 0.5),
        "count": (5, 7),
        "flag": (5, 1),
        "np_float": (5, 0.125),
        "np_int": (5, -3),
        "np_bool": (5, 1),
        "np_array": (5, 4.0),
    }
    assert weight.grad is None


class OnDevice(torch.Tensor):
    """A CPU tensor that says it lives on a GPU and notes which thread reads its value."""

    readers: list[str] = []
    broken = False

    @property
    def device(self):
        return torch.device("cuda", 0)

    def item(self):
        OnDevice.readers.append(threading.current_thread().name)
        if OnDevice.broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().item()


class GpuEvent:
    """Stands in for a CUDA event (the hardware boundary: no GPU here): `query()` says whether
    the GPU got past it, which the test decides."""

    def __init__(self, passed: threading.Event) -> None:
        self.passed = passed

    def query(self) -> bool:
        return self.passed.is_set()


@pytest.fixture
def gpu(monkeypatch) -> threading.Event:
    """The GPU's progress for OnDevice values: set, it computed every value logged; clear, none."""
    passed = threading.Event()
    passed.set()
    monkeypatch.setattr(devicevalues, "recorded_event", lambda device: GpuEvent(passed))
    return passed


def stream(redis_url: str, run_id: str) -> list[tuple[str, int, int | None, dict]]:
    """(kind, seq, step, data) of every entry of rank0's stream, in stream order."""
    with redis.Redis.from_url(redis_url) as client:
        entries = client.xrange(wire.stream_key(run_id, "rank0"))
    return [
        (
            f[b"kind"].decode(),
            int(f[b"seq"]),
            int(f[b"step"]) if f.get(b"step") else None,
            orjson.loads(f[b"data"]) if f.get(b"data") else {},
        )
        for _, f in entries
    ]


def test_accelerator_tensors_are_read_off_the_training_thread(redis_url, store_url, gpu):
    OnDevice.readers.clear()
    with init(redis_url, "deferred") as run:
        run.log({"on_device": torch.tensor(1.5).as_subclass(OnDevice)}, step=0)
        assert OnDevice.readers == []  # log() did not read it
    assert OnDevice.readers and all(name.startswith("runbus-shipper") for name in OnDevice.readers)
    ingest(redis_url, store_url)
    assert [(p.key, p.value) for p in read_store(store_url, "metrics", "deferred")] == [("on_device", 1.5)]


def test_a_device_tensor_that_cannot_be_read_is_a_counted_drop(redis_url, store_url, monkeypatch, gpu):
    # Its device failed after log() accepted it: the shipper's read fails, the event is counted
    # as dropped (an explained gap), and finish() says the label is incomplete.
    monkeypatch.setattr(OnDevice, "broken", True)
    with init(redis_url, "deferred") as run:
        run.log({"on_device": torch.tensor(1.0).as_subclass(OnDevice)}, step=0)
        run.log({"plain": 2.0}, step=1)
    assert run._shipper.failed_encodes == 1 and run.dropped == 1
    assert run.finish() is False
    ingest(redis_url, store_url)
    assert [(p.key, p.value) for p in read_store(store_url, "metrics", "deferred")] == [("plain", 2.0)]
    label = read_store(store_url, "run", "deferred").labels[0]
    assert (label.state, label.missing, sum(gap.dropped for gap in label.gaps)) == ("finished", 1, 1)


def test_values_their_gpu_has_not_computed_wait_and_heartbeats_go_ahead(redis_url, store_url, gpu):
    # A rank whose GPU hangs (a kernel that never ends, an NCCL collective whose peer never
    # comes): its shipper must not wait for the GPU, or its heartbeats (its stack, its step)
    # stop with it and the detector cannot name it.
    OnDevice.readers.clear()
    with init(redis_url, "gpu-hangs", heartbeat_interval=0.2) as run:
        run.log({"loss": 1.0}, step=0)
        gpu.clear()
        run.log({"loss": torch.tensor(2.0).as_subclass(OnDevice)}, step=1)
        run.log({"loss": 3.0}, step=2)
        run.log_text("after the hang")
        beat = wait_for(
            "a heartbeat saying the values wait for the GPU",
            lambda: [e for e in stream(redis_url, "gpu-hangs") if e[3].get("gpu_wait_s", 0) > 0.3],
        )[-1]
        entries = stream(redis_url, "gpu-hangs")
        assert [e[2] for e in entries if e[0] == "metric"] == [0]  # steps 1 and 2 wait, in order
        assert not [e for e in entries if e[0] == "log"] and OnDevice.readers == []
        assert beat[3]["step"] == 0
        gpu.set()
    assert run.dropped == 0
    entries = stream(redis_url, "gpu-hangs")
    metrics = [(e[1], e[2]) for e in entries if e[0] == "metric"]
    assert [step for _, step in metrics] == [0, 1, 2]
    assert metrics[0][0] < beat[1] < metrics[1][0] < metrics[2][0]  # the beat went ahead of them
    assert [e[1] for e in entries] == sorted(e[1] for e in entries)  # the stream is in seq order
    ingest(redis_url, store_url)
    assert [(p.step, p.value) for p in read_store(store_url, "metrics", "gpu-hangs")] == [
        (0, 1.0),
        (1, 2.0),
        (2, 3.0),
    ]
    label = read_store(store_url, "run", "gpu-hangs").labels[0]
    assert (label.state, label.missing) == ("finished", 0)


def test_a_finish_that_gives_up_on_a_value_its_gpu_never_computes_drops_it_counted(redis_url, gpu):
    run = init(redis_url, "gpu-never", finish_timeout=1.0)
    run.log({"loss": 1.0}, step=0)
    gpu.clear()
    run.log({"loss": torch.tensor(2.0).as_subclass(OnDevice)}, step=1)
    run.log({"loss": 3.0}, step=2)
    began = time.monotonic()
    assert run.finish() is False
    assert time.monotonic() - began < 10  # it gave up at its timeout, never waiting for the GPU
    # The value is an explained gap (seq 3); what followed it waits in the spool for `runbus sync`,
    # as at any finish that runs out of time.
    assert (run._shipper.failed_encodes, run.dropped, run._shipper.left_in_spool) == (1, 1, 2)
    assert [(e[0], e[2]) for e in stream(redis_url, "gpu-never") if e[0] == "metric"] == [("metric", 0)]


def test_tensors_without_a_value_are_refused_at_log(redis_url):
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode().from_tensor(torch.tensor(2.0))
    with init(redis_url, "valueless") as run:
        with pytest.raises(TypeError, match="'meta' device has no value"):
            run.log({"x": torch.tensor(1.0, device="meta")})
        with pytest.raises(TypeError, match="has no value"):
            run.log({"x": fake})
        with pytest.raises(TypeError, match="step: a tensor on the 'meta' device"):
            run.log({"x": 1.0}, step=torch.tensor(3, device="meta"))
        with pytest.raises(ValueError, match="64 bits"):
            run.log({"x": np.uint64(2**64 - 1)})
        with pytest.raises(ValueError, match="step must be < 2\\*\\*63"):
            run.log({"x": 1.0}, step=np.uint64(2**63))
    assert run.finish() is True and run.dropped == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensors_round_trip(redis_url, store_url):
    value = torch.tensor(0.75, device="cuda")
    with init(redis_url, "cuda") as run:
        run.log({"loss": value * 2}, step=0)
        value.add_(1.0)
    ingest(redis_url, store_url)
    assert [p.value for p in read_store(store_url, "metrics", "cuda")] == [1.5]


def test_rank_and_world_size_from_a_process_group(redis_url, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "RUNBUS_RUN_ID", "RUNBUS_LABEL"):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with runbus.init(redis_url=redis_url, system_interval=None, hardware=False, console="off") as run:
            ident = run.identity
            assert (ident.rank, ident.world_size, run.label, run.primary) == (0, 1, "rank0", True)
    finally:
        dist.destroy_process_group()


def torchrun(redis_url, run_id, nproc, *args, max_restarts=0):
    """Run the DDP example under torchrun; the CompletedProcess (text)."""
    env = {**os.environ, "RUNBUS_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1"}
    for name in ("RUNBUS_RUN_ID", "RUNBUS_LABEL", "RUNBUS_CONSOLE", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        run_id,
        "--max-restarts",
        str(max_restarts),
        "--monitor-interval",
        "0.2",
        str(EXAMPLE),
        "--steps",
        str(STEPS),
        "--system-interval",
        "0.5",
        *args,
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=100)


def test_ddp_example_under_torchrun(redis_url, store_url):
    result = torchrun(redis_url, "ddp-4", 4)
    assert result.returncode == 0, result.stderr[-3000:]
    ingest(redis_url, store_url)
    run = read_store(store_url, "run", "ddp-4")
    assert (run.state, run.primary, run.exit_code) == ("finished", "rank0", 0)
    assert [(lab.label, lab.primary, lab.state, lab.missing) for lab in run.labels] == [
        (f"rank{r}", r == 0, "finished", 0) for r in range(4)
    ]
    assert run.config["backend"] in ("gloo", "nccl") and run.config["world_size"] == 4
    assert run.labels[2].start["world_size"] == 4 and run.labels[2].start["rank"] == 2

    points = read_store(store_url, "metrics", "ddp-4")
    for rank in range(4):
        mine = collections.defaultdict(list)
        for p in points:
            if p.label == f"rank{rank}":
                mine[p.key].append(p.step)
        assert mine["loss"] == mine["lr"] == list(range(STEPS))
        assert mine["samples_per_s"] == [4, 9, 14, 19]
    losses = [p.value for p in points if p.key == "loss" and p.label == "rank0"]
    assert losses[-1] < losses[0]  # it learns

    systems = {p.label for p in read_store(store_url, "system", "ddp-4")}
    assert systems == {f"rank{r}" for r in range(4)}
    lines = read_store(store_url, "logs", "ddp-4")
    for rank in range(4):
        mine = [(line.stream, line.text) for line in lines if line.label == f"rank{rank}"]
        assert ("stdout", f"rank {rank} step 19") in [(s, t[: len(f"rank {rank} step 19")]) for s, t in mine]
        assert ("logging", f"rank {rank} done after {STEPS} steps") in mine
    assert not [line for line in lines if line.level == "ERROR"]

    # The terminal shows the primary's console only.
    assert "ddp_train: 4 ranks" in result.stdout and "rank 0 step 19" in result.stdout
    assert "rank 1 step" not in result.stdout + result.stderr
    assert "rank 0 done after" in result.stderr and "rank 3 done after" not in result.stderr
    logs = run_cli("--store", store_url, "logs", "ddp-4", "--label", "rank3", "--grep", "step 19").stdout
    assert logs.startswith("rank3 | ") and "rank 3 step 19 loss" in logs


def test_an_elastic_restart_continues_the_run(redis_url, store_url):
    fail_step = 5
    failing = ("--fail-rank", "1", "--fail-step", str(fail_step))
    result = torchrun(redis_url, "ddp-restart", 4, *failing, max_restarts=1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[rank1]" in result.stderr and "injected by --fail-rank" in result.stderr
    ingest(redis_url, store_url)
    run = read_store(store_url, "run", "ddp-restart")
    assert (run.state, run.primary, run.exit_code) == ("finished", "rank0", 0)
    assert [(lab.label, lab.state, lab.missing) for lab in run.labels] == [
        (f"rank{r}", "finished", 0) for r in range(4)
    ]
    assert [lab.start["restart_count"] for lab in run.labels] == [1] * 4

    # Each label has two epochs, the attempt that failed and the restart, the restart's higher.
    loss = collections.defaultdict(list)
    for p in read_store(store_url, "metrics", "ddp-restart", key="loss"):
        loss[(p.label, p.epoch)].append(p.step)
    epochs = {f"rank{r}": sorted(e for label, e in loss if label == f"rank{r}") for r in range(4)}
    assert all(
        len(pair) == 2 and pair[1] == lab.epoch for pair, lab in zip(epochs.values(), run.labels, strict=True)
    )
    # The first epoch kept what every rank logged before the failure; the second is the whole run.
    assert loss[("rank1", epochs["rank1"][0])] == list(range(fail_step + 1))
    for rank in range(4):
        first, second = epochs[f"rank{rank}"]
        assert loss[(f"rank{rank}", second)] == list(range(STEPS))
        assert loss[(f"rank{rank}", first)] == list(range(len(loss[(f"rank{rank}", first)])))

    failure = read_store(store_url, "logs", "ddp-restart", label="rank1", level="ERROR")
    assert {line.epoch for line in failure} == {epochs["rank1"][0]}
    assert failure[-1].text == f"RuntimeError: rank 1 fails at step {fail_step} (injected by --fail-rank)"
    started = read_store(store_url, "logs", "ddp-restart", label="rank1", grep="attempt ")
    attempts = [line.text for line in started]
    assert [text.rsplit(", ", 1)[-1] for text in attempts] == ["attempt 0", "attempt 1"]
