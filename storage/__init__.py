"""Storage for runbus: one small interface, a backend chosen by URL scheme.

`sqlite:///PATH` is the embedded default; `postgresql://...` the scale-out backend. Backends are
imported lazily so SQLite users never import asyncpg.
"""

from __future__ import annotations

import importlib
import os
from urllib.parse import urlsplit

from producer.urls import safe_url
from storage.base import LabelSummary, LogLine, Point, RunSummary, Store, StoreError

DEFAULT_URL = "sqlite:///runbus.db"
BACKENDS = {
    "sqlite": "storage.sqlite:SQLiteStore",
    "postgresql": "storage.postgres:PostgresStore",
    "postgres": "storage.postgres:PostgresStore",
}

__all__ = [
    "DEFAULT_URL",
    "LabelSummary",
    "LogLine",
    "Point",
    "RunSummary",
    "Store",
    "StoreError",
    "default_url",
    "open_store",
    "safe_url",
]


def default_url() -> str:
    """The store URL from RUNBUS_STORE, else the embedded SQLite default."""
    return os.environ.get("RUNBUS_STORE") or DEFAULT_URL


def open_store(url: str | None = None) -> Store:
    """A store for `url` (not yet connected); raises ValueError for an unknown scheme."""
    url = url or default_url()
    scheme = urlsplit(url).scheme
    target = BACKENDS.get(scheme)
    if target is None:
        raise ValueError(
            f"unsupported store URL {safe_url(url)!r}: use one of "
            + ", ".join(f"{name}://" for name in BACKENDS)
        )
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)(url)
