"""The few ways the backends' SQL differs, for the SQL they share (reads.py, metadata.py, backfill.py).

Shared SQL is written with `?` placeholders, one per argument in order, and no `?` anywhere else;
a backend that numbers its parameters (`$1`, `$2`, ...) gets them numbered by `Dialect.sql`.
"""

from __future__ import annotations

import functools
import itertools
import re
from dataclasses import dataclass

_PLACEHOLDER = re.compile(r"\?")


@functools.lru_cache(maxsize=256)
def _numbered(query: str) -> str:
    counter = itertools.count(1)
    return _PLACEHOLDER.sub(lambda _: f"${next(counter)}", query)


@dataclass(frozen=True)
class Dialect:
    """A backend's placeholder style and the spellings that differ."""

    # Parameters as `$n` (PostgreSQL) rather than `?` (SQLite).
    numbered: bool
    # The function giving a substring's 1-based position in a text, 0 where it is absent.
    find: str
    # The LIMIT argument that means no limit (SQLite refuses NULL; PostgreSQL refuses -1).
    no_limit: int | None

    def sql(self, query: str) -> str:
        """`query`, written with `?` placeholders, in this backend's style."""
        return _numbered(query) if self.numbered else query

    def contains(self, text: str, part: str = "?") -> str:
        """A condition that `text` contains `part` (by default the next argument)."""
        return f"{self.find}({text}, {part}) > 0"

    def limit(self, limit: int | None) -> int | None:
        """A LIMIT argument: None or a negative limit means none, as SQLite reads a negative one."""
        return self.no_limit if limit is None or limit < 0 else limit


SQLITE = Dialect(numbered=False, find="instr", no_limit=-1)
POSTGRES = Dialect(numbered=True, find="strpos", no_limit=None)
