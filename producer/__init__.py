"""runbus producer: every rank of a distributed job logs into one run through Redis Streams.

    import runbus
    run = runbus.init(config={"lr": 3e-4})   # zero-config under torchrun
    run.log({"loss": 0.25}, step=10)           # never does I/O; never waits for an absent Redis
    run.config.update({"epochs": 3})           # run metadata: config, summary, name, tags
    run.summary["best_loss"] = 0.25
    run.finish()                               # or `with runbus.init() as run:`

Importing this package is cheap: redis, NVML and torch are imported lazily, off the hot path.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict, Unpack

from runbus import config as settings
from runbus.errors import (
    IdentityUnknown,
    InvalidName,
    LabelInUse,
    PrimaryConflict,
    RunExists,
    RunFinished,
    RunNotFound,
)
from runbus.producer import banner, environment, exits, metadata
from runbus.producer.environment import Identity
from runbus.producer.run import Run, RunOptions
from runbus.producer.shipper import ShipperOptions
from runbus.wire import check_name

__all__ = [
    "IdentityUnknown",
    "InitOptions",
    "InvalidName",
    "LabelInUse",
    "PrimaryConflict",
    "Run",
    "RunExists",
    "RunFinished",
    "RunNotFound",
    "check_arguments",
    "init",
]

log = logging.getLogger("runbus.producer")


class InitOptions(TypedDict, total=False):
    """runbus.init()'s options beyond its named arguments, each with its default (docs/producer.md
    says what each does)."""

    system_interval: float | None  # 15 s between system samples; None: none
    console: Literal["primary", "all", "off"]  # RUNBUS_CONSOLE, else "primary": what is captured and echoed
    finish_timeout: float  # 30 s that finish() waits for what is unshipped
    gpu_device_ids: Sequence[int] | None  # the GPUs sampled: by LOCAL_RANK and CUDA_VISIBLE_DEVICES
    hardware: bool  # True: describe the host (CPUs, GPUs, versions) in the start event
    git: bool | None  # RUNBUS_GIT, else True: the working directory's git state in the start event
    max_buffer_events: int  # 50,000 events queued before encoding (then log() waits: back-pressure)
    flush_interval: float  # 0.05 s between shipments at most
    batch_size: int  # 2000 events a shipment at most
    heartbeat_interval: float  # 10 s
    primary_ttl: float  # 30 s
    lease_ttl: float | None  # three heartbeats, at least 30 s
    connect_timeout: float  # 2 s
    socket_timeout: float  # 10 s
    max_backoff: float  # 5 s between reconnects at most
    max_buffer_bytes: int  # 128 MiB of encoded events held in memory while Redis is away
    spool_dir: str | os.PathLike[str] | Literal[False] | None  # RUNBUS_SPOOL_DIR, else ~/.cache/runbus/spool
    max_spool_bytes: int  # 4 GiB


_RUN_OPTIONS = {"max_buffer_events", "system_interval", "finish_timeout", "gpu_device_ids", "console"}
_SHIPPER_OPTIONS = {
    "flush_interval",
    "batch_size",
    "heartbeat_interval",
    "primary_ttl",
    "lease_ttl",
    "connect_timeout",
    "socket_timeout",
    "max_backoff",
    "max_buffer_bytes",
    "spool_dir",
    "max_spool_bytes",
}
# What the start event describes besides the Run's own fields.
_DESCRIBE_OPTIONS = {"hardware", "git"}
_active: dict[tuple[str, str], Run] = {}
_active_lock = threading.Lock()


def _split_options(options: dict[str, Any]) -> tuple[RunOptions, ShipperOptions]:
    unknown = set(options) - _RUN_OPTIONS - _SHIPPER_OPTIONS - _DESCRIBE_OPTIONS
    if unknown:
        known = ", ".join(sorted(_RUN_OPTIONS | _SHIPPER_OPTIONS | _DESCRIBE_OPTIONS))
        raise TypeError(f"unknown option(s) {', '.join(sorted(unknown))}; known: {known}")
    run_kw = {k: v for k, v in options.items() if k in _RUN_OPTIONS}
    if run_kw.get("gpu_device_ids") is not None:
        run_kw["gpu_device_ids"] = tuple(int(i) for i in run_kw["gpu_device_ids"])
    if run_kw.get("max_buffer_events", 1) < 1:
        raise ValueError("max_buffer_events must be >= 1")
    from runbus.producer import console

    run_kw["console"] = console.check_mode(run_kw.get("console") or console.default_mode())
    shipper_kw = {k: v for k, v in options.items() if k in _SHIPPER_OPTIONS}
    shipper_kw["spool_dir"] = _spool_dir(options.get("spool_dir"))
    return RunOptions(**run_kw), ShipperOptions(**shipper_kw)


def _spool_dir(given: Any) -> str | None:
    """spool_dir as given (a path), RUNBUS_SPOOL_DIR's or the default for None, no spool for False."""
    if given is None:
        return settings.spool_dir()
    if given is False or given == "":
        return None
    if given is True:
        raise TypeError("spool_dir takes a directory, None (the default one) or False (no spool)")
    path: str = os.fspath(given)
    return path


def check_arguments(**arguments: Any) -> None:
    """Raise now what runbus.init(**arguments) would raise about its arguments alone: unknown or
    invalid options, names, tags, resume modes (TypeError / ValueError). Nothing is resolved or
    sent: integrations call it when they are built, long before a rank calls init()."""
    parameters = set(inspect.signature(init).parameters) - {"options"}
    _split_options({k: v for k, v in arguments.items() if k not in parameters})
    for what in ("run_id", "label"):
        if arguments.get(what) is not None:
            check_name(what.replace("_", " "), arguments[what])
    if arguments.get("name") is not None:
        metadata.checked_name(arguments["name"])
    if arguments.get("tags") is not None:
        metadata.checked_tags(arguments["tags"])
    if arguments.get("resume") is not None:
        environment.check_resume(arguments["resume"])


def init(
    run_id: str | None = None,
    label: str | None = None,
    primary: bool | None = None,
    redis_url: str | None = None,
    config: Mapping[str, Any] | None = None,
    resume: str | None = None,
    name: str | None = None,
    tags: Sequence[str] | None = None,
    quiet: bool | None = None,
    **options: Unpack[InitOptions],
) -> Run:
    """Start logging this process into a run, as one label; the long form is docs/producer.md.

    Zero-config under torchrun, `accelerate launch`, DeepSpeed, Lightning, srun and mpirun: the run
    id is RUNBUS_RUN_ID, else the launcher's id for the job, else the one rank 0 gives the process
    group, else a new one for a single process (exported to RUNBUS_RUN_ID for its children). The
    label is RUNBUS_LABEL, else `rank{RANK}`; rank 0's is the primary. Ranks that cannot agree on
    a run id raise IdentityUnknown naming the ways out. A label has one live writer (a lease in
    Redis); `resume` ("never", "allow", "must") says what to do with a run that exists.

    log() never does I/O and never waits on an absent Redis: events wait in memory, then in a
    spool on disk (spool_dir), shipped on reconnect or by `runbus sync`; while Redis answers
    nothing is dropped. `config`, `name` and `tags` are run metadata (secrets redacted). The
    other options (InitOptions) tune buffering, sampling, heartbeats and what the start event
    describes.

    Raises ValueError for invalid names and values (InvalidName), TypeError for an unknown option
    or a config that is no dict, LabelInUse, RunExists / RunNotFound (as resume says) and
    PrimaryConflict. A Redis that cannot be reached is no error: init() returns at once.
    init() again in this process for a live label returns that Run.
    """
    identity: Identity = environment.resolve(run_id, label, primary, redis_url, resume=resume)
    run_options, shipper_options = _split_options(dict(options))
    plain_config = metadata.plain_values(config, "config")
    naming: dict[str, Any] = {}
    if name is not None:
        naming["name"] = metadata.checked_name(name)
    if tags is not None:
        naming["tags"] = metadata.checked_tags(tags)
    silent = settings.quiet() if quiet is None else bool(quiet)
    git = options.get("git")
    describe_git = settings.record_git() if git is None else bool(git)
    with _active_lock:
        key = (identity.run_id, identity.label)
        existing = _active.get(key)
        if existing is not None and not existing.finished:
            log.warning("runbus: init() again for %s/%s returns the live Run", *key)
            return existing
        run = Run(
            identity,
            run_options,
            shipper_options,
            plain_config,
            bool(options.get("hardware", True)),
            naming,
            describe_git,
        )
        _handshake(run)
        _active[key] = run
    environment.export_run_id(identity)
    exits.track(run)
    banner.announce(identity, silent)
    run._begin()
    return run


def _forget_parent_runs() -> None:
    global _active_lock
    _active_lock = threading.Lock()
    _active.clear()


os.register_at_fork(after_in_child=_forget_parent_runs)


def _handshake(run: Run) -> None:
    import redis

    shipper = run._shipper
    try:
        shipper.handshake()
    except LabelInUse as exc:
        shipper._drop_connection()
        parent = environment.inherited_from(run.identity)
        if parent is None:
            raise
        raise LabelInUse(
            f"{exc}. This process took the run id from RUNBUS_RUN_ID, which runbus.init() in process "
            f"{parent} exported for the processes it starts: a process that is not one of the job's "
            f'ranks logs under a label of its own: pass it run.child("{run.identity.label}-worker") '
            "(a ChildLabel: call .init() in it), or unset RUNBUS_RUN_ID to start a run of its own "
            "(under Lightning's ddp_spawn and ddp_fork the main process is no rank: call "
            "runbus.init() in the ranks only, or in the main process only)"
        ) from None
    except (PrimaryConflict, RunExists, RunNotFound):
        shipper._drop_connection()
        raise
    except (redis.RedisError, OSError) as exc:
        # Unreachable, or refusing the credentials: logged once, and logging goes on, buffered.
        shipper.note_outage(exc)
