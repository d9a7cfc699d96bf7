"""System figures for `system` events: this process, its host, and the GPUs its label owns.

Who charts what, so that the ranks of a host never draw the same chart twice:

- `proc.*` (`cpu_percent`, `rss_mb`, `threads`): every label, for its own process.
- `sys.*` (`cpu_percent`, `memory_percent`, `memory_used_mb`, `disk_read_mb_s`,
  `disk_write_mb_s`, `net_sent_mb_s`, `net_recv_mb_s`): only the machine-wide label, the lowest
  local rank of a host (LOCAL_RANK unset or "0").
- `gpu.{i}.*` (`util`, `mem_used_mb`, `mem_total_mb`, `temp_c`, `power_w`, `sm_clock_mhz`,
  `proc_mem_mb`): `i` is the NVML index, which names one GPU the same way in every process of a
  host. Each GPU is charted by the label of the local rank that uses it, as
  `default_sampler_ids_from_env` decides:
  - LOCAL_RANK unset, or LOCAL_WORLD_SIZE is 1: the one process owns every visible GPU.
  - CUDA_VISIBLE_DEVICES narrows this rank to one index (or none): that one.
  - CUDA_VISIBLE_DEVICES lists several indices: the LOCAL_RANK-th of them (torchrun's
    `cuda:LOCAL_RANK`); unset: GPU LOCAL_RANK.
  - CUDA_VISIBLE_DEVICES names GPUs by UUID or MIG id, which no index can be derived from
    without NVML: the machine-wide label charts every GPU, the other ranks none.
  GPUs outside the job (visible beyond the local world size) are not charted: they are another
  job's or idle. An explicit `gpu_device_ids` overrides all of this.

Units: MB is MiB (2**20 bytes), as nvidia-smi counts. `proc.cpu_percent` counts one core as 100;
`sys.cpu_percent` is 0..100 over all cores. Rates and CPU percentages cover the time since the
previous `sample()`; the counters are read once at construction, so the first sample already
covers the time since then. A sample with no measurable time since the last omits the rates.

`gpu.{i}.proc_mem_mb` is present only while NVML lists this pid on that GPU: it is absent before
the process creates a CUDA context there, and inside a PID namespace (a container without
--pid=host), where NVML reports host pids and a 0 would be a lie.

Without NVML (pynvml missing, no driver) or without GPUs the sampler gives the rest and says so
once at DEBUG; a query one GPU refuses (e.g. power on a MIG slice) drops only that figure.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("runbus.producer")

MB = float(1 << 20)


def parse_visible_devices(value: str | None) -> list[int] | None:
    """The GPU indices a CUDA_VISIBLE_DEVICES value leaves visible, or None if it cannot narrow.

    None when unset or when it names GPUs by UUID/MIG id. CUDA stops at the first invalid entry
    (a negative or repeated index), so this does too: "" and "-1" hide every GPU.
    """
    if value is None:
        return None
    indices: list[int] = []
    for entry in value.split(","):
        entry = entry.strip()
        try:
            index = int(entry)
        except ValueError:
            if not indices and entry:
                return None
            break
        if index < 0 or index in indices:
            break
        indices.append(index)
    return indices


def default_sampler_ids_from_env(
    env: Mapping[str, str] | None = None,
) -> tuple[bool, list[int] | None]:
    """(machine_wide, gpu_device_ids) for this process, following the rule in the docstring.

    `env` defaults to os.environ; gpu_device_ids None means every visible GPU.
    """
    env = os.environ if env is None else env
    local_rank = env.get("LOCAL_RANK")
    machine_wide = local_rank in (None, "0")
    if local_rank is None or env.get("LOCAL_WORLD_SIZE") == "1":
        return machine_wide, None
    cuda_visible = env.get("CUDA_VISIBLE_DEVICES")
    visible = parse_visible_devices(cuda_visible)
    if visible is not None and len(visible) <= 1:
        return machine_wide, visible
    if cuda_visible is not None and visible is None:
        return machine_wide, (None if machine_wide else [])
    try:
        rank = int(local_rank)
    except ValueError:
        return machine_wide, []
    if rank < 0:
        return machine_wide, []
    if visible is None:
        return machine_wide, [rank]
    return machine_wide, visible[rank : rank + 1]


def _cpu_busy_and_total(times: Any) -> tuple[float, float]:
    # psutil's own formula (guest time is already inside user/nice; iowait is idle), computed
    # here because psutil.cpu_percent() keeps its "previous" reading in shared per-thread state.
    total = sum(times) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)
    return total - times.idle - getattr(times, "iowait", 0.0), total


def _rate(now: float, before: float, elapsed: float) -> float:
    # A device or interface that disappears makes a machine-wide counter go down; clamp.
    return max(0.0, now - before) / elapsed / MB


def _gpu_util(nvml: Any, handle: Any, pid: int) -> dict[str, float]:
    return {"util": nvml.nvmlDeviceGetUtilizationRates(handle).gpu}


def _gpu_memory(nvml: Any, handle: Any, pid: int) -> dict[str, float]:
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    return {"mem_used_mb": memory.used / MB, "mem_total_mb": memory.total / MB}


def _gpu_temperature(nvml: Any, handle: Any, pid: int) -> dict[str, float]:
    return {"temp_c": nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)}


def _gpu_power(nvml: Any, handle: Any, pid: int) -> dict[str, float]:
    return {"power_w": nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0}


def _gpu_sm_clock(nvml: Any, handle: Any, pid: int) -> dict[str, float]:
    return {"sm_clock_mhz": nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)}


def _gpu_process_memory(nvml: Any, handle: Any, pid: int) -> dict[str, float]:
    used = [p.usedGpuMemory for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == pid]
    # usedGpuMemory is None where the driver cannot tell (Windows WDDM).
    if not used or None in used:
        return {}
    return {"proc_mem_mb": sum(used) / MB}


_GPU_READINGS: tuple[tuple[str, Callable[[Any, Any, int], dict[str, float]]], ...] = (
    ("utilization", _gpu_util),
    ("memory", _gpu_memory),
    ("temperature", _gpu_temperature),
    ("power", _gpu_power),
    ("sm clock", _gpu_sm_clock),
    ("process memory", _gpu_process_memory),
)


@dataclass(eq=False)
class SystemSampler:
    """Reads the figures of one label; `sample()` is called from the producer's thread.

    `gpu_device_ids` are NVML indices; None means the GPUs CUDA_VISIBLE_DEVICES (read now) leaves
    visible, or all. `pid` defaults to this process.
    """

    machine_wide: bool
    gpu_device_ids: list[int] | None = None
    pid: int = field(default_factory=os.getpid)
    _psutil: Any = field(init=False, repr=False)
    _process: Any = field(init=False, repr=False, default=None)
    _visible: list[int] | None = field(init=False, repr=False, default=None)
    _last_time: float = field(init=False, repr=False, default=0.0)
    _last_cpu: tuple[float, float] | None = field(init=False, repr=False, default=None)
    _last_disk: tuple[float, float] | None = field(init=False, repr=False, default=None)
    _last_net: tuple[float, float] | None = field(init=False, repr=False, default=None)
    _nvml: Any = field(init=False, repr=False, default=None)
    _nvml_tried: bool = field(init=False, repr=False, default=False)
    _gpus: list[tuple[int, Any]] = field(init=False, repr=False, default_factory=list)
    _logged: set[str] = field(init=False, repr=False, default_factory=set)
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        import psutil

        self._psutil = psutil
        if self.gpu_device_ids is not None:
            self.gpu_device_ids = list(self.gpu_device_ids)
        else:
            self._visible = parse_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
        try:
            self._process = psutil.Process(self.pid)
            self._process.cpu_percent(None)  # starts its interval; the first reading is 0
        except psutil.Error as exc:
            self._log_once("process", "runbus: no process figures for pid %s: %s", self.pid, exc)
            self._process = None
        self._last_time = time.monotonic()
        if self.machine_wide:
            self._read_machine_counters()

    def sample(self) -> dict[str, float]:
        """The figures since the previous call (or construction); never raises for a missing one."""
        with self._lock:
            now = time.monotonic()
            elapsed = now - self._last_time
            self._last_time = now
            figures: dict[str, float] = {}
            self._sample_process(figures)
            if self.machine_wide:
                self._sample_machine(figures, elapsed)
            self._sample_gpus(figures)
            return figures

    def close(self) -> None:
        """Shut NVML down if this sampler started it; later samples carry no GPU figures."""
        with self._lock:
            nvml, self._nvml, self._nvml_tried = self._nvml, None, True
            self._gpus = []
            if nvml is not None:
                try:
                    nvml.nvmlShutdown()
                except nvml.NVMLError as exc:
                    logger.debug("runbus: NVML shutdown failed: %s", exc)

    def _log_once(self, topic: str, message: str, *args: object) -> None:
        if topic not in self._logged:
            self._logged.add(topic)
            logger.debug(message, *args)

    def _sample_process(self, figures: dict[str, float]) -> None:
        process = self._process
        if process is None:
            return
        try:
            with process.oneshot():
                cpu = process.cpu_percent(None)
                rss = process.memory_info().rss
                threads = process.num_threads()
        except self._psutil.Error as exc:
            self._log_once("process", "runbus: no process figures for pid %s: %s", self.pid, exc)
            return
        figures["proc.cpu_percent"] = cpu
        figures["proc.rss_mb"] = rss / MB
        figures["proc.threads"] = threads

    def _read_machine_counters(self) -> tuple[Any, Any, Any]:
        """Store fresh machine counters; return the previous (cpu, disk, net) readings."""
        psutil = self._psutil
        cpu = disk = net = None
        try:
            cpu = _cpu_busy_and_total(psutil.cpu_times())
            disk = psutil.disk_io_counters()  # None where the host exposes no disks
            net = psutil.net_io_counters()
        except (psutil.Error, OSError) as exc:
            self._log_once("machine", "runbus: machine counters unreadable: %s", exc)
        before = (self._last_cpu, self._last_disk, self._last_net)
        self._last_cpu = cpu
        self._last_disk = None if disk is None else (disk.read_bytes, disk.write_bytes)
        self._last_net = None if net is None else (net.bytes_sent, net.bytes_recv)
        return before

    def _sample_machine(self, figures: dict[str, float], elapsed: float) -> None:
        cpu_before, disk_before, net_before = self._read_machine_counters()
        cpu, disk, net = self._last_cpu, self._last_disk, self._last_net
        try:
            memory = self._psutil.virtual_memory()
        except (self._psutil.Error, OSError) as exc:
            self._log_once("memory", "runbus: machine memory unreadable: %s", exc)
        else:
            figures["sys.memory_percent"] = memory.percent
            figures["sys.memory_used_mb"] = memory.used / MB
        if cpu is not None and cpu_before is not None and cpu[1] > cpu_before[1]:
            busy = 100.0 * (cpu[0] - cpu_before[0]) / (cpu[1] - cpu_before[1])
            figures["sys.cpu_percent"] = min(100.0, max(0.0, busy))
        if elapsed <= 0:
            return
        if disk is not None and disk_before is not None:
            figures["sys.disk_read_mb_s"] = _rate(disk[0], disk_before[0], elapsed)
            figures["sys.disk_write_mb_s"] = _rate(disk[1], disk_before[1], elapsed)
        if net is not None and net_before is not None:
            figures["sys.net_sent_mb_s"] = _rate(net[0], net_before[0], elapsed)
            figures["sys.net_recv_mb_s"] = _rate(net[1], net_before[1], elapsed)

    def _start_nvml(self) -> None:
        self._nvml_tried = True
        if self.gpu_device_ids == [] or self._visible == []:
            logger.debug("runbus: no GPU figures: this label owns no GPU")
            return
        try:
            import pynvml
        except ImportError as exc:
            logger.debug("runbus: no GPU figures: pynvml is not installed (%s)", exc)
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            logger.debug("runbus: no GPU figures: NVML did not start (%s)", exc)
            return
        self._nvml = pynvml
        self._gpus = list(self._open_gpus(pynvml))
        if not self._gpus:
            logger.debug("runbus: no GPU figures: NVML sees none of GPUs %s", self._wanted())

    def _wanted(self) -> list[int] | str:
        if self.gpu_device_ids is not None:
            return self.gpu_device_ids
        return "(all)" if self._visible is None else self._visible

    def _open_gpus(self, nvml: Any) -> Iterable[tuple[int, Any]]:
        indices: Iterable[int] | None = self.gpu_device_ids
        if indices is None:
            indices = self._visible
        if indices is None:
            try:
                indices = range(nvml.nvmlDeviceGetCount())
            except nvml.NVMLError as exc:
                logger.debug("runbus: NVML cannot count GPUs: %s", exc)
                return
        for index in indices:
            try:
                yield index, nvml.nvmlDeviceGetHandleByIndex(index)
            except nvml.NVMLError as exc:
                logger.debug("runbus: GPU %d cannot be opened: %s", index, exc)

    def _sample_gpus(self, figures: dict[str, float]) -> None:
        if not self._nvml_tried:
            self._start_nvml()
        nvml = self._nvml
        if nvml is None:
            return
        for index, handle in self._gpus:
            for what, read in _GPU_READINGS:
                try:
                    values = read(nvml, handle, self.pid)
                except nvml.NVMLError as exc:
                    self._log_once(f"gpu.{index}.{what}", "runbus: GPU %d gives no %s: %s", index, what, exc)
                    continue
                for name, value in values.items():
                    figures[f"gpu.{index}.{name}"] = value


def sampled_devices(gpu_device_ids: tuple[int, ...] | None) -> tuple[bool, list[int] | None]:
    """(machine-wide figures?, the GPUs this label samples): the given ids, else by LOCAL_RANK."""
    machine_wide, gpu_ids = default_sampler_ids_from_env(os.environ)
    if gpu_device_ids is not None:
        gpu_ids = list(gpu_device_ids)
    return machine_wide, gpu_ids
