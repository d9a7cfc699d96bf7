"""The runs list's question: which runs (search text, states, dates, tags, labels, config
values), in what order, which page (RunQuery), checked once for every reader, and the CLI's and the
API's text read into one (moment, config_pair)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from typing import Any

import orjson

from runbus.errors import BadQuery
from runbus.storage.rules import CRASHED, FAILED, FINISHED, RUNNING

STATES = (RUNNING, FINISHED, FAILED, CRASHED)
# The orders a list can take, and the way each goes unless told: the latest or the most first
# for times and counts, A to Z for names.
SORTS = {
    "started": "desc",
    "ended": "desc",
    "last": "desc",
    "labels": "desc",
    "id": "asc",
    "name": "asc",
    "state": "asc",
}
ORDERS = ("asc", "desc")
MAX_SEARCH = 256
MAX_FILTERS = 16  # tags, labels or config pairs one question names, each


@dataclass(frozen=True, slots=True)
class RunQuery:
    """Which runs to list: those matching every filter given, sorted, a page of them.

    `search` is found (ASCII letters in any case, every other character as it is, `%` and `_`
    too) in a run's id, name, tags or labels; `states` any of them; `since` and `until` bound its
    start (seconds since the epoch, `since` included, `until` not); `tags` and `labels` each held
    exactly; `config` pairs (key, value text) each the value of that top-level key, the text
    read as JSON where it is JSON (`lr=0.1`, `amp=true`) and as a string where not
    (`model=resnet`). `sort` is one of SORTS, `order` "asc" or "desc" (SORTS' default if None),
    runs without the sorted value last; ties go by run id. `limit` None is every run."""

    search: str | None = None
    states: tuple[str, ...] = ()
    since: float | None = None
    until: float | None = None
    tags: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()
    config: tuple[tuple[str, str], ...] = ()
    sort: str = "started"
    order: str | None = None
    limit: int | None = None
    offset: int = 0

    def __post_init__(self) -> None:
        _check_page(self.limit, self.offset)
        _check_order(self.sort, self.order)
        _check_filters(self)

    @property
    def descending(self) -> bool:
        """Whether the list goes from the highest value down."""
        return (self.order or SORTS[self.sort]) == "desc"


def _check_page(limit: int | None, offset: int) -> None:
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise BadQuery(f"limit must be a whole number, 0 or more (None: every run), got {limit!r}")
    if not isinstance(offset, int) or offset < 0:
        raise BadQuery(f"offset must be a whole number, 0 or more, got {offset!r}")


def _check_order(sort: str, order: str | None) -> None:
    if sort not in SORTS:
        raise BadQuery(f"cannot sort by {sort!r}: sort by one of {', '.join(SORTS)}")
    if order is not None and order not in ORDERS:
        raise BadQuery(f"order must be 'asc' or 'desc', got {order!r}")


def _check_filters(query: RunQuery) -> None:
    if query.search is not None and len(query.search) > MAX_SEARCH:
        raise BadQuery(f"search must be at most {MAX_SEARCH} characters, got {len(query.search)}")
    unknown = [state for state in query.states if state not in STATES]
    if unknown:
        raise BadQuery(f"no state {unknown[0]!r}: states are {', '.join(STATES)}")
    for name, bound in (("since", query.since), ("until", query.until)):
        if bound is not None and not (isinstance(bound, (int, float)) and math.isfinite(bound)):
            raise BadQuery(f"{name} must be a finite number of seconds since the epoch, got {bound!r}")
    for name, given in (("tags", query.tags), ("labels", query.labels), ("config", query.config)):
        if len(given) > MAX_FILTERS:
            raise BadQuery(f"at most {MAX_FILTERS} {name} in one query, got {len(given)}")
    for key, _ in query.config:
        _check_config_key(key)


def _check_config_key(key: str) -> None:
    if not key:
        raise BadQuery("a config filter needs a key before its '=' (lr=0.1)")
    # SQLite's JSON paths have no escapes (dialect.member_name).
    if '"' in key or "\\" in key:
        raise BadQuery(f"a config key to filter on cannot hold a quote or a backslash: {key!r}")


def config_pair(text: str) -> tuple[str, str]:
    """`KEY=VALUE` as (key, value text); the first `=` splits them."""
    key, equals, value = text.partition("=")
    if not equals or not key:
        raise BadQuery(f"a config filter is a key, '=' and a value (lr=0.1), got {text!r}")
    _check_config_key(key)
    return key, value


def config_texts(value: str) -> list[str]:
    """The JSON texts a stored config value matching `value` (a filter's text) may have: as the
    store writes it (orjson), the value read as JSON where it is JSON, and as a string."""
    texts = [orjson.dumps(value).decode()]
    try:
        parsed: Any = orjson.loads(value)
    except orjson.JSONDecodeError:
        return texts
    texts.append(orjson.dumps(parsed).decode())
    # 3 and 3.0 are one number to whoever typed it.
    if isinstance(parsed, float) and parsed.is_integer() and abs(parsed) < 2**63:
        texts.append(str(int(parsed)))
    elif isinstance(parsed, int) and not isinstance(parsed, bool):
        texts.append(orjson.dumps(float(parsed)).decode())
    return list(dict.fromkeys(texts))


def moment(text: str, end: bool = False) -> float:
    """Seconds since the epoch from `text`: a number of them, or an ISO 8601 date or date and time
    (without a zone: this machine's local time). A date alone is its first instant, or with `end`
    (an `until`) the first instant of the next day, so that the day is included."""
    text = text.strip()
    try:
        seconds = float(text)
    except ValueError:
        return _iso_moment(text, end)
    if not math.isfinite(seconds):
        raise BadQuery(f"not a time: {text!r}")
    return seconds


def _iso_moment(text: str, end: bool) -> float:
    try:
        if len(text) == 10:
            day = date.fromisoformat(text)
            start = datetime(day.year, day.month, day.day) + (timedelta(days=1) if end else timedelta())
            return start.timestamp()
        return datetime.fromisoformat(text).timestamp()
    except (ValueError, OverflowError, OSError):
        raise BadQuery(
            f"not a time: {text[:40]!r} (give seconds since the epoch, or a date as 2026-11-27 "
            "or 2026-11-27T14:30)"
        ) from None


def states_of(given: Iterable[str]) -> tuple[str, ...]:
    """The states named by `given`, each a state or several with commas (`failed,crashed`)."""
    return tuple(dict.fromkeys(s.strip() for text in given for s in text.split(",") if s.strip()))


def run_query(
    *,
    search: str | None = None,
    states: Iterable[str] = (),
    since: str | None = None,
    until: str | None = None,
    tags: Iterable[str] = (),
    labels: Iterable[str] = (),
    config: Iterable[str] = (),
    sort: str | None = None,
    order: str | None = None,
    limit: int | None = None,
    offset: int = 0,
) -> RunQuery:
    """A RunQuery from text as people type it (a command line, a page's address): states as
    states_of reads them, times as `moment` does, config pairs as KEY=VALUE; empty texts are
    not given. A bad one is BadQuery, saying what it takes."""
    return RunQuery(
        search=search or None,
        states=states_of(states),
        since=moment(since) if since else None,
        until=moment(until, end=True) if until else None,
        tags=tuple(tag for tag in tags if tag),
        labels=tuple(label for label in labels if label),
        config=tuple(config_pair(pair) for pair in config if pair),
        sort=sort or "started",
        order=order or None,
        limit=limit,
        offset=offset,
    )
