"""The few ways the backends' SQL differs, for the SQL they share (reads.py, metadata.py, backfill.py).

Shared SQL is written with `?` placeholders, one per argument in order, and no `?` anywhere else;
a backend that numbers its parameters (`$1`, `$2`, ...) gets them numbered by `Dialect.sql`.
"""

from __future__ import annotations

import functools
import itertools
import re
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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
    # A text's ASCII letters in lower case and no other character changed (PostgreSQL's lower()
    # under its "C" collation; SQLite's lower() does no more), as a format of the text.
    fold: str
    # The collation that orders texts by code point.
    bytewise: str
    # The string elements of a JSON array `{doc}` as rows of one column, `value` (none if `{doc}`
    # is NULL or not an array).
    strings: str
    # The JSON text of the member of a JSON object `{doc}` named by the next argument, as
    # member_name gives it (NULL if absent); "" where the backend cannot say (member_missing says why).
    member: str
    # The member's name as SQLite's JSON path (`$."key"`) rather than the key itself.
    json_path: bool
    # A list of texts bound as one array argument (`= ANY(...)`: one statement whatever its
    # length, and no cap on it) rather than one argument each.
    text_arrays: bool = False

    def sql(self, query: str) -> str:
        """`query`, written with `?` placeholders, in this backend's style."""
        return _numbered(query) if self.numbered else query

    def contains(self, text: str, part: str = "?") -> str:
        """A condition that `text` contains `part` (by default the next argument)."""
        return f"{self.find}({text}, {part}) > 0"

    def one_of(self, column: str, names: Sequence[str] | None) -> tuple[str, list[Any]]:
        """A condition (` AND ...`) that `column` is one of `names`, none where `names` is None,
        and its arguments."""
        if names is None:
            return "", []
        if not names:
            return " AND 1 = 0", []
        if self.text_arrays:
            return f" AND {column} = ANY(CAST(? AS TEXT[]))", [list(names)]
        return f" AND {column} IN ({', '.join('?' * len(names))})", list(names)

    def limit(self, limit: int | None) -> int | None:
        """A LIMIT argument: None or a negative limit means none, as SQLite reads a negative one."""
        return self.no_limit if limit is None or limit < 0 else limit

    def member_name(self, key: str) -> str:
        """The argument naming `key` (without `"` or `\\`) for `member`."""
        return f'$."{key}"' if self.json_path else key


SQLITE = Dialect(
    numbered=False,
    find="instr",
    no_limit=-1,
    fold="lower({})",
    bytewise="BINARY",
    strings=(
        "SELECT t.value AS value FROM json_each(CASE WHEN json_type({doc}) = 'array' THEN {doc} END) t "
        "WHERE t.type = 'text'"
    ),
    # SQLite's `->` (JSON text, numbers as written) is 3.38's; the SQLite under Python may be older.
    member="({doc} -> ?)" if sqlite3.sqlite_version_info >= (3, 38) else "",
    json_path=True,
)
# Why a SQLite store cannot filter by config values, where it cannot.
SQLITE_MEMBER_MISSING = (
    f"filtering runs by config values needs SQLite 3.38 or later; this Python's is {sqlite3.sqlite_version}"
)
POSTGRES = Dialect(
    numbered=True,
    find="strpos",
    no_limit=None,
    fold='lower(({}) COLLATE "C")',
    bytewise='"C"',
    strings=(
        "SELECT t.e #>> '{{}}' AS value FROM json_array_elements(CASE WHEN json_typeof({doc}) = 'array' "
        "THEN {doc} END) AS t(e) WHERE json_typeof(t.e) = 'string'"
    ),
    member="CAST({doc} -> CAST(? AS TEXT) AS TEXT)",
    json_path=False,
    text_arrays=True,
)
