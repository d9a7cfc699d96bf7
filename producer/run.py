"""A Run: one label of a run, as training code sees it. `log()` is the hot path.

Everything `log()` does is check values and append to the outbox; serialising happens on the
shipper thread and network I/O on its courier, so an absent, paused or full Redis never holds up
the training loop. Only when the training loop outruns encoding, or shipping to a Redis that
answers, does `log()` wait for room in the outbox, and never more than about 100 ms for Redis.
What `log()` accepts, the ingester accepts: what it would refuse raises at `log()` instead.
Run metadata (`run.config`, `run.summary`, `run.name`, `run.tags`) goes through the same outbox as
`meta` events, checked first (runbus.producer.metadata).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from runbus import wire
from runbus.errors import RunFinished
from runbus.producer import exits
from runbus.producer.backlog import DropLog
from runbus.producer.devicevalues import DeviceMetrics, PendingValue
from runbus.producer.environment import Identity
from runbus.producer.metadata import RunValues, checked_name, checked_tags
from runbus.producer.outbox import Outbox
from runbus.producer.shipper import Shipper, ShipperOptions, encode_data

if TYPE_CHECKING:
    from runbus.producer.child import ChildLabel
    from runbus.producer.console import ConsoleCapture
    from runbus.producer.watch import ModelWatch

log = logging.getLogger("runbus.producer")

MAX_KEY_LENGTH = wire.MAX_KEY_LENGTH
MIN_SYSTEM_INTERVAL = 0.5
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
STEP_END = 2**63
# Metric names checked once are remembered (per Run), so that log() checks a dict's names in one
# C-level subset test; past this many distinct names, new ones are checked on every call.
MAX_KNOWN_NAMES = 100_000
# The most bytes one metric can take in an event's data: a name of MAX_KEY_LENGTH characters
# each escaped as \u00XX, its quotes, a colon, a comma and the widest number
# (-2.2250738585072014e-308). Up to this many metrics an event cannot reach wire.MAX_DATA_BYTES,
# so only bigger dicts are measured.
_WIDEST_NUMBER = -2.2250738585072014e-308
_MAX_METRIC_BYTES = 6 * MAX_KEY_LENGTH + 4 + 24
MAX_UNMEASURED_METRICS = (wire.MAX_DATA_BYTES - 2) // _MAX_METRIC_BYTES


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


def _metric_int(key: str, value: int) -> int:
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(
            f"metric {key!r}: an int of {value.bit_length()} bits does not fit in 64 bits "
            "(log float(value) to store it as a float)"
        )
    return value


def _metric_value(key: str, value: Any) -> Any:
    """A loggable number from `value`, or TypeError / ValueError; accelerator tensors are kept
    for the shipper."""
    if type(value) is bool:
        return int(value)
    if isinstance(value, float):  # subclasses: numpy.float64
        return float(value)
    if isinstance(value, int):  # subclasses: IntEnum
        return _metric_int(key, int(value))
    item = getattr(value, "item", None)
    if item is not None:
        if getattr(value, "dim", None) is not None:  # a torch.Tensor
            return _tensor_value(key, value)
        if getattr(value, "ndim", 0) == 0 or getattr(value, "size", 0) == 1:  # numpy scalar/array
            return _metric_value(key, _read(key, item))
    raise TypeError(
        f"metric {key!r}: {type(value).__name__} is not a number "
        "(log ints, floats, bools, 0-d tensors or numpy scalars)"
    )


def _read(key: str, item: Any) -> Any:
    try:
        return item()
    except Exception as exc:  # whatever the value's own .item() raises: one TypeError for the caller
        raise TypeError(f"metric {key!r}: the value cannot be read ({type(exc).__name__}: {exc})") from None


def _tensor_value(key: str, value: Any) -> Any:
    """A CPU tensor's number, or a device tensor's copy for the shipper to read (shape, dtype and
    device are metadata: reading them does not wait for the device)."""
    if value.dim() != 0 and value.numel() != 1:
        raise TypeError(f"metric {key!r}: tensor of shape {tuple(value.shape)} is not a scalar")
    if value.is_complex():
        raise TypeError(f"metric {key!r}: a complex tensor is not a number")
    device = value.device.type
    if device == "meta" or _is_fake(value):
        raise TypeError(f"metric {key!r}: a tensor on the {device!r} device has no value to log")
    if device == "cpu":
        return _metric_value(key, _read(key, value.item))
    if device == "cuda":  # read once the GPU computed it, never waiting (runbus.producer.devicevalues)
        return PendingValue(value)
    # On another accelerator `.item()` would wait for the device: the shipper reads it. The copy
    # (queued on the device, no wait) keeps the value an in-place update would change.
    return value.detach().clone()


def _is_fake(value: Any) -> bool:
    """A FakeTensor (torch.compile's tracing): it has a device but no data."""
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    return fake is not None and isinstance(value, fake.FakeTensor)


def _metric_name(key: Any) -> str:
    if not isinstance(key, str):
        raise TypeError(f"metric names must be strings, not {type(key).__name__} {key!r}")
    if not 0 < len(key) <= MAX_KEY_LENGTH:
        raise ValueError(f"metric name {key[:40]!r} must have 1 to {MAX_KEY_LENGTH} characters")
    if not key.isascii():
        try:
            key.encode()
        except UnicodeEncodeError:
            raise ValueError(f"metric name {key[:40]!r} is not valid UTF-8 (a lone surrogate)") from None
    # A str subclass (a StrEnum member) as a plain str: orjson takes only str keys.
    return key if type(key) is str else str.__str__(key)


def checked_metrics(metrics: Mapping[str, Any], known_names: set[str] | None = None) -> dict[str, Any]:
    """`metrics` as a fresh dict of loggable values; TypeError / ValueError say what is wrong.
    Names found valid are added to `known_names` (up to MAX_KNOWN_NAMES)."""
    if not isinstance(metrics, Mapping):
        raise TypeError(f"log() takes a dict of metrics, not {type(metrics).__name__}")
    if not metrics:
        raise ValueError("log() needs at least one metric")
    known = set() if known_names is None else known_names
    checked = {}
    pending = False
    for key, value in metrics.items():
        name = key if type(key) is str and key in known else _metric_name(key)
        checked[name] = number = _metric_value(name, value)
        pending = pending or type(number) is PendingValue
        if len(known) < MAX_KNOWN_NAMES:
            known.add(name)
    if len(checked) > MAX_UNMEASURED_METRICS:
        check_encoded_size(checked)
    return DeviceMetrics(checked) if pending else checked


def check_encoded_size(metrics: dict[str, Any]) -> None:
    """ValueError when `metrics` (checked values) would encode to more than wire.MAX_DATA_BYTES
    (device tensors count as the widest number: their value is read later)."""
    bound = 2 + 6 * sum(map(len, metrics)) + (4 + 24) * len(metrics)
    if bound <= wire.MAX_DATA_BYTES:
        return
    plain = {k: v if type(v) is float or type(v) is int else _WIDEST_NUMBER for k, v in metrics.items()}
    size = len(encode_data("metric", plain).encode())
    if size > wire.MAX_DATA_BYTES:
        raise ValueError(
            f"{len(metrics)} metrics encode to {size} bytes, over the {wire.MAX_DATA_BYTES} bytes "
            "one event may hold: log them in several calls"
        )


def checked_step(step: Any) -> int:
    """`step` as an int from 0 to 2**63 - 1, or TypeError / ValueError."""
    if isinstance(step, bool) or not isinstance(step, int):
        item = getattr(step, "item", None)
        if item is None or isinstance(step, bool):
            raise TypeError(f"step must be an int, not {type(step).__name__}")
        if getattr(step, "dim", None) is not None and (step.device.type == "meta" or _is_fake(step)):
            raise TypeError(f"step: a tensor on the {step.device.type!r} device has no value")
        try:
            step = item()
        except Exception as exc:  # whatever the step's own .item() raises: one TypeError for the caller
            raise TypeError(f"step: the value cannot be read ({type(exc).__name__}: {exc})") from None
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, not {type(step).__name__}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step >= STEP_END:
        raise ValueError(f"step must be < 2**63 (it is stored as a 64-bit int), got {step.bit_length()} bits")
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
        naming: dict[str, Any] | None = None,
        describe_git: bool = True,
    ) -> None:
        self.identity = identity
        self.options = options
        self._outbox = Outbox(options.max_buffer_events, DropLog())
        self._put = self._outbox.put
        self._known_names: set[str] = set()
        self._finished = False
        self._complete = False
        self._forked = False
        self._finish_lock = threading.Lock()
        self._shipper = Shipper(identity, self._outbox, shipper_options)
        self._shipper.describe_hardware = describe_hardware
        self._shipper.describe_git = describe_git
        self._shipper.gpu_device_ids = options.gpu_device_ids
        self._shipper.watched_thread = threading.get_ident()
        self._sampler: _SamplerThread | None = None
        self._console: ConsoleCapture | None = None
        self._watches: list[ModelWatch] = []
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
                "launcher": identity.launcher,
                "config": config,
            },
        )
        self._config = RunValues(self, "config", config)
        self._summary = RunValues(self, "summary")
        naming = naming or {}
        self._name: str | None = naming.get("name")
        self._tags: tuple[str, ...] = tuple(naming.get("tags", ()))
        if naming:
            self._put("meta", None, dict(naming))

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
        """Events dropped (their seqs show as explained gaps): every buffer was full while Redis
        was away, or a device tensor's value could not be read."""
        return self._outbox.drops.count + self._outbox.unnumbered_drops

    @property
    def buffered(self) -> int:
        """Events not yet shipped to Redis (queued, in memory, or spooled)."""
        return self._shipper.unshipped

    @property
    def finished(self) -> bool:
        return self._finished

    # -- run metadata ------------------------------------------------------------------------------

    @property
    def config(self) -> RunValues:
        """This label's config: read it like a dict; `run.config.update({...})` or
        `run.config[key] = value` add to it (see runbus.producer.metadata)."""
        return self._config

    @property
    def summary(self) -> RunValues:
        """This label's summary (final values: the last write of a key wins): read it like a
        dict; `run.summary[key] = value` or `run.summary.update({...})` set it."""
        return self._summary

    @property
    def name(self) -> str | None:
        """The run's name as this label last set it (None if it never did)."""
        return self._name

    @name.setter
    def name(self, name: str) -> None:
        name = checked_name(name)
        self._send_meta({"name": name})
        self._name = name

    @property
    def tags(self) -> tuple[str, ...]:
        """The run's tags as this label last set them; `run.tags = [...]` replaces them."""
        return self._tags

    @tags.setter
    def tags(self, tags: Any) -> None:
        self.set_tags(tags)

    def set_tags(self, tags: Any) -> None:
        """Replace the run's tags, as this label sets them (a list; [] clears them)."""
        checked = checked_tags(tags)
        self._send_meta({"tags": checked})
        self._tags = tuple(checked)

    def _send_meta(self, data: dict[str, Any]) -> None:
        """Put one meta event (checked values): never dropped; refused after finish()."""
        if self._finished:
            ident = self.identity
            raise RunFinished(
                f"run {ident.run_id}/{ident.label} has finished: its metadata can no longer change"
            )
        self._put("meta", None, data)

    # -- the hot path ------------------------------------------------------------------------------

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Record numeric metrics, optionally at a training step. Never does I/O.

        Raises TypeError / ValueError for what the ingester would refuse. Waits only when the
        outbox is full, for the shipper to take some (back-pressure), and never more than about
        100 ms for Redis: past it events go to the byte buffer (and spool); what finds those
        full while Redis is not taking events is dropped, counted.
        """
        if self._finished:
            raise RunFinished(f"run {self.identity.run_id}/{self.identity.label} has finished")
        if type(metrics) is dict and metrics and metrics.keys() <= self._known_names:
            for value in metrics.values():
                if type(value) is not float and (
                    type(value) is not int or not INT64_MIN <= value <= INT64_MAX
                ):
                    metrics = self._checked(metrics)
                    break
            else:
                if len(metrics) > MAX_UNMEASURED_METRICS:
                    check_encoded_size(metrics)
                metrics = metrics.copy()
        else:
            metrics = self._checked(metrics)
        if step is not None and (type(step) is not int or not 0 <= step < STEP_END):
            step = checked_step(step)
        self._put("metric", step, metrics)

    def _checked(self, metrics: Any) -> dict[str, Any]:
        """log()'s slower path (checked_metrics), which alone meets CUDA values: the first such
        event tells the outbox to look for values their GPU has not computed (none of it on the
        plain floats' path)."""
        checked = checked_metrics(metrics, self._known_names)
        if type(checked) is DeviceMetrics:
            self._outbox.holds_gpu_values = True
        return checked

    def log_text(self, text: str, level: str = "INFO", stream: str = "logging") -> None:
        """Record one line (or block) of text with a level name."""
        if self._finished:
            raise RunFinished(f"run {self.identity.run_id}/{self.identity.label} has finished")
        if not isinstance(text, str):
            raise TypeError(f"log_text() takes a str, not {type(text).__name__}")
        if stream not in wire.LOG_STREAMS:
            raise ValueError(f"stream must be one of {sorted(wire.LOG_STREAMS)}, not {stream!r}")
        data = {"stream": stream, "level": str(level), "text": str.__str__(text)}
        if not (text.isascii() and data["level"].isascii()) or 6 * (len(text) + len(data["level"])) > (
            wire.MAX_DATA_BYTES - 64
        ):
            try:
                size = len(encode_data("log", data))
            except TypeError:  # orjson refuses lone surrogates
                raise ValueError("log text is not valid UTF-8 (a lone surrogate)") from None
            if size > wire.MAX_DATA_BYTES:
                raise ValueError(f"log text encodes to {size} bytes, over the {wire.MAX_DATA_BYTES} limit")
        self._put("log", None, data)

    def child(self, label: str, **options: Any) -> ChildLabel:
        """A picklable handle for a child process to log into this run under its own `label`
        (never the primary): pass it to the child, which calls `.init()`."""
        from runbus.producer.child import ChildLabel

        return ChildLabel.of(self, label, options)

    def watch(self, model: Any, every_n_steps: int = 10, first_step: int = 0) -> ModelWatch:
        """Time `model`'s training steps on this rank and log the perf/* figures the framework
        integrations log (perf/step_s, perf/compute_s, perf/comm_wait_s, perf/data_wait_s, ...),
        the means over every `every_n_steps` steps, at the step of the window's last one (counted
        from `first_step`). On a DistributedDataParallel model, call it before the first step:
        it registers DDP's communication hook (the default all-reduce, timed), which a model
        takes once. The same model again returns its watch. See runbus.producer.watch; imports
        torch."""
        if self._finished:
            raise RunFinished(f"run {self.identity.run_id}/{self.identity.label} has finished")
        for watch in self._watches:
            if watch.model is model:
                return watch  # a model is timed once (and DDP takes one comm hook)
        from runbus.producer.watch import ModelWatch

        watch = ModelWatch(self, model, every_n_steps, first_step)
        self._watches.append(watch)
        return watch

    def logging_handler(self, level: int = logging.NOTSET) -> logging.Handler:
        """A logging.Handler that ships records as `log` events of this run."""
        from runbus.producer.handler import RunHandler

        return RunHandler(self, level)

    # -- the end -----------------------------------------------------------------------------------

    def finish(self, exit_code: int = 0, timeout: float | None = None) -> bool:
        """End this label: ship what is buffered, at most `timeout` seconds (default 30).

        Idempotent. Returns True when every event of the label reached Redis; False when any
        was dropped (`dropped`: buffers full while Redis was away, a device tensor that could
        not be read) or is left unshipped at the timeout (in the spool, if any, for the next
        init() of this run and label). The finish event is the label's last: nothing (no
        heartbeat, sample or console line) takes a later seq.
        """
        try:
            return self._finish(exit_code, timeout)
        finally:
            exits.safe_point()  # a SIGTERM that came during this finish is handled now

    def _finish(self, exit_code: int, timeout: float | None) -> bool:
        if isinstance(exit_code, bool) or not isinstance(exit_code, int):
            raise TypeError(f"exit_code must be an int, not {type(exit_code).__name__}")
        if not INT64_MIN <= exit_code <= INT64_MAX:
            raise ValueError("exit_code must fit in 64 bits")
        if self._forked:
            return False
        for watch in self._watches:
            watch.close()  # its last window's figures go before the finish
        with self._finish_lock:
            if self._finished:
                return self._complete  # False while another thread's finish() is under way
            self._finished = True
        timeout = self.options.finish_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        if self._sampler is not None:
            self._sampler.stop()
        if self._console is not None:
            self._console.stop()  # its last partial lines go before the finish event
        self._outbox.close({"exit_code": exit_code})
        self._shipper.stop(deadline)
        if self._shipper.is_alive():
            # A little past the deadline: the shipper spools what is left when it passes it.
            self._shipper.join(max(0.0, deadline - time.monotonic()) + 1.0)
        shipped_all = not self._shipper.is_alive() and not self._shipper.unshipped
        shipped_all = shipped_all and self._shipper.refused is None
        if shipped_all:
            self._shipper.release(exit_code)
        if not self._shipper.is_alive() and not self._shipper.unshipped:
            self._tell_keeper_finished()
        if self.dropped:
            log.warning("runbus: %d events were dropped (their seqs are reported as gaps)", self.dropped)
        self._complete = shipped_all and not self.dropped
        from runbus.producer import environment

        exits.forget(self)
        environment.withdraw_run_id(self.identity.run_id)
        return self._complete

    def _tell_keeper_finished(self) -> None:
        """Under `runbus run`: the finish is in Redis, so the console keeper stores no end."""
        from runbus.producer import bootstrap

        capture = bootstrap.current()
        if capture is not None:
            capture.note_finished(self.identity.run_id, self.identity.label)

    def _disown(self) -> None:
        """In a forked child: this Run belongs to the parent, so every call becomes a no-op."""
        self._forked = True
        self._put = _ignore

    def __enter__(self) -> Run:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        code = 0 if exc is None else exits.exit_code_of(exc)
        failed = exc is not None and not isinstance(exc, SystemExit)
        if failed and self._console is not None and not self._finished:
            # Python prints this traceback only after finish() has stopped the capture.
            self._console.record_exception(exc_type, exc, tb)
        self.finish(exit_code=code)

    def __repr__(self) -> str:
        ident = self.identity
        return f"<Run {ident.run_id}/{ident.label} primary={self.primary} epoch={self.epoch}>"

    def __reduce_ex__(self, protocol: object) -> Any:
        # A Run is this process's one live writer of its label (a lease, threads, a connection): a
        # copy in another process would be a second writer of the label, so none is ever made.
        ident = self.identity
        raise TypeError(
            f"a Run cannot be pickled: it is this process's live writer of run "
            f"{ident.run_id!r}, label {ident.label!r}. Pass another process "
            f'run.child("{ident.label}-worker") (a picklable ChildLabel: the process calls .init() '
            f"on it and logs under that label of its own), or the run id {ident.run_id!r} "
            f'(runbus.init(run_id=..., label="...") there)'
        )

    def __copy__(self) -> Run:
        return self  # the same writer: copying a model that holds its Run (EMA, SWA) keeps it

    def __deepcopy__(self, memo: dict[int, Any]) -> Run:
        return self


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


# A finish under way holds the Run's locks (and may be waiting for its finish to ship): a
# SIGTERM that interrupts it is handled once it returns.
exits.guard_signals(Run.finish, Run._finish)
