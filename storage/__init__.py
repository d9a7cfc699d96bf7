"""Storage for runbus: one small interface, a backend chosen by URL scheme.

`sqlite:///PATH` is the embedded default; `postgresql://...` the scale-out backend. Backends are
imported lazily so SQLite users never import asyncpg.
"""

from __future__ import annotations

import importlib
from urllib.parse import urlsplit

from runbus.config import default_store_url, safe_url
from runbus.errors import StoreError
from runbus.storage.base import LabelSummary, LogLine, Point, RunSummary, Store

BACKENDS = {
    "sqlite": "runbus.storage.sqlite:SQLiteStore",
    "postgresql": "runbus.storage.postgres:PostgresStore",
    "postgres": "runbus.storage.postgres:PostgresStore",
}

__all__ = [
    "LabelSummary",
    "LogLine",
    "Point",
    "RunSummary",
    "Store",
    "StoreError",
    "open_store",
    "safe_url",
]


def open_store(url: str | None = None) -> Store:
    """A store for `url` (not yet connected); raises ValueError for an unknown scheme."""
    url = url or default_store_url()
    scheme = urlsplit(url).scheme
    target = BACKENDS.get(scheme)
    if target is None:
        raise ValueError(
            f"unsupported store URL {safe_url(url)!r}: use one of "
            + ", ".join(f"{name}://" for name in BACKENDS)
        )
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)(url)
