"""Storage for runbus: one small interface, a backend chosen by URL scheme.

`sqlite:///PATH` is the embedded default; `postgresql://...` the scale-out backend. Backends are
imported lazily so SQLite users never import asyncpg. The ingester opens a store to create or
migrate it; readers (the CLI, the dashboard) open it with `create=False`, which never makes a file,
a directory or a table: a store that is not there is `StoreMissing`.
"""

from __future__ import annotations

import importlib
from urllib.parse import urlsplit

from runbus.config import default_store_url, safe_url
from runbus.errors import MissingDependency, StoreError, StoreMissing
from runbus.storage.base import LabelSummary, LogLine, Point, RunSummary, Store

BACKENDS = {
    "sqlite": "runbus.storage.sqlite:SQLiteStore",
    "postgresql": "runbus.storage.postgres:PostgresStore",
    "postgres": "runbus.storage.postgres:PostgresStore",
}
# The extra that installs a backend's driver, for the error when it is missing.
EXTRAS = {"runbus.storage.postgres": "postgres"}

__all__ = [
    "LabelSummary",
    "LogLine",
    "Point",
    "RunSummary",
    "Store",
    "StoreError",
    "StoreMissing",
    "open_store",
    "safe_url",
]


def open_store(url: str | None = None, create: bool = True) -> Store:
    """A store for `url` (not yet connected); raises ValueError for an unknown scheme and
    MissingDependency when the backend's driver is not installed.

    With `create=False`, `connect()` neither creates nor migrates anything: it raises
    StoreMissing where there is no runbus store at `url`.
    """
    url = url or default_store_url()
    scheme = urlsplit(url).scheme
    target = BACKENDS.get(scheme)
    if target is None:
        raise ValueError(
            f"unsupported store URL {safe_url(url)!r}: use one of "
            + ", ".join(f"{name}://" for name in BACKENDS)
        )
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] == "runbus":
            raise
        extra = EXTRAS.get(module_name, scheme)
        raise MissingDependency(
            f"{scheme}:// stores need {exc.name}, which is not installed: pip install 'runbus[{extra}]'"
        ) from exc
    store: Store = getattr(module, class_name)(url, create=create)
    return store
