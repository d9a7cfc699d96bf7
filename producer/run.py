"""A Run: one label of a run, as training code sees it. `log()` is the hot path.

Everything `log()` does is check types and append to the outbox; serialising and network I/O
happen on the shipper thread, so a slow or absent Redis never slows the training loop.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runbus import wire
from runbus.errors import RunFinished
from runbus.producer.backlog import DropLog
from runbus.producer.environment import Identity
from runbus.producer.outbox import Outbox
from runbus.producer.shipper import Shipper, ShipperOptions

if TYPE_CHECKING:
    from runbus.producer.child import ChildLabel
    from runbus.producer.console import ConsoleCapture

log = logging.getLogger("runbus.producer")

_PLAIN_NUMBERS = frozenset({int, float})
MAX_KEY_LENGTH = 256
MIN_SYSTEM_INTERVAL = 0.5


def _ignore(kind: str, step: int | None, data: Any) -> None:
    return None


@dataclass(frozen=True, slots=True)
class RunOptions:
    """How a Run buffers, samples and finishes (set through runbus.init)."""

    max_buffer_events: int = 50_000
    system_interval: float | None = 15.0
    finish_timeout: float = 30.0
    gpu_device_ids: tuple[int, ...] | None = None
    console: str = "primary"


def _metric_value(key: str, value: Any) -> Any:
    """A loggable number from `value`, or TypeError; accelerator tensors are kept for the shipper."""
    if type(value) is bool:
        return int(value)
    if isinstance(value, (int, float)):  # subclasses: numpy.float64, IntEnum
        return float(value) if isinstance(value, float) else int(value)
    item = getattr(value, "item", None)
    if item is not None:
        dim = getattr(value, "dim", None)
        if dim is not None:  # a torch.Tensor: shape is metadata, reading it does not sync
            if dim() != 0 and value.numel() != 1:
                raise TypeError(f"metric {key!r}: tensor of shape {tuple(value.shape)} is not a scalar")
            if value.is_complex():
                raise TypeError(f"metric {key!r}: a complex tensor is not a number")
            if value.device.type == "cpu":
                return _metric_value(key, item())
            # On an accelerator `.item()` would wait for the device: the shipper reads it. The
            # copy (queued on the device, no wait) keeps the value an in-place update would change.
            return value.detach().clone()
        if getattr(value, "ndim", 0) == 0 or getattr(value, "size", 0) == 1:  # numpy scalar/array
            return _metric_value(key, item())
    raise TypeError(
        f"metric {key!r}: {type(value).__name__} is not a number "
        "(log ints, floats, bools, 0-d tensors or numpy scalars)"
    )


def checked_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """`metrics` as a fresh dict of loggable values; TypeError / ValueError say what is wrong."""
    if not isinstance(metrics, Mapping):
        raise TypeError(f"log() takes a dict of metrics, not {type(metrics).__name__}")
    if not metrics:
        raise ValueError("log() needs at least one metric")
    checked = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"metric names must be strings, not {type(key).__name__} {key!r}")
        if not 0 < len(key) <= MAX_KEY_LENGTH:
            raise ValueError(f"metric name {key[:40]!r} must have 1 to {MAX_KEY_LENGTH} characters")
        checked[key] = _metric_value(key, value)
    return checked


def checked_step(step: Any) -> int:
    """`step` as a non-negative int, or TypeError / ValueError."""
    if isinstance(step, bool) or not isinstance(step, int):
        item = getattr(step, "item", None)
        if item is None or isinstance(step, bool):
            raise TypeError(f"step must be an int, not {type(step).__name__}")
        step = item()
        if not isinstance(step, int):
            raise TypeError(f"step must be an int, not {type(step).__name__}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return int(step)


class Run:
    """One label's logging session; made by runbus.init()."""

    def __init__(
        self,
        identity: Identity,
        options: RunOptions,
        shipper_options: ShipperOptions,
        config: dict[str, Any],
        describe_hardware: bool = True,
    ) -> None:
        self.identity = identity
        self.options = options
        self._outbox = Outbox(options.max_buffer_events, DropLog())
        self._put = self._outbox.put
        self._finished = False
        self._forked = False
        self._finish_lock = threading.Lock()
        self._shipper = Shipper(identity, self._outbox, shipper_options)
        self._shipper.describe_hardware = describe_hardware
        self._shipper.gpu_device_ids = options.gpu_device_ids
        self._sampler: _SamplerThread | None = None
        self._console: ConsoleCapture | None = None
        self._put(
            "start",
            None,
            {
                "primary": identity.primary,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "rank": identity.rank,
                "local_rank": identity.local_rank,
                "world_size": identity.world_size,
                "restart_count": identity.restart_count,
                "config": config,
            },
        )

    def _begin(self) -> None:
        """Start the background threads (the handshake has been tried by then)."""
        self._shipper.start()
        if self.options.console != "off":
            from runbus.producer.console import ConsoleCapture

            self._console = ConsoleCapture.start_for(self, self.options.console)
        if self.options.system_interval:
            self._sampler = _SamplerThread(self, max(MIN_SYSTEM_INTERVAL, self.options.system_interval))
            self._sampler.start()

    # -- identity --------------------------------------------------------------------------------

    @property
    def run_id(self) -> str:
        return self.identity.run_id

    @property
    def label(self) -> str:
        return self.identity.label

    @property
    def primary(self) -> bool:
        return self._shipper.primary

    @property
    def epoch(self) -> int | None:
        """This process's epoch of its label (None until Redis has been reached)."""
        return self._shipper.epoch

    @property
    def stream(self) -> str:
        return self._shipper.key

    @property
    def dropped(self) -> int:
        """Events dropped because every buffer was full (their seqs show as explained gaps)."""
        return self._outbox.drops.count

    @property
    def buffered(self) -> int:
        """Events not yet shipped to Redis (queued, in memory, or spooled)."""
        return self._shipper.unshipped

    @property
    def finished(self) -> bool:
        return self._finished

    # -- the hot path ------------------------------------------------------------------------------

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Record numeric metrics, optionally at a training step. Never blocks, never does I/O."""
        if self._finished:
            raise RunFinished(f"run {self.identity.run_id}/{self.identity.label} has finished")
        if type(metrics) is not dict or not metrics:
            metrics = checked_metrics(metrics)
        else:
            for key, value in metrics.items():
                if (
                    type(value) not in _PLAIN_NUMBERS
                    or type(key) is not str
                    or not 0 < len(key) <= MAX_KEY_LENGTH
                ):
                    metrics = checked_metrics(metrics)
                    break
            else:
                metrics = metrics.copy()
        if step is not None and (type(step) is not int or step < 0):
            step = checked_step(step)
        self._put("metric", step, metrics)

    def log_text(self, text: str, level: str = "INFO", stream: str = "logging") -> None:
        """Record one line (or block) of text with a level name."""
        if self._finished:
            raise RunFinished(f"run {self.identity.run_id}/{self.identity.label} has finished")
        if not isinstance(text, str):
            raise TypeError(f"log_text() takes a str, not {type(text).__name__}")
        if stream not in wire.LOG_STREAMS:
            raise ValueError(f"stream must be one of {sorted(wire.LOG_STREAMS)}, not {stream!r}")
        if len(text) > wire.MAX_DATA_BYTES // 4 and len(text.encode()) > wire.MAX_DATA_BYTES - 1024:
            raise ValueError(
                f"log text of {len(text.encode())} bytes is over the {wire.MAX_DATA_BYTES} limit"
            )
        self._put("log", None, {"stream": stream, "level": str(level), "text": text})

    def child(self, label: str, **options: Any) -> ChildLabel:
        """A picklable handle for a child process to log into this run under its own `label`
        (never the primary): pass it to the child, which calls `.init()`."""
        from runbus.producer.child import ChildLabel

        return ChildLabel.of(self, label, options)

    def logging_handler(self, level: int = logging.NOTSET) -> logging.Handler:
        """A logging.Handler that ships records as `log` events of this run."""
        from runbus.producer.handler import RunHandler

        return RunHandler(self, level)

    # -- the end -----------------------------------------------------------------------------------

    def finish(self, exit_code: int = 0, timeout: float | None = None) -> bool:
        """End this label: ship what is buffered, at most `timeout` seconds (default 30).

        Idempotent. Returns whether everything was shipped in time.
        """
        if isinstance(exit_code, bool) or not isinstance(exit_code, int):
            raise TypeError(f"exit_code must be an int, not {type(exit_code).__name__}")
        if self._forked:
            return False
        with self._finish_lock:
            if self._finished:
                return not self._shipper.is_alive()
            self._finished = True
        timeout = self.options.finish_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        if self._sampler is not None:
            self._sampler.stop()
        if self._console is not None:
            self._console.stop()  # its last partial lines go before the finish event
        self._put("finish", None, {"exit_code": exit_code})
        self._shipper.stop(deadline)
        if self._shipper.is_alive():
            # A little past the deadline: the shipper spools what is left when it passes it.
            self._shipper.join(max(0.0, deadline - time.monotonic()) + 1.0)
        complete = not self._shipper.is_alive() and not self._shipper.unshipped
        complete = complete and self._shipper.refused is None
        if complete:
            self._shipper.release(exit_code)
        if self.dropped:
            log.warning("runbus: %d events were dropped (buffers full)", self.dropped)
        from runbus.producer import exits

        exits.forget(self)
        return complete

    def _disown(self) -> None:
        """In a forked child: this Run belongs to the parent, so every call becomes a no-op."""
        self._forked = True
        self._put = _ignore

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            code = 0
        elif isinstance(exc, SystemExit):
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        else:
            code = 1
            if self._console is not None and not self._finished:
                # Python prints this traceback only after finish() has stopped the capture.
                self._console.record_exception(exc_type, exc, tb)
        self.finish(exit_code=code)

    def __repr__(self) -> str:
        ident = self.identity
        return f"<Run {ident.run_id}/{ident.label} primary={self.primary} epoch={self.epoch}>"


class _SamplerThread(threading.Thread):
    """Puts a `system` event every interval (psutil, and NVML where there are GPUs)."""

    def __init__(self, run: Run, interval: float) -> None:
        super().__init__(name=f"runbus-sampler-{run.label}", daemon=True)
        self.run_ref = run
        self.interval = interval
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        from runbus.producer.system import SystemSampler, sampled_devices

        machine_wide, gpu_ids = sampled_devices(self.run_ref.options.gpu_device_ids)
        sampler = SystemSampler(machine_wide=machine_wide, gpu_device_ids=gpu_ids)
        try:
            while not self._stopping.wait(self.interval):
                figures = sampler.sample()
                if figures and not self.run_ref.finished:
                    self.run_ref._put("system", None, figures)
        except Exception as exc:  # sampling is best effort: training must never notice
            log.warning("runbus: system sampling stopped: %s", exc)
        finally:
            sampler.close()
