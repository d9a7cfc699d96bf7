"""runbus: every rank of a distributed training job logs into one run, through Redis Streams.

    import runbus
    run = runbus.init(config={"lr": 3e-4})   # zero-config under torchrun
    run.log({"loss": 0.25}, step=10)         # never blocks, never does I/O
    run.finish()                             # or `with runbus.init() as run:`

    runbus.Api().run(run.run_id).history()   # later, in a notebook: every value, as a DataFrame

Importing runbus is cheap: the names below are loaded on first use, and redis, asyncio, torch,
NVML and psutil are imported only by what needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

# name -> the module that defines it; `runbus.NAME` imports that module on first use.
_LAZY = {
    "init": "runbus.producer",
    "Run": "runbus.producer.run",
    "Api": "runbus.query.notebook",
    "RunbusError": "runbus.errors",
    "InvalidName": "runbus.errors",
    "BadQuery": "runbus.errors",
    "IdentityUnknown": "runbus.errors",
    "InvalidEntry": "runbus.errors",
    "PrimaryConflict": "runbus.errors",
    "RunFinished": "runbus.errors",
    "LabelInUse": "runbus.errors",
    "RunExists": "runbus.errors",
    "RunNotFound": "runbus.errors",
    "AmbiguousRun": "runbus.errors",
    "StoreError": "runbus.errors",
    "StoreUnavailable": "runbus.errors",
    "StoreMissing": "runbus.errors",
    "StoreRejected": "runbus.errors",
    "AccessDenied": "runbus.errors",
    "CommandError": "runbus.errors",
    "MissingDependency": "runbus.errors",
    "RedisServerNotFound": "runbus.errors",
    "TokenRequired": "runbus.errors",
    "CannotListen": "runbus.errors",
}

__all__ = [
    "AccessDenied",
    "AmbiguousRun",
    "Api",
    "BadQuery",
    "CannotListen",
    "CommandError",
    "IdentityUnknown",
    "InvalidEntry",
    "InvalidName",
    "LabelInUse",
    "MissingDependency",
    "PrimaryConflict",
    "RedisServerNotFound",
    "Run",
    "RunExists",
    "RunFinished",
    "RunNotFound",
    "RunbusError",
    "StoreError",
    "StoreMissing",
    "StoreRejected",
    "StoreUnavailable",
    "TokenRequired",
    "__version__",
    "init",
]

if TYPE_CHECKING:
    from runbus.errors import (
        AccessDenied,
        AmbiguousRun,
        BadQuery,
        CannotListen,
        CommandError,
        IdentityUnknown,
        InvalidEntry,
        InvalidName,
        LabelInUse,
        MissingDependency,
        PrimaryConflict,
        RedisServerNotFound,
        RunbusError,
        RunExists,
        RunFinished,
        RunNotFound,
        StoreError,
        StoreMissing,
        StoreRejected,
        StoreUnavailable,
        TokenRequired,
    )
    from runbus.producer import init
    from runbus.producer.run import Run
    from runbus.query.notebook import Api


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'runbus' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
