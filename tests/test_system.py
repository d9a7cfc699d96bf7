"""System sampling and the hardware description: real psutil; NVML faked only at pynvml itself."""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import subprocess
import sys
import threading
import time
import types
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from runbus import wire
from runbus.producer import hardware, system
from runbus.producer.system import SystemSampler, default_sampler_ids_from_env, parse_visible_devices
from runbus.redact import redact_argv

MIB = 1 << 20
GIB = 1 << 30
ROOT = Path(__file__).resolve().parent.parent
PROC_KEYS = {"proc.cpu_percent", "proc.rss_mb", "proc.threads"}
MEMORY_KEYS = {"sys.memory_percent", "sys.memory_used_mb"}
RATE_KEYS = {"sys.disk_read_mb_s", "sys.disk_write_mb_s", "sys.net_sent_mb_s", "sys.net_recv_mb_s"}


class FakeNVMLError(Exception):
    """Stands in for pynvml.NVMLError."""


@dataclass
class FakeGPU:
    name: str | bytes = "NVIDIA H100 80GB HBM3"
    util: int = 87
    used: int = 30 * GIB
    total: int = 80 * GIB
    temp: int = 64
    power_mw: int = 312_500
    sm_clock: int = 1980
    processes: list[tuple[int, int | None]] = field(default_factory=list)


@dataclass
class FakeNVML:
    """The pynvml functions the producer calls, over fixed GPUs; counts calls, fails on demand."""

    gpus: list[FakeGPU]
    init_error: bool = False
    failing: set[tuple[int, str]] = field(default_factory=set)
    calls: Counter[str] = field(default_factory=Counter)
    opened: list[int] = field(default_factory=list)

    def module(self) -> types.ModuleType:
        module = types.ModuleType("pynvml")
        module.NVMLError = FakeNVMLError
        module.NVML_TEMPERATURE_GPU = 0
        module.NVML_CLOCK_SM = 1
        for name in (
            "nvmlInit",
            "nvmlShutdown",
            "nvmlDeviceGetCount",
            "nvmlDeviceGetHandleByIndex",
            "nvmlDeviceGetUtilizationRates",
            "nvmlDeviceGetMemoryInfo",
            "nvmlDeviceGetTemperature",
            "nvmlDeviceGetPowerUsage",
            "nvmlDeviceGetClockInfo",
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetName",
            "nvmlSystemGetDriverVersion",
            "nvmlSystemGetCudaDriverVersion",
        ):
            setattr(module, name, self._counted(name, getattr(self, name)))
        return module

    def _counted(self, name: str, function: Callable) -> Callable:
        def call(*args):
            self.calls[name] += 1
            return function(*args)

        return call

    def _gpu(self, handle: tuple[str, int], query: str) -> FakeGPU:
        assert self.calls["nvmlInit"] > self.calls["nvmlShutdown"], f"{query} without nvmlInit"
        if (handle[1], query) in self.failing:
            raise FakeNVMLError(f"{query} not supported")
        return self.gpus[handle[1]]

    def nvmlInit(self) -> None:
        if self.init_error:
            raise FakeNVMLError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> tuple[str, int]:
        if not 0 <= index < len(self.gpus):
            raise FakeNVMLError("Invalid Argument")
        self.opened.append(index)
        return ("handle", index)

    def nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(gpu=self._gpu(handle, "utilization").util, memory=12)

    def nvmlDeviceGetMemoryInfo(self, handle):
        gpu = self._gpu(handle, "memory")
        return types.SimpleNamespace(total=gpu.total, used=gpu.used, free=gpu.total - gpu.used)

    def nvmlDeviceGetTemperature(self, handle, sensor: int) -> int:
        assert sensor == 0
        return self._gpu(handle, "temperature").temp

    def nvmlDeviceGetPowerUsage(self, handle) -> int:
        return self._gpu(handle, "power").power_mw

    def nvmlDeviceGetClockInfo(self, handle, clock: int) -> int:
        assert clock == 1
        return self._gpu(handle, "clock").sm_clock

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        processes = self._gpu(handle, "processes").processes
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in processes]

    def nvmlDeviceGetName(self, handle) -> str | bytes:
        return self._gpu(handle, "name").name

    def nvmlSystemGetDriverVersion(self) -> str:
        if (-1, "driver") in self.failing:
            raise FakeNVMLError("Unknown Error")
        return "550.54.15"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 12040


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> Callable[..., FakeNVML]:
    """Install a fake pynvml: nvml(gpus=4, failing=..., init_error=...)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def install(gpus: int | list[FakeGPU] = 2, **kw) -> FakeNVML:
        fake = FakeNVML([FakeGPU() for _ in range(gpus)] if isinstance(gpus, int) else gpus, **kw)
        monkeypatch.setitem(sys.modules, "pynvml", fake.module())
        return fake

    return install


@pytest.fixture
def sampler() -> Iterator[Callable[..., SystemSampler]]:
    """Build samplers that are closed after the test."""
    built: list[SystemSampler] = []

    def build(*args, **kw) -> SystemSampler:
        built.append(SystemSampler(*args, **kw))
        return built[-1]

    yield build
    for each in built:
        each.close()


@pytest.fixture
def debug_log(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    """The DEBUG messages of runbus.producer so far."""
    caplog.set_level(logging.DEBUG, logger="runbus.producer")

    def messages() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name == "runbus.producer" and r.levelno == logging.DEBUG
        ]

    return messages


def gpu_figures(figures: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in figures.items() if k.startswith("gpu.")}


def gpu_indices(figures: dict[str, float]) -> set[int]:
    return {int(k.split(".")[1]) for k in gpu_figures(figures)}


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


# --- process and machine figures (real psutil) -------------------------------------------------


def test_process_figures_are_this_process(sampler, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    s = sampler(machine_wide=False)
    busy(0.3)
    stop = threading.Event()
    waiter = threading.Thread(target=stop.wait)
    waiter.start()
    try:
        figures = s.sample()
        threads_now = psutil.Process().num_threads()
    finally:
        stop.set()
        waiter.join()
    assert set(figures) == PROC_KEYS
    assert figures["proc.cpu_percent"] > 20  # 0.3 s of spinning since construction
    assert figures["proc.rss_mb"] == pytest.approx(psutil.Process().memory_info().rss / MIB, rel=0.2)
    assert figures["proc.threads"] == threads_now >= 2


def test_process_figures_of_another_pid(sampler, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == b"ready\n"  # done starting: its memory holds still
        figures = sampler(machine_wide=False, pid=child.pid).sample()
        assert figures["proc.threads"] == psutil.Process(child.pid).num_threads()
        rss = psutil.Process(child.pid).memory_info().rss / MIB
        assert figures["proc.rss_mb"] == pytest.approx(rss, rel=0.2)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


def test_process_gone_gives_no_process_figures(sampler, monkeypatch, debug_log) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    s = sampler(machine_wide=True, pid=child.pid)
    s.sample()
    figures = s.sample()
    assert not PROC_KEYS & set(figures)
    assert set(figures) >= MEMORY_KEYS
    assert sum("no process figures" in m for m in debug_log()) == 1


def test_machine_figures_and_rates(sampler, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    payload = b"x" * (20 * MIB)
    with socket.create_server(("127.0.0.1", 0)) as server:
        started = time.monotonic()
        s = sampler(machine_wide=True)
        with socket.create_connection(server.getsockname()) as client:
            peer, _ = server.accept()
            with peer:
                reader = threading.Thread(target=lambda: _drain(peer, len(payload)))
                reader.start()
                client.sendall(payload)
                reader.join()
        # CPU times advance in clock ticks (10 ms): a faster transfer than one tick would leave
        # no interval to compute sys.cpu_percent from, and the sampler rightly omits it then.
        time.sleep(0.05)
        used_before = psutil.virtual_memory().used / MIB
        figures = s.sample()
        used_after = psutil.virtual_memory().used / MIB
        elapsed = time.monotonic() - started
    keys = PROC_KEYS | MEMORY_KEYS | {"sys.cpu_percent", "sys.net_sent_mb_s", "sys.net_recv_mb_s"}
    if psutil.disk_io_counters() is not None:
        keys |= {"sys.disk_read_mb_s", "sys.disk_write_mb_s"}
    assert set(figures) == keys
    # Loopback traffic counts both ways; other traffic on the host only adds to it.
    assert figures["sys.net_sent_mb_s"] >= 20 / elapsed
    assert figures["sys.net_recv_mb_s"] >= 20 / elapsed
    assert 0 <= figures["sys.cpu_percent"] <= 100
    assert 0 < figures["sys.memory_percent"] < 100
    # Bracketed by readings just before and after: other processes come and go meanwhile.
    low, high = sorted((used_before, used_after))
    assert low * 0.9 <= figures["sys.memory_used_mb"] <= high * 1.1
    assert all(figures[k] >= 0 for k in RATE_KEYS & keys)


def _drain(connection: socket.socket, size: int) -> None:
    while size > 0:
        size -= len(connection.recv(1 << 20))


def test_loopback_bytes_count_as_sent_and_as_received() -> None:
    """Why sys.net_sent_mb_s equals sys.net_recv_mb_s on a host whose traffic is loopback: the
    kernel counts each loopback byte on lo's transmit and its receive side (a real property,
    read here from the real counters), and the sampler sums every interface."""
    payload = b"x" * (20 * MIB)
    before = psutil.net_io_counters(pernic=True)["lo"]
    with (
        socket.create_server(("127.0.0.1", 0)) as server,
        socket.create_connection(server.getsockname()) as client,
    ):
        peer, _ = server.accept()
        with peer:
            reader = threading.Thread(target=lambda: _drain(peer, len(payload)))
            reader.start()
            client.sendall(payload)  # one way only: the reader sends nothing back
            reader.join()
    after = psutil.net_io_counters(pernic=True)["lo"]
    sent, received = after.bytes_sent - before.bytes_sent, after.bytes_recv - before.bytes_recv
    assert sent >= len(payload) and received >= len(payload)
    # Other processes' loopback traffic counts both ways too; only packets in flight differ.
    assert abs(sent - received) < 2 * MIB


def test_sent_and_received_rates_come_from_their_own_counters(sampler, monkeypatch) -> None:
    # psutil's totals given as a host with one-way traffic would show them (no real interface
    # here sends only one way): 8 MiB sent and 2 MiB received between two samples.
    monkeypatch.setitem(sys.modules, "pynvml", None)
    readings = iter([(0, 0), (8 * MIB, 2 * MIB)])

    def net_io_counters():
        sent, received = next(readings)
        return types.SimpleNamespace(bytes_sent=sent, bytes_recv=received)

    monkeypatch.setattr(psutil, "net_io_counters", net_io_counters)
    figures = sampler(machine_wide=True).sample()
    assert figures["sys.net_sent_mb_s"] == pytest.approx(4 * figures["sys.net_recv_mb_s"])
    assert figures["sys.net_recv_mb_s"] > 0


def test_no_elapsed_time_omits_rates(sampler, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(system, "time", types.SimpleNamespace(monotonic=lambda: 100.0))
    figures = sampler(machine_wide=True).sample()
    assert not RATE_KEYS & set(figures)
    assert set(figures) >= MEMORY_KEYS | PROC_KEYS


def test_only_the_machine_wide_label_has_machine_figures(sampler, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    time.sleep(0.05)
    assert not any(k.startswith("sys.") for k in sampler(machine_wide=False).sample())
    assert any(k.startswith("sys.") for k in sampler(machine_wide=True).sample())


def test_system_figures_are_valid_wire_data(sampler, nvml, decoder) -> None:
    fake = nvml(1)
    fake.gpus[0].processes = [(os.getpid(), 5 * MIB)]
    figures = sampler(machine_wide=True).sample()
    data = json.dumps(figures).encode()
    fields = wire.encode_fields("system", "run-1", "rank0", 1, 1, time.time(), data, None)
    flat = [
        part
        for k, v in fields.items()
        for part in (k.encode(), v if isinstance(v, bytes) else str(v).encode())
    ]
    # One sample, and a stream of them (which the ingester's fast path decodes by columns).
    [event] = decoder(wire.stream_key("run-1", "rank0"), [flat])
    assert isinstance(event, wire.Event) and event.data == figures
    assert decoder(wire.stream_key("run-1", "rank0"), [flat] * 10) == [event] * 10
    assert "gpu.0.proc_mem_mb" in event.data


# --- GPU figures (fake pynvml) ------------------------------------------------------------------


def test_gpu_figures_exact_keys_and_units(sampler, nvml) -> None:
    fake = nvml(2)
    me = os.getpid()
    fake.gpus[0].processes = [(me + 1, 4 * GIB), (me, 512 * MIB)]
    fake.gpus[1].processes = [(me, None)]  # the driver cannot tell (WDDM): no figure, not a 0
    fake.gpus[1].util, fake.gpus[1].power_mw, fake.gpus[1].temp = 3, 71_250, 41
    figures = sampler(machine_wide=False).sample()
    assert gpu_figures(figures) == {
        "gpu.0.util": 87,
        "gpu.0.mem_used_mb": 30 * 1024.0,
        "gpu.0.mem_total_mb": 80 * 1024.0,
        "gpu.0.temp_c": 64,
        "gpu.0.power_w": 312.5,
        "gpu.0.sm_clock_mhz": 1980,
        "gpu.0.proc_mem_mb": 512.0,
        "gpu.1.util": 3,
        "gpu.1.mem_used_mb": 30 * 1024.0,
        "gpu.1.mem_total_mb": 80 * 1024.0,
        "gpu.1.temp_c": 41,
        "gpu.1.power_w": 71.25,
        "gpu.1.sm_clock_mhz": 1980,
    }
    assert set(figures) - set(gpu_figures(figures)) == PROC_KEYS


def test_process_not_on_gpu_has_no_proc_mem(sampler, nvml) -> None:
    fake = nvml(1)
    fake.gpus[0].processes = [(os.getpid() + 1, GIB)]
    figures = sampler(machine_wide=False).sample()
    assert "gpu.0.proc_mem_mb" not in figures
    assert figures["gpu.0.util"] == 87


def test_pid_option_picks_that_process_gpu_memory(sampler, nvml) -> None:
    fake = nvml(1)
    fake.gpus[0].processes = [(os.getppid(), 3 * GIB), (os.getpid(), GIB)]
    figures = sampler(machine_wide=False, pid=os.getppid()).sample()
    assert figures["gpu.0.proc_mem_mb"] == 3 * 1024.0


def test_failing_query_drops_only_that_figure_and_logs_once(sampler, nvml, debug_log) -> None:
    fake = nvml(2, failing={(1, "power"), (0, "processes")})
    s = sampler(machine_wide=False)
    first, second = s.sample(), s.sample()
    expected = {
        f"gpu.{i}.{name}"
        for i in (0, 1)
        for name in ("util", "mem_used_mb", "mem_total_mb", "temp_c", "power_w", "sm_clock_mhz")
    } - {"gpu.1.power_w"}
    assert set(gpu_figures(first)) == set(gpu_figures(second)) == expected
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 4  # still asked every sample
    logged = debug_log()
    assert sum("GPU 1 gives no power" in m for m in logged) == 1
    assert sum("GPU 0 gives no process memory" in m for m in logged) == 1


def test_gpu_device_ids_pick_gpus(sampler, nvml, monkeypatch) -> None:
    fake = nvml(4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # explicit ids win over the environment
    figures = sampler(machine_wide=False, gpu_device_ids=[1, 3]).sample()
    assert gpu_indices(figures) == {1, 3}
    assert fake.opened == [1, 3]


@pytest.mark.parametrize(
    ("visible", "expected"),
    [("2,3", {2, 3}), (" 1 , 0 ", {0, 1}), ("GPU-5d3c2a1b-aaaa", {0, 1, 2, 3}), ("1,-1,2", {1})],
)
def test_cuda_visible_devices_narrows_default_gpus(sampler, nvml, monkeypatch, visible, expected) -> None:
    fake = nvml(4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    figures = sampler(machine_wide=True).sample()
    assert gpu_indices(figures) == expected
    assert sorted(fake.opened) == sorted(expected)


def test_no_visible_gpu_never_starts_nvml(sampler, nvml, monkeypatch, debug_log) -> None:
    fake = nvml(4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    s = sampler(machine_wide=True)
    s.sample()
    assert not gpu_figures(s.sample())
    assert fake.calls["nvmlInit"] == 0
    assert debug_log() == ["runbus: no GPU figures: this label owns no GPU"]


def test_missing_gpu_index_is_skipped(sampler, nvml, debug_log) -> None:
    nvml(2)
    figures = sampler(machine_wide=False, gpu_device_ids=[1, 7]).sample()
    assert gpu_indices(figures) == {1}
    assert any("GPU 7 cannot be opened" in m for m in debug_log())


def test_host_without_gpus_logs_once(sampler, nvml, debug_log) -> None:
    nvml(0)
    s = sampler(machine_wide=True)
    assert not gpu_figures(s.sample())
    assert not gpu_figures(s.sample())
    assert debug_log() == ["runbus: no GPU figures: NVML sees none of GPUs (all)"]


def test_nvml_init_failure_falls_back_with_one_debug_log(sampler, nvml, debug_log) -> None:
    fake = nvml(2, init_error=True)
    s = sampler(machine_wide=True)
    figures = [s.sample() for _ in range(3)]
    assert all(not gpu_figures(f) and set(f) >= PROC_KEYS | MEMORY_KEYS for f in figures)
    assert fake.calls["nvmlInit"] == 1
    assert debug_log() == ["runbus: no GPU figures: NVML did not start (Driver Not Loaded)"]
    s.close()
    assert fake.calls["nvmlShutdown"] == 0


def test_missing_pynvml_falls_back_with_one_debug_log(sampler, monkeypatch, debug_log) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    s = sampler(machine_wide=False)
    assert set(s.sample()) == set(s.sample()) == PROC_KEYS
    logged = debug_log()
    assert len(logged) == 1
    assert logged[0].startswith("runbus: no GPU figures: pynvml is not installed")


def test_close_shuts_nvml_down_once(nvml) -> None:
    fake = nvml(1)
    s = SystemSampler(machine_wide=False)
    assert gpu_figures(s.sample())
    s.close()
    s.close()
    assert fake.calls["nvmlInit"] == fake.calls["nvmlShutdown"] == 1
    figures = s.sample()
    assert not gpu_figures(figures)
    assert set(figures) == PROC_KEYS
    assert fake.calls["nvmlInit"] == 1


def test_close_before_any_sample_touches_nothing(nvml) -> None:
    fake = nvml(1)
    SystemSampler(machine_wide=True).close()
    assert fake.calls["nvmlInit"] == fake.calls["nvmlShutdown"] == 0


# --- who samples what ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", []),
        ("3", [3]),
        ("4,5, 6", [4, 5, 6]),
        ("0,2,-1,1", [0, 2]),
        ("1,1,2", [1]),
        ("2,bogus,3", [2]),
        ("GPU-8f6c,GPU-1a2b", None),
        ("MIG-0c3d", None),
        ("-1", []),
    ],
)
def test_parse_visible_devices(value, expected) -> None:
    assert parse_visible_devices(value) == expected


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, (True, None)),
        ({"LOCAL_RANK": "0"}, (True, [0])),
        ({"LOCAL_RANK": "3"}, (False, [3])),
        ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, (True, None)),
        ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, (False, [5])),
        ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "6"}, (False, [6])),
        ({"LOCAL_RANK": "2", "CUDA_VISIBLE_DEVICES": ""}, (False, [])),
        ({"LOCAL_RANK": "5", "CUDA_VISIBLE_DEVICES": "0,1"}, (False, [])),
        ({"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "GPU-8f6c,GPU-1a2b"}, (True, None)),
        ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "GPU-8f6c,GPU-1a2b"}, (False, [])),
        ({"LOCAL_RANK": "x"}, (False, [])),
    ],
)
def test_default_sampler_ids_from_env(env, expected) -> None:
    assert default_sampler_ids_from_env(env) == expected


def test_default_sampler_ids_read_os_environ(monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert default_sampler_ids_from_env() == (False, [2])


@pytest.mark.parametrize(
    "visible",
    [
        lambda rank: None,  # torchrun on a 4-GPU host: rank r uses cuda:r
        lambda rank: str(rank),  # a launcher that narrows each rank to its GPU
        lambda rank: "0,1,2,3",  # the same list for every rank
        lambda rank: "GPU-a,GPU-b,GPU-c,GPU-d",  # UUIDs: the machine-wide label charts them all
    ],
    ids=["unset", "narrowed", "shared-list", "uuids"],
)
def test_ranks_of_a_host_chart_every_gpu_once(nvml, monkeypatch, visible) -> None:
    nvml(4)
    labels: list[dict[str, float]] = []
    for rank in range(4):
        env = {"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "4"}
        if visible(rank) is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible(rank)
        machine_wide, ids = default_sampler_ids_from_env(env)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        s = SystemSampler(machine_wide, ids)
        try:
            labels.append(s.sample())
        finally:
            s.close()
    charted = [gpu_indices(figures) for figures in labels]
    assert sorted(i for each in charted for i in each) == [0, 1, 2, 3]
    machine_wide = [any(k.startswith("sys.") for k in figures) for figures in labels]
    assert machine_wide == [True, False, False, False]
    assert all(set(figures) >= PROC_KEYS for figures in labels)


# --- hardware.describe -------------------------------------------------------------------------


def test_describe_with_gpus(nvml, monkeypatch) -> None:
    fake = nvml([FakeGPU(), FakeGPU(name=b"Tesla V100-SXM2-16GB", total=16 * GIB)])
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    info = hardware.describe()
    assert info == {
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "memory_total_mb": psutil.virtual_memory().total / MIB,
        "platform": platform.platform(),
        "python_version": platform.python_version(),
        "argv": redact_argv(sys.argv),
        "gpus": [
            {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_total_mb": 81920.0},
            {"index": 1, "name": "Tesla V100-SXM2-16GB", "memory_total_mb": 16384.0},
        ],
        "driver_version": "550.54.15",
        "cuda_version": "12.4",
    }
    assert json.loads(json.dumps(info, allow_nan=False)) == info
    assert fake.calls["nvmlInit"] == fake.calls["nvmlShutdown"] == 1


def test_describe_selects_gpus_like_the_sampler(nvml, monkeypatch) -> None:
    nvml(4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert [g["index"] for g in hardware.describe()["gpus"]] == [2, 3]
    assert [g["index"] for g in hardware.describe([1, 9])["gpus"]] == [1]


def test_describe_reports_torch_only_if_already_imported(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert "torch_version" not in hardware.describe()
    assert "torch" not in sys.modules
    torch = types.ModuleType("torch")
    torch.__version__ = "2.13.0+cu128"
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert hardware.describe()["torch_version"] == "2.13.0+cu128"


def test_describe_without_nvml(nvml, monkeypatch) -> None:
    nvml(2, init_error=True)
    info = hardware.describe()
    assert info["gpus"] == []
    assert "driver_version" not in info
    assert "cuda_version" not in info
    assert info["cpu_count"] == os.cpu_count()
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert hardware.describe()["gpus"] == []


def test_describe_never_raises(nvml, monkeypatch) -> None:
    fake = nvml(2, failing={(-1, "driver"), (1, "name"), (0, "memory")})

    def no_hostname() -> str:
        raise OSError("no hostname")

    monkeypatch.setattr(hardware.socket, "gethostname", no_hostname)
    info = hardware.describe()
    assert "host" not in info
    assert "driver_version" not in info
    assert info["cuda_version"] == "12.4"
    assert info["gpus"] == [
        {"index": 0, "name": "NVIDIA H100 80GB HBM3"},
        {"index": 1, "memory_total_mb": 81920.0},
    ]
    assert fake.calls["nvmlShutdown"] == 1


# --- the real NVML and import cost --------------------------------------------------------------


def test_real_nvml() -> None:
    """Runs where a driver answers (GPU hosts); skipped where nvmlInit fails."""
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        pytest.skip(f"NVML does not start here: {exc}")
    try:
        count = pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    if count == 0:
        pytest.skip("NVML starts but sees no GPU")
    s = SystemSampler(machine_wide=True, gpu_device_ids=[0])
    try:
        s.sample()
        figures = s.sample()
    finally:
        s.close()
    assert 0 <= figures["gpu.0.util"] <= 100
    assert figures["gpu.0.mem_total_mb"] > 0
    assert 0 <= figures["gpu.0.mem_used_mb"] <= figures["gpu.0.mem_total_mb"]
    assert gpu_indices(figures) == {0}
    info = hardware.describe([0])
    assert info["gpus"][0]["index"] == 0
    assert info["gpus"][0]["name"]
    assert info["gpus"][0]["memory_total_mb"] == figures["gpu.0.mem_total_mb"]
    assert info["driver_version"]
    assert info["cuda_version"].count(".") == 1


def test_import_does_not_load_nvml_or_torch() -> None:
    code = (
        "import runbus.producer.system, runbus.producer.hardware, sys; "
        "heavy = {'pynvml', 'torch', 'numpy'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_secret_options_are_redacted_from_the_command_line():
    argv = ["train.py", "--api-key", "abc", "--TOKEN=xyz", "--lr", "0.1", "--db-password=pw", "--keys-file"]
    assert redact_argv(argv) == [
        "train.py",
        "--api-key",
        "***",
        "--TOKEN=***",
        "--lr",
        "0.1",
        "--db-password=***",
        "--keys-file",
    ]
