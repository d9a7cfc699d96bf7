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
from typing import Any

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
    return os.fspath(given)


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
    **options: Any,
) -> Run:
    """Start logging this process into a run, as one label.

    Zero-config under torchrun, `accelerate launch`, DeepSpeed, Lightning, srun and mpirun (see
    runbus.producer.environment): the run id is RUNBUS_RUN_ID, else the launcher's id for the job,
    else the one rank 0 gives the process group (once the script has called init_process_group),
    else, for a single process, a new one, exported to RUNBUS_RUN_ID for the processes it starts
    (until its finish). The label is RUNBUS_LABEL, else `rank{RANK}`; primary when the rank is 0
    (or a single process) and the label is that one (a label passed as an argument, a child's
    own, is not primary unless primary=True); RUNBUS_REDIS_URL, else redis://127.0.0.1:6379/0.
    Several ranks that cannot agree on a run id raise IdentityUnknown naming the ways out.

    The primary prints one line on stderr: the run id, its label, `runbus show ID` and, with
    RUNBUS_DASHBOARD_URL set, the run's page; quiet=True (or RUNBUS_QUIET=1) silences it.

    A label has one live writer: this process holds a lease on it in Redis (renewed by its
    heartbeats, lease_ttl: 3 heartbeats, at least 30 s; given back at finish). resume
    (RUNBUS_RESUME, else "never") says what to do with a run that exists: "never", a new job
    (restart count 0) does not continue a finished run; "allow" continues it under new epochs;
    "must" requires the run to exist. torchrun's elastic restarts always continue their run.

    Buffering: max_buffer_events (50,000 events queued before encoding). While Redis answers
    nothing is dropped: a log() call that finds the queue full waits until the shipper has taken
    some (back-pressure, only when the loop logs faster than events can be shipped). log() never
    waits on Redis for more than about 100 ms: while Redis is away, paused, slow or answering
    -OOM, events are encoded into max_buffer_bytes (128 MiB in memory), then an append-only file
    in spool_dir (RUNBUS_SPOOL_DIR, else ~/.cache/runbus/spool; owner-only; False or
    RUNBUS_SPOOL_DIR=off: none), up to max_spool_bytes (4 GiB), shipped on reconnect or by the
    next init() of this run and label; what finds those bounds full is dropped, counted, and
    reported as explained gaps (start and finish never are). finish() returns False when
    anything was dropped or left unshipped. Offline (Redis never reached by this process),
    finish() does not wait for it: after one more try it leaves the events in the spool and
    returns, and the primary says where the run waits; `runbus sync` ships it later, once
    (docs/offline.md).

    Run metadata: `config` (a dict or an argparse.Namespace; secrets redacted) is this label's
    config at start; `run.config.update()` adds to it, `run.summary[...]` sets final values, and
    `name` and `tags` (here, or `run.name = …`, `run.tags = […]` later) name the run; see
    runbus.producer.metadata for what is accepted. Each label's values are stored apart; shown
    merged, the primary's value of a key wins, else the latest any other label set.

    Options: system_interval (15 s; None turns sampling off),
    finish_timeout (30 s), gpu_device_ids, heartbeat_interval (10 s), flush_interval (0.05 s),
    batch_size (2000), primary_ttl (30 s), connect_timeout (2 s), socket_timeout (10 s),
    max_backoff (5 s), hardware (True: describe CPU and GPUs in the start event), git
    (RUNBUS_GIT, else True: record the working directory's git commit, branch, dirty state and
    origin URL, its credentials hidden, in the start event; see runbus.producer.gitstate), console
    (RUNBUS_CONSOLE, else "primary": capture stdout, stderr and logging records as log events;
    only the primary echoes to the terminal, other ranks echo their errors with a `[label] `
    prefix; "all": every rank echoes, prefixed; "off": no capture; see runbus.producer.console).

    Raises ValueError for invalid names (InvalidName: a run id, label, run name or tag) and
    configs (TypeError for one that is no dict), LabelInUse (naming its host and pid) when another live
    process logs as this run and label, RunExists / RunNotFound as resume says, PrimaryConflict
    when another label is the run's live primary. If Redis cannot be reached, or refuses the
    credentials (logged once, as an error), init() returns at once and events are buffered; a
    conflict found once Redis answers is logged as one error, nothing of this Run is shipped, and
    finish() returns False. init() again in this process for a live label returns that Run.
    """
    identity: Identity = environment.resolve(run_id, label, primary, redis_url, resume=resume)
    run_options, shipper_options = _split_options(options)
    plain_config = metadata.plain_values(config, "config")
    naming: dict[str, Any] = {}
    if name is not None:
        naming["name"] = metadata.checked_name(name)
    if tags is not None:
        naming["tags"] = metadata.checked_tags(tags)
    silent = settings.quiet() if quiet is None else bool(quiet)
    describe_git = settings.record_git() if options.get("git") is None else bool(options["git"])
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
