"""The checks that need an NVIDIA GPU (issue #24), as one script for a GPU machine: the real NVML
sampler, a DDP job over NCCL timed by run.watch() against the GPU's own clock, and a rank hung on
the GPU (a kernel that never ends) judged live by `runbus ingest`.

Each part runs in a subprocess of its own (a CUDA context, an NCCL group) and reports a JSON
object; a part that fails reports its error and the others still run. NCCL takes one GPU per
rank, so on a one-GPU machine its jobs have one rank; the multi-rank hangs run over gloo with
CUDA tensors (bench/faults.py with DEVICE=cuda).

    python bench/gpu.py [--parts nvml,logcost,example,watch,hang,faults] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

from common import emit, live_store

from runbus.ingester.localredis import free_port
from tests.helpers import QUIET

EXAMPLE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "ddp_train.py"
)

# One rank of an NCCL job (world 1). MODE=watch: STEPS steps of an MLP under DDP with
# run.watch(), each step also timed on the GPU by CUDA events. MODE=hang: at HANG_STEP the rank
# launches a kernel that spins for HANG_S, as a rank stuck on its GPU would, and the loop goes on
# until it blocks on the device.
NCCL_RANK = textwrap.dedent(
    """
    import json, os, pickle, sys, threading, time
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    import runbus

    mode, steps, width = os.environ["MODE"], int(os.environ["STEPS"]), int(os.environ["WIDTH"])
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    run = runbus.init(system_interval=1.0, git=False, console="all", config={"mode": mode})
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)
    ).cuda()
    ddp = DistributedDataParallel(model, device_ids=[0])
    if mode == "watch":
        run.watch(ddp, every_n_steps=10)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    events, walls = [], []

    def dump_flight_recorder():
        time.sleep(float(os.environ["DUMP_AFTER"]))
        try:
            trace = pickle.loads(torch._C._distributed_c10d._dump_nccl_trace())
            entries = trace.get("entries", [])[-4:]
            keep = ("collective_seq_id", "profiling_name", "state", "time_created_ns",
                    "time_discovered_started_ns", "time_discovered_completed_ns")
            found = [{k: e.get(k) for k in keep} for e in entries]
        except Exception as exc:
            found = repr(exc)
        with open(os.environ["FR_FILE"], "w") as out:
            json.dump(found, out, default=str)

    for step in range(steps):
        began = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        x = torch.randn(64, width, device="cuda")
        start.record()
        loss = ddp(x).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        end.record()
        events.append((start, end))
        if mode == "hang" and step == int(os.environ["HANG_STEP"]):
            with open(os.environ["FAULT_FILE"], "w") as out:
                out.write(repr(time.time()))
            threading.Thread(target=dump_flight_recorder, daemon=True).start()
            torch.cuda._sleep(int(float(os.environ["HANG_S"]) * 2e9))  # ~2 GHz: cycles
        run.log({"loss": loss.detach()}, step=step)
        if step % 10 == 9:
            print(f"step {step} loss {loss.item():.5f}", flush=True)  # waits for the device
        walls.append(time.perf_counter() - began)
    torch.cuda.synchronize()
    gpu_s = [s.elapsed_time(e) / 1000 for s, e in events[5:]]
    print("TRUTH " + json.dumps({"gpu_step_s": sorted(gpu_s)[len(gpu_s) // 2],
                                 "wall_step_s": sorted(walls[5:])[len(walls[5:]) // 2]}), flush=True)
    run.finish()
    dist.destroy_process_group()
    """
)


def read_number(path: str) -> float | None:
    """The number a job wrote to `path`, or None before it did."""
    try:
        with open(path) as found:
            return float(found.read())
    except (OSError, ValueError):
        return None


def read_json(path: str) -> Any:
    try:
        with open(path) as found:
            return json.load(found)
    except (OSError, ValueError):
        return None


def nccl_job(redis_url: str, run_id: str, mode: str, **env: str) -> subprocess.Popen[str]:
    job = {
        **os.environ,
        "RUNBUS_REDIS_URL": redis_url,
        "RUNBUS_RUN_ID": run_id,
        "RUNBUS_QUIET": "1",
        "MODE": mode,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_ENABLE_TIMING": "1",
        **env,
    }
    output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    return subprocess.Popen([sys.executable, "-c", NCCL_RANK], env=job, **output)  # type: ignore[call-overload]


class GpuLoad:
    """bf16 matrix products on the GPU in a thread, so NVML has something to read."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, daemon=True)

    def _work(self) -> None:
        import torch

        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        while not self._stop.is_set():
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()

    def __enter__(self) -> GpuLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def nvml_part() -> dict[str, Any]:
    """The real sampler: its figures under load and idle, and its CPU time per sample."""
    from runbus.producer import hardware
    from runbus.producer.system import SystemSampler

    sampler = SystemSampler(machine_wide=True, gpu_device_ids=[0])
    try:
        sampler.sample()
        idle = sampler.sample()
        with GpuLoad():
            time.sleep(3)
            cpu, wall = [], []
            for _ in range(50):
                c, w = time.thread_time(), time.perf_counter()
                busy = sampler.sample()
                cpu.append(time.thread_time() - c)
                wall.append(time.perf_counter() - w)
                time.sleep(0.02)
    finally:
        sampler.close()
    return {
        "idle": {k: v for k, v in idle.items() if k.startswith("gpu.")},
        "busy": {k: v for k, v in busy.items() if k.startswith("gpu.")},
        "sample_cpu_ms_median": round(statistics.median(cpu) * 1e3, 3),
        "sample_wall_ms_median": round(statistics.median(wall) * 1e3, 3),
        "hardware": hardware.describe([0]),
    }


def log_cost_part(redis_url: str) -> dict[str, Any]:
    """log() of a CUDA loss: its median time on the training thread (a copy to pinned memory and
    an event queued), beside a float's, while the GPU computes."""
    import torch

    import runbus

    loss = torch.randn(1024, 1024, device="cuda").pow(2).mean()
    results: dict[str, Any] = {}
    with runbus.init(run_id="gpu-logcost", label="rank0", redis_url=redis_url, **QUIET) as run:
        for name, value in (("float", 0.5), ("cuda_tensor", loss)):
            times = []
            for step in range(3000):
                began = time.perf_counter()
                run.log({"loss": value}, step=step)
                times.append(time.perf_counter() - began)
            results[f"{name}_median_us"] = round(statistics.median(times[500:]) * 1e6, 2)
    results["dropped"] = run.dropped
    # Its parts: what log() did before (a device copy, read later by the shipper with .item(),
    # which waits for the GPU) beside what it does now (a copy to pinned memory and an event).
    from runbus.producer.devicevalues import PendingValue, recorded_event

    parts = {
        "clone": lambda: loss.detach().clone(),
        "pending_value": lambda: PendingValue(loss),
        "to_pinned": lambda: loss.detach().to("cpu", non_blocking=True),
        "event": lambda: recorded_event(loss.device),
    }
    for name, call in parts.items():
        times = []
        for _ in range(3000):
            began = time.perf_counter()
            call()
            times.append(time.perf_counter() - began)
        results[f"{name}_median_us"] = round(statistics.median(times[500:]) * 1e6, 2)
    return results


async def wait_ended(store: Any, run_id: str, within: float) -> str | None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        run = await store.run(run_id)
        if run is not None and run.state != "running":
            return str(run.state)
        await asyncio.sleep(0.2)
    return None


def truth_of(output: str) -> dict[str, Any]:
    for line in output.splitlines():
        if line.startswith("TRUTH "):
            return dict(json.loads(line[len("TRUTH ") :]))
    return {"output_tail": output[-2000:]}


async def example_part(store: Any, redis_url: str, tmp: str) -> dict[str, Any]:
    """examples/ddp_train.py under torchrun, on the GPU (NCCL, one rank a GPU)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "gpu-example", EXAMPLE,
        "--steps", "50", "--system-interval", "1",
    ]  # fmt: skip
    env = {**os.environ, "RUNBUS_REDIS_URL": redis_url}
    result = await asyncio.to_thread(
        subprocess.run, command, env=env, capture_output=True, text=True, timeout=180
    )
    return {
        "exit_code": result.returncode,
        "run_state": await wait_ended(store, "gpu-example", 60),
        "stdout_tail": result.stdout[-800:],
        "stderr_tail": result.stderr[-800:],
    }


async def watch_part(store: Any, redis_url: str, tmp: str) -> dict[str, Any]:
    """run.watch() on an NCCL DDP model: its perf/* beside the GPU's own time per step."""
    from runbus.query.notebook import Api

    job = nccl_job(redis_url, "gpu-watch", "watch", STEPS="200", WIDTH="4096")
    output, _ = await asyncio.to_thread(job.communicate, timeout=240)
    state = await wait_ended(store, "gpu-watch", 60)
    with Api(f"sqlite:///{tmp}/runbus.db") as api:
        frame = api.run("gpu-watch").history()
        system = api.run("gpu-watch").system()
    perf = frame[frame["key"].str.startswith("perf/")].groupby("key", observed=True)["value"].median()
    gpu = system[system["key"].str.startswith("gpu.")].groupby("key", observed=True)["value"].max()
    return {
        "exit_code": job.returncode,
        "run_state": state,
        "truth": truth_of(output),
        "watch_medians": {k: round(float(v), 6) for k, v in perf.items()},
        "system_gpu_max": {k: round(float(v), 3) for k, v in gpu.items()},
    }


async def hang_part(store: Any, redis_url: str, tmp: str, wait_s: float) -> dict[str, Any]:
    """A rank stuck on its GPU: the verdicts `runbus ingest` reaches, the rank's beat, and what
    NCCL's flight recorder says of its last collectives."""
    fault_file, fr_file = os.path.join(tmp, "gpu-hang.fault"), os.path.join(tmp, "gpu-hang.fr")
    job = nccl_job(
        redis_url, "gpu-hang", "hang", STEPS="100000", WIDTH="1024", HANG_STEP="60", HANG_S="600",
        FAULT_FILE=fault_file, FR_FILE=fr_file, DUMP_AFTER="8",
    )  # fmt: skip
    verdicts: list[dict[str, Any]] = []
    try:
        began = time.monotonic()
        while (at := read_number(fault_file)) is None:
            if time.monotonic() - began > 120 or job.poll() is not None:
                at = time.time()  # never injected: the verdicts say what the job did instead
                break
            await asyncio.sleep(0.2)
        while time.time() - at < wait_s:
            health = await store.health("gpu-hang") or {}
            brief = {
                "state": health.get("state"),
                "note": health.get("note"),
                "culprits": [(c["label"], c["reason"]) for c in health.get("culprits") or []],
            }
            if not verdicts or verdicts[-1]["verdict"] != brief:
                verdicts.append({"after_s": round(time.time() - at, 1), "verdict": brief})
            await asyncio.sleep(0.5)
        beats = [
            {"label": v.label, "beat": v.beat}
            for r in await store.health_inputs()
            if r.run_id == "gpu-hang"
            for v in r.labels
        ]
    finally:
        job.kill()
        output, _ = job.communicate(timeout=30)
    flight = read_json(fr_file)
    return {"verdicts": verdicts, "beats": beats, "flight_recorder": flight, "output_tail": output[-1500:]}


def faults_part(out: str) -> dict[str, Any]:
    """bench/faults.py at 8 ranks with their models and all_reduces on the GPU (gloo)."""
    command = [
        sys.executable, os.path.join(os.path.dirname(__file__), "faults.py"),
        "--worlds", "8", "--repeats", "1", "--kinds", "loader,sigstop", "--healthy", "", "--wait", "40",
    ]  # fmt: skip
    result = subprocess.run(
        command, env={**os.environ, "DEVICE": "cuda"}, capture_output=True, text=True, timeout=300
    )
    return {
        "exit_code": result.returncode,
        "stdout_tail": result.stdout[-3000:],
        "stderr_tail": result.stderr[-1500:],
    }


async def live_parts(parts: list[str], wait_s: float) -> dict[str, Any]:
    results: dict[str, Any] = {}
    async with live_store("runbus-gpu-") as (tmp, redis_url, store):
        if "logcost" in parts:
            results["logcost"] = await asyncio.to_thread(log_cost_part, redis_url)
            print("logcost", results["logcost"], file=sys.stderr, flush=True)
        for name, part in (("example", example_part), ("watch", watch_part), ("hang", hang_part)):
            if name not in parts:
                continue
            try:
                args = (store, redis_url, tmp) + ((wait_s,) if name == "hang" else ())
                results[name] = await part(*args)  # type: ignore[operator]
            except Exception as exc:  # one part's failure is reported, the others still run
                results[name] = {"error": repr(exc)}
            print(name, json.dumps(results[name], default=str)[:4000], file=sys.stderr, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="nvml,logcost,example,watch,hang,faults")
    parser.add_argument("--hang-wait", type=float, default=40.0, help="seconds the hung rank is watched")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    parts = args.parts.split(",")
    results: dict[str, Any] = {}
    if "nvml" in parts:
        try:
            results["nvml"] = nvml_part()
        except Exception as exc:
            results["nvml"] = {"error": repr(exc)}
        print("nvml", json.dumps(results["nvml"], default=str)[:3000], file=sys.stderr, flush=True)
    results.update(asyncio.run(live_parts(parts, args.hang_wait)))
    if "faults" in parts:
        results["faults"] = faults_part(args.out)
    emit("gpu", results)
    with open(os.path.join(args.out, "gpu.json"), "w") as out:
        json.dump(results, out, default=str, indent=1)


if __name__ == "__main__":
    main()
