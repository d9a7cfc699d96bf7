"""`runbus.Api`: a store's runs read back as pandas DataFrames, from a script or a notebook.

    api = runbus.Api()                      # RUNBUS_STORE, else the CLI's default store
    api.runs()                              # a row per run, newest first
    api.runs(search="llama", state="failed", since="2026-11-01", config={"lr": 0.1}, limit=50)
    run = api.run("my-run")
    run.config, run.summary, run.name, run.tags   # each merged over the run's labels
    run.history()                           # every metric value: label, key, step, lease_epoch, …
    run.history(keys="loss", wide=True)     # a row per logged event, a column per key
    run.logs(level="WARNING"), run.system()

The calls block until their table is built. The store is read on a private event loop in a helper
thread, so they work alike from a plain script and inside a running loop, as in Jupyter, where
asyncio.run() would fail. The tables are query/frames.py's, as `runbus export` writes them.
Importing this module stays cheap (`runbus.Api` is read in training scripts' imports): asyncio,
pandas and the tables are imported on first use.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

from runbus.config import default_store_url, safe_url
from runbus.errors import StoreMissing, StoreUnavailable
from runbus.storage import open_store
from runbus.storage.base import LabelSummary, RunSummary, SetBy, Store

# A time as runs(since=, until=) take it.
Moment = datetime | float | int | str


def _moment(value: Moment | None, end: bool = False) -> float | None:
    """Seconds since the epoch from a datetime (naive: local time), a number, or text
    (storage.runlist.moment)."""
    from runbus.storage.runlist import moment

    if value is None:
        return None
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, str):
        return moment(value, end)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"a time must be a datetime, a number or a string, not {type(value).__name__}")


def _config_pairs(config: Mapping[str, Any] | None) -> tuple[tuple[str, str], ...]:
    """{key: value} as the (key, value text) pairs of a RunQuery: a string as it is, any other
    value as its JSON."""
    import orjson

    if config is None:
        return ()
    return tuple(
        (key, value if isinstance(value, str) else orjson.dumps(value).decode())
        for key, value in config.items()
    )


if TYPE_CHECKING:
    import asyncio

    import pandas as pd
    import pyarrow as pa

T = TypeVar("T")


class StoreThread:
    """A store opened read-only and connected on its own event loop, in a daemon thread."""

    def __init__(self, url: str) -> None:
        import asyncio

        self.url = url
        self.store: Store = open_store(url, create=False)  # a bad URL or a missing driver: raised here
        self._loop: asyncio.AbstractEventLoop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="runbus-api", daemon=True)
        self._thread.start()
        self._open = True
        try:
            self.call(self.store.connect)
        except BaseException:
            self.close()
            raise

    def call(self, action: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Await `action()` on the store's loop and return its result (or raise its error)."""
        import asyncio

        if not self._open:
            raise StoreUnavailable(f"this runbus.Api of {safe_url(self.url)} is closed")
        future = asyncio.run_coroutine_threadsafe(action(), self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # interrupted (Ctrl-C in a notebook): the read stops too
            raise

    def close(self) -> None:
        """Close the store, stop the loop and its thread; a second call does nothing."""
        if not self._open:
            return
        try:
            self.call(self.store.close)
        finally:
            self._open = False
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()


class Api:
    """The runs of one store (`store`: a URL; RUNBUS_STORE or the CLI's default if None).

    The store is opened read-only: nothing is ever created, but by run() storing a run whose
    events wait in Redis with no ingester running (as `runbus show` does); where there is no
    runbus store at the URL, the calls raise StoreMissing. Close it with close() or a `with`
    block (it is closed when garbage-collected, too). `page_rows`: how many log lines each query
    reads, 50,000 by default (values are read as the store's arrays, in one read).
    """

    def __init__(self, store: str | None = None, *, page_rows: int | None = None) -> None:
        if page_rows is not None and (type(page_rows) is not int or page_rows < 1):
            raise ValueError(f"page_rows must be a whole number of at least 1, not {page_rows!r}")
        self.url = store or default_store_url()
        self.page_rows = page_rows
        self._reader: StoreThread | None = None
        self._closer: weakref.finalize[[], Api] | None = None
        self._closed = False
        # No store there yet: each call tries again, raising StoreMissing until one is made (by an
        # ingester, or by run() storing a run whose events wait in Redis: query/catchup.py).
        with contextlib.suppress(StoreMissing):
            self._open_store()

    def _open_store(self) -> StoreThread:
        """The store's reader, opened now if it was not there before (StoreMissing)."""
        if self._reader is None:
            if self._closed:
                raise StoreUnavailable(f"this runbus.Api of {safe_url(self.url)} is closed")
            self._reader = StoreThread(self.url)
            self._closer = weakref.finalize(self, self._reader.close)
            # Not at interpreter exit: by then the SQLite store's executor takes no more work, and
            # the process ending closes every connection anyway.
            self._closer.atexit = False
        return self._reader

    def __repr__(self) -> str:
        return f"runbus.Api({safe_url(self.url)!r})"

    def __enter__(self) -> Api:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the store's connections and the helper thread."""
        self._closed = True
        if self._closer is not None:
            self._closer()

    def read(self, action: Callable[[Store], Awaitable[T]]) -> T:
        """`await action(store)` on the store's loop: any read of the Store interface."""

        async def reading() -> T:
            return await action(reader.store)

        reader = self._open_store()
        return reader.call(reading)

    def runs(
        self,
        search: str | None = None,
        *,
        state: str | Iterable[str] | None = None,
        since: Moment | None = None,
        until: Moment | None = None,
        tag: str | Iterable[str] | None = None,
        label: str | Iterable[str] | None = None,
        config: Mapping[str, Any] | None = None,
        sort: str = "started",
        order: str | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> pd.DataFrame:
        """The runs that match, newest first unless sorted otherwise: run_id, name, tags, state,
        primary, exit_code, labels (how many), started, ended, last_event (UTC timestamps),
        metric_events, log_events, system_events, config, summary (each its labels' merged).
        With no argument, every run; `attrs["total"]` is how many match, the page aside.

        `search`: text in the run's id, name, a tag or a label (ASCII letters in any case).
        `state`, `tag`, `label`: one or several (any of the states; all of the tags and labels).
        `since`, `until`: its start, a datetime, seconds since the epoch or ISO 8601 text (a date
        alone for `until`: through that day). `config`: {key: value} its config holds (3 and
        3.0 alike; a string value is read as JSON where it is: "0.1" finds 0.1). `sort`: started,
        ended, last, labels, id, name or state; `order`: "asc" or "desc". A bad one is BadQuery.
        """
        from runbus.query import frames
        from runbus.storage.runlist import RunQuery, states_of

        query = RunQuery(
            search=search or None,
            states=states_of(frames.names(state, "state") or ()),
            since=_moment(since),
            until=_moment(until, end=True),
            tags=tuple(frames.names(tag, "tag") or ()),
            labels=tuple(frames.names(label, "label") or ()),
            config=_config_pairs(config),
            sort=sort,
            order=order,
            limit=limit,
            offset=offset,
        )
        return self.read(lambda store: frames.runs_table(store, query))

    def run(self, run_id: str) -> StoredRun:
        """One run, by its id or a unique prefix of it; an unknown id is RunNotFound, naming the
        store's most recent runs, or saying that the run's events wait in Redis
        (RUNBUS_REDIS_URL); an ambiguous prefix is AmbiguousRun. Where the run's events wait
        there and no ingester is running, they are stored first, as `runbus show` does
        (query/catchup.py; RUNBUS_CATCH_UP=0 turns it off)."""
        from runbus.config import catch_up, redis_url
        from runbus.query import catchup
        from runbus.query.cli import known_run

        catching, redis = catch_up(), redis_url()
        try:
            self._open_store()
        except StoreMissing:
            if not catching or catchup.store_waiting(self.url, redis, run_id, None) is None:
                raise
        return StoredRun(self, self.read(lambda store: known_run(store, run_id, redis, catching)))


class StoredRun:
    """A run as the store has it: its record as read by Api.run, and its tables read anew on each call."""

    def __init__(self, api: Api, record: RunSummary) -> None:
        self.api = api
        self.record = record  # everything the store says of the run, its labels included

    def __repr__(self) -> str:
        return f"<runbus run {self.run_id!r}: {self.state}, {len(self.labels)} labels>"

    @property
    def run_id(self) -> str:
        return self.record.run_id

    @property
    def state(self) -> str:
        return self.record.state

    @property
    def primary(self) -> str | None:
        return self.record.primary

    @property
    def exit_code(self) -> int | None:
        return self.record.exit_code

    @property
    def labels(self) -> list[str]:
        return [label.label for label in self.record.labels]

    @property
    def name(self) -> str | None:
        return self.record.name

    @property
    def tags(self) -> list[str]:
        return list(self.record.tags)

    @property
    def config(self) -> dict[str, Any] | None:
        """The run's config, its labels' merged: the primary's value of a key, else the latest
        any other label set (`set_by` names the label of each key; `label_config` each label's)."""
        return self.record.config

    @property
    def summary(self) -> dict[str, Any]:
        """The run's summary values, merged as the config is."""
        return dict(self.record.summary)

    @property
    def set_by(self) -> SetBy:
        """Which label set each value of config and summary, the name and the tags."""
        return self.record.set_by

    def label_config(self, label: str) -> dict[str, Any]:
        """What one label set as its config."""
        return dict(self._label(label).config)

    def label_summary(self, label: str) -> dict[str, Any]:
        """What one label set as its summary."""
        return dict(self._label(label).summary)

    def _label(self, label: str) -> LabelSummary:
        for found in self.record.labels:
            if found.label == label:
                return found
        raise KeyError(f"run {self.run_id!r} has no label {label!r}; its labels: {', '.join(self.labels)}")

    @property
    def counts(self) -> dict[str, int]:
        """Events stored, by kind: metric, log, system."""
        return dict(self.record.counts)

    @property
    def started(self) -> datetime | None:
        return _when(self.record.started_ts)

    @property
    def ended(self) -> datetime | None:
        return _when(self.record.ended_ts)

    @property
    def last_event(self) -> datetime | None:
        return _when(self.record.last_ts)

    def history(
        self,
        keys: str | Iterable[str] | None = None,
        labels: str | Iterable[str] | None = None,
        wide: bool = False,
        steps: tuple[int | None, int | None] | None = None,
    ) -> pd.DataFrame:
        """Every metric value (of `keys`, of `labels`, at `steps`: (first, last), both included,
        either None for no bound): label, key, step, lease_epoch, life, seq, ts, value in (label,
        key, lease_epoch, seq) order; with `wide`, a row per logged event and a column per key.
        `lease_epoch` is the label's raw lease generation, `life` 1, 2, … per restart. Only the
        chunks that hold the chosen labels, keys and steps are read."""
        from runbus.query import frames

        return self.api.read(
            lambda store: frames.history_table(
                store, self.run_id, keys, labels, wide, self.api.page_rows, steps, exact=True
            )
        )

    def arrow(
        self,
        keys: str | Iterable[str] | None = None,
        labels: str | Iterable[str] | None = None,
        table: str = "metrics",
        steps: tuple[int | None, int | None] | None = None,
    ) -> pa.Table:
        """Every value of `table` ("metrics" or "system"; of `keys`, of `labels`, at `steps` as
        history() takes them) as a pyarrow Table, built without pandas: the long history's
        columns, label and key as dictionaries."""
        from runbus.query import arrow
        from runbus.storage.base import point_table

        chosen = point_table(table)
        return self.api.read(
            lambda store: arrow.arrow_table(store, self.run_id, chosen, keys, labels, steps, exact=True)
        )

    def system(
        self, keys: str | Iterable[str] | None = None, labels: str | Iterable[str] | None = None
    ) -> pd.DataFrame:
        """Every system sample (of `keys`, of `labels`): label, key, lease_epoch, life, seq, ts, value."""
        from runbus.query import frames

        return self.api.read(
            lambda store: frames.system_table(
                store, self.run_id, keys, labels, self.api.page_rows, exact=True
            )
        )

    def logs(
        self,
        labels: str | Iterable[str] | None = None,
        level: str | None = None,
        grep: str | None = None,
    ) -> pd.DataFrame:
        """Every log line (of `labels`, at `level` or above, containing `grep`): label, lease_epoch, life,
        seq, ts, stream, level, text, by time."""
        from runbus.query import frames

        return self.api.read(
            lambda store: frames.logs_table(store, self.run_id, labels, level, grep, self.api.page_rows)
        )


def _when(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC)
