"""What a label runs on, for its `start` event: host, Python, torch and GPUs; never raises.

Keys: `host`, `cpu_count`, `memory_total_mb`, `platform`, `python_version`, `argv` (its
secrets redacted: runbus.redact.redact_argv), `gpus`
(a list of `{"index", "name", "memory_total_mb"}`, NVML indices), and, when they can be read,
`torch_version` (only if the program already imported torch), `driver_version` and
`cuda_version` (the newest CUDA the driver supports, "12.4"). A figure that cannot be read is
left out rather than guessed; `gpus` is empty without NVML.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import sys
from collections.abc import Callable
from typing import Any

from runbus.producer.system import MB, parse_visible_devices
from runbus.redact import redact_argv

logger = logging.getLogger("runbus.producer")


def describe(gpu_device_ids: list[int] | None = None) -> dict[str, Any]:
    """The `start` event's hardware fields; `gpu_device_ids` are NVML indices (None: visible)."""
    info: dict[str, Any] = {}
    readers: tuple[tuple[str, Callable[[], Any]], ...] = (
        ("host", socket.gethostname),
        ("cpu_count", os.cpu_count),
        ("memory_total_mb", _memory_total_mb),
        ("platform", platform.platform),
        ("python_version", platform.python_version),
        ("argv", lambda: redact_argv(sys.argv)),
        ("torch_version", _torch_version),
    )
    for key, read in readers:
        try:
            value = read()
        except Exception as exc:  # best effort: what cannot be read is left out, never fails init
            logger.debug("runbus: cannot read %s: %s", key, exc)
            continue
        if value is not None:
            info[key] = value
    info.update(_gpus(gpu_device_ids))
    return info


def _memory_total_mb() -> float:
    import psutil

    return psutil.virtual_memory().total / MB


def _torch_version() -> str | None:
    # Importing torch here would cost seconds in programs that do not use it.
    version = getattr(sys.modules.get("torch"), "__version__", None)
    return None if version is None else str(version)


def _text(value: str | bytes) -> str:
    # pynvml before 11.5 returns bytes.
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _gpus(gpu_device_ids: list[int] | None) -> dict[str, Any]:
    try:
        import pynvml
    except Exception as exc:  # best effort: what cannot be read is left out, never fails init
        logger.debug("runbus: no GPU description: pynvml is not importable (%s)", exc)
        return {"gpus": []}
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # best effort: what cannot be read is left out, never fails init
        logger.debug("runbus: no GPU description: NVML did not start (%s)", exc)
        return {"gpus": []}
    # nvmlInit/nvmlShutdown are reference-counted, so this pair leaves a sampler's NVML alone.
    try:
        return _describe_gpus(pynvml, gpu_device_ids)
    except Exception as exc:  # best effort: what cannot be read is left out, never fails init
        logger.debug("runbus: GPU description failed: %s", exc)
        return {"gpus": []}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception as exc:  # best effort: what cannot be read is left out, never fails init
            logger.debug("runbus: NVML shutdown failed: %s", exc)


def _describe_gpus(nvml: Any, gpu_device_ids: list[int] | None) -> dict[str, Any]:
    info: dict[str, Any] = {}
    try:
        info["driver_version"] = _text(nvml.nvmlSystemGetDriverVersion())
    except Exception as exc:  # best effort: what cannot be read is left out, never fails init
        logger.debug("runbus: no driver version: %s", exc)
    try:
        cuda = int(nvml.nvmlSystemGetCudaDriverVersion())
        info["cuda_version"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
    except Exception as exc:  # best effort: what cannot be read is left out, never fails init
        logger.debug("runbus: no CUDA version: %s", exc)
    indices = gpu_device_ids
    if indices is None:
        indices = parse_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if indices is None:
        indices = list(range(nvml.nvmlDeviceGetCount()))
    gpus: list[dict[str, Any]] = []
    for index in indices:
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:  # best effort: what cannot be read is left out, never fails init
            logger.debug("runbus: GPU %s cannot be opened: %s", index, exc)
            continue
        gpu: dict[str, Any] = {"index": int(index)}
        try:
            gpu["name"] = _text(nvml.nvmlDeviceGetName(handle))
        except Exception as exc:  # best effort: what cannot be read is left out, never fails init
            logger.debug("runbus: GPU %s has no name: %s", index, exc)
        try:
            gpu["memory_total_mb"] = nvml.nvmlDeviceGetMemoryInfo(handle).total / MB
        except Exception as exc:  # best effort: what cannot be read is left out, never fails init
            logger.debug("runbus: GPU %s has no memory size: %s", index, exc)
        gpus.append(gpu)
    info["gpus"] = gpus
    return info
