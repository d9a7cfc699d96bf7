"""A store's tables as pandas DataFrames, each built one way for the notebook API and `runbus export`.

pandas is optional (`pip install 'runbus[pandas]'`): it is imported when a table is built, so this
module imports without it. The tables are complete: every stored value, never sampled. Values
come as the store's arrays (Store.values, decoded from its column chunks) and become columns
without a Python object per value; log lines are read a page at a time through each label's
primary key (Store.log_page). A run that is being written is read as it stands: a value stored
meanwhile may or may not be in the table, none is in it twice.

Columns and order (times are pandas timestamps in UTC, to the microsecond):
- runs: run_id, name, tags (a list), state, primary, exit_code, labels (how many), started,
  ended, last_event, metric_events, log_events, system_events, config, summary (dicts: each the
  run's labels' merged); newest first.
- history (metrics): label, key (categoricals of all the run's labels and keys), step (Int64, <NA>
  where none was given), lease_epoch, life, seq, ts, value (float64, NaN and ±inf as logged); by
  label (natural order), key, lease_epoch, seq.
- history, wide: one row per metric event, i.e. per log() call of a label, (label, lease_epoch,
  seq): label, lease_epoch, life, seq, step, ts, then a float64 column per key in key order, NaN
  where that event did not log the key; by label, lease_epoch, seq. A key named like one of those
  six columns gets the column `metric:KEY` (`metric:` again in front while that is a key's name too).
- system: label, key, lease_epoch, life, seq, ts, value; by label, key, lease_epoch, seq.
- logs: label, lease_epoch, life, seq, ts, stream, level, text; by time (then label, lease_epoch,
  seq), as `runbus logs` prints them.

`lease_epoch` is the label's lease generation (docs/wire.md: a millisecond clock, higher after each
restart of its process), not the training epoch; the column was named `epoch` up to runbus 0.2.0.
`life` numbers a label's lease epochs 1, 2, 3 (storage.rules.lives_of): 2 after a first restart.
"""

from __future__ import annotations

import asyncio
import functools
from array import array
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from runbus import wire
from runbus.errors import CommandError, MissingDependency
from runbus.query.cli import known_run
from runbus.redact import redact_line
from runbus.storage import rows
from runbus.storage.base import LogLine, PointTable, RunSummary, Store
from runbus.storage.rules import natural_key
from runbus.storage.runlist import RunQuery
from runbus.storage.values import code_type, step_range

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

    from runbus.storage.values import Values

PAGE_ROWS = 50_000  # values (or log lines) per query
WIDE_COLUMNS = ("label", "lease_epoch", "life", "seq", "step", "ts")
WIDE_RENAMED = "metric:"  # what a key named like one of WIDE_COLUMNS gets in front in a wide table
LISTED_NAMES = 20  # labels or keys an unknown one's error names
# Within the span of datetime64[us] (2**63 microseconds): a ts beyond it is NaT.
MAX_MICROSECONDS = 9.2e18
CAST_SLICE = 1 << 16  # values cast from float64 to int64 in place at a time


def require_pandas() -> None:
    """Raise MissingDependency, naming the extra to install, where pandas is not installed."""
    try:
        import pandas  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] not in ("pandas", "numpy"):
            raise
        raise MissingDependency(
            f"runbus's tables need {exc.name}, which is not installed: pip install 'runbus[pandas]'"
        ) from exc


def names(value: str | Iterable[str] | None, what: str) -> list[str] | None:
    """A `keys=` or `labels=` argument as a list: one name, several, or None for all."""
    if value is None:
        return None
    found = [value] if isinstance(value, str) else list(value)
    for name in found:
        if not isinstance(name, str):
            raise TypeError(f"{what} must be a string or strings, not {type(name).__name__}: {name!r}")
    return found


# -- the tables ----------------------------------------------------------------------------------


async def runs_table(store: Store, query: RunQuery | None = None) -> pd.DataFrame:
    """The runs `query` matches (every run of the store, newest first, if None), with their
    labels and event counts; `attrs["total"]`: how many match, the page aside."""
    require_pandas()
    import pandas as pd

    page = await store.run_page(query or RunQuery())
    runs = page.runs
    table = pd.DataFrame(
        {
            "run_id": _text([r.run_id for r in runs]),
            "name": _text([r.name for r in runs]),
            "tags": pd.Series([list(r.tags) for r in runs], dtype=object),
            "state": _text([r.state for r in runs]),
            "primary": _text([r.primary for r in runs]),
            "exit_code": pd.array([r.exit_code for r in runs], dtype="Int64"),
            "labels": _integers([r.label_count for r in runs]),
            "started": _times([_seconds(r.started_ts) for r in runs]),
            "ended": _times([_seconds(r.ended_ts) for r in runs]),
            "last_event": _times([_seconds(r.last_ts) for r in runs]),
            **{
                f"{kind}_events": _integers([r.counts.get(kind, 0) for r in runs])
                for kind in rows.KINDS_COUNTED
            },
            "config": pd.Series([r.config for r in runs], dtype=object),
            "summary": pd.Series([dict(r.summary) for r in runs], dtype=object),
        }
    )
    table.attrs["total"] = page.total
    return table


async def history_table(
    store: Store,
    run_id: str,
    keys: str | Iterable[str] | None = None,
    labels: str | Iterable[str] | None = None,
    wide: bool = False,
    page_rows: int | None = None,
    steps: tuple[int | None, int | None] | None = None,
    exact: bool = False,
) -> pd.DataFrame:
    """Every metric value of a run (of `labels`, of `keys`, at `steps`), long or wide (see the
    module); `exact` as read_values takes it."""
    require_pandas()
    page_size(page_rows)
    read = await read_values(store, run_id, "metrics", keys, labels, steps, exact)
    history = _point_table(read, "metrics")
    return wide_history(history) if wide else history


async def system_table(
    store: Store,
    run_id: str,
    keys: str | Iterable[str] | None = None,
    labels: str | Iterable[str] | None = None,
    page_rows: int | None = None,
    exact: bool = False,
) -> pd.DataFrame:
    """Every system sample of a run (of `labels`, of `keys`); `exact` as read_values takes it."""
    require_pandas()
    page_size(page_rows)
    return _point_table(await read_values(store, run_id, "system", keys, labels, exact=exact), "system")


async def logs_table(
    store: Store,
    run_id: str,
    labels: str | Iterable[str] | None = None,
    level: str | None = None,
    grep: str | None = None,
    page_rows: int | None = None,
) -> pd.DataFrame:
    """Every log line of a run (of `labels`, at `level` or above, containing `grep`), by time."""
    require_pandas()
    if level is not None and (not isinstance(level, str) or level.upper() not in wire.LEVELS):
        raise ValueError(f"unknown level {level!r}: use one of {', '.join(wire.LEVELS)}")
    page_rows = page_size(page_rows)
    run = await known_run(store, run_id)
    lines = _LogColumns()
    lives = _lives(run)
    for label in _labels(run, labels):
        after: tuple[int, int] | None = None
        while True:
            page = await store.log_page(run.run_id, label, after, page_rows, level and level.upper(), grep)
            lines.add(page, lives[label])
            if len(page) < page_rows:
                break
            after = (page[-1].epoch, page[-1].seq)
    return lines.table()


def wide_history(history: pd.DataFrame) -> pd.DataFrame:
    """A long history (as history_table returns it) as one row per metric event: see the module."""
    index = ["label", "lease_epoch", "seq"]
    events = history.drop_duplicates(index)[list(WIDE_COLUMNS)]
    events = events.sort_values(index, kind="stable", ignore_index=True)
    # The keys as text: a categorical would give a column to every key of the run, logged here or not.
    values = history.assign(key=history.key.astype(str)).pivot(index=index, columns="key", values="value")
    values.columns = _wide_names([str(key) for key in values.columns])
    return events.join(values, on=index)


def _wide_names(keys: list[str]) -> list[str]:
    taken = set(WIDE_COLUMNS) | set(keys)
    renamed = []
    for key in keys:
        name = key
        if key in WIDE_COLUMNS:
            name = WIDE_RENAMED + key
            while name in taken:
                name = WIDE_RENAMED + name
            taken.add(name)
        renamed.append(name)
    return renamed


# -- reading a run page by page ------------------------------------------------------------------


def _listing(found: Sequence[str]) -> str:
    shown = ", ".join(found[:LISTED_NAMES])
    return shown + (f", ... ({len(found)} in all)" if len(found) > LISTED_NAMES else "")


def _labels(run: RunSummary, labels: str | Iterable[str] | None) -> list[str]:
    """The run's labels to read, in order; an unknown one is an error naming the run's labels."""
    return _chosen_labels(run.run_id, [lab.label for lab in run.labels], labels)


def _chosen_labels(run_id: str, known: list[str], labels: str | Iterable[str] | None) -> list[str]:
    chosen = names(labels, "labels")
    if chosen is None:
        return sorted(known, key=natural_key)
    for label in chosen:
        if label not in known:
            raise CommandError(f"run {run_id!r} has no label {label!r}; its labels: {_listing(known)}")
    return sorted(set(chosen), key=natural_key)


def _check_keys(run_id: str, known: list[str], keys: list[str], table: PointTable = "metrics") -> None:
    """Each of `keys` among the `known` keys of the run's `table`, else a CommandError naming them."""
    what = "metric" if table == "metrics" else "system key"
    for key in keys:
        if rows.storable_text(key) not in known:
            listed = f"its {what}s: {_listing(known)}" if known else f"it has no {what}s"
            raise CommandError(f"run {run_id!r} has no {what} {key!r}; {listed}")


def page_size(page_rows: int | None) -> int:
    """`page_rows` checked, PAGE_ROWS if None."""
    if page_rows is None:
        return PAGE_ROWS
    if not isinstance(page_rows, int) or isinstance(page_rows, bool) or page_rows < 1:
        raise ValueError(f"page_rows must be a whole number of at least 1, not {page_rows!r}")
    return page_rows


class RunValues(NamedTuple):
    """A run's values as a read chose them, with what a table needs beside the store's arrays."""

    found: Values
    labels: list[str]  # every label of the run, in natural order: the label categories
    keys: list[str]  # every key of the run's table, by code point: the key categories
    life: np.ndarray


async def read_values(
    store: Store,
    run_id: str,
    table: PointTable,
    keys: str | Iterable[str] | None,
    labels: str | Iterable[str] | None,
    steps: tuple[int | None, int | None] | None = None,
    exact: bool = False,
) -> RunValues:
    """A run's values of `table` (of `labels`, of `keys`: unknown ones are a CommandError that
    names those there are; at `steps`, values.step_range's), as arrays (Store.values). `exact`:
    `run_id` is a stored run's whole id (runbus.Api's run has it), not a prefix to look up."""
    in_range = step_range(steps, table)
    chosen_keys, chosen_labels = names(keys, "keys"), names(labels, "labels")
    if exact:
        # The run's labels, its keys and the values read side by side: a small read's cost is
        # mostly its round trips. The names chosen are checked once the run's are known.
        lives, all_keys, found = await asyncio.gather(
            store.label_lives(run_id),
            _table_keys(store, run_id, table),
            store.values(run_id, table, chosen_keys, chosen_labels, in_range),
        )
        if lives:
            _chosen(run_id, lives, all_keys, chosen_keys, chosen_labels, table)
            return _run_values(found, lives, all_keys)
    run_id, lives = await _run_lives(store, run_id)
    all_keys = await _table_keys(store, run_id, table)
    chosen = _chosen(run_id, lives, all_keys, chosen_keys, chosen_labels, table)
    found = await store.values(run_id, table, chosen_keys, chosen, in_range)
    return _run_values(found, lives, all_keys)


async def _table_keys(store: Store, run_id: str, table: PointTable) -> list[str]:
    return await (store.metric_keys(run_id) if table == "metrics" else store.system_keys(run_id))


def _chosen(
    run_id: str,
    lives: dict[str, dict[int, int]],
    all_keys: list[str],
    keys: list[str] | None,
    labels: list[str] | None,
    table: PointTable,
) -> list[str] | None:
    """The labels to read (None: all), once `keys` and `labels` are checked against the run's."""
    if keys is not None:
        _check_keys(run_id, all_keys, keys, table)
    return None if labels is None else _chosen_labels(run_id, list(lives), labels)


def _run_values(found: Values, lives: dict[str, dict[int, int]], all_keys: list[str]) -> RunValues:
    return RunValues(
        found,
        sorted(lives, key=natural_key),
        sorted(set(all_keys) | set(found.keys)),
        _life_column(found, lives),
    )


async def _run_lives(store: Store, run_id: str) -> tuple[str, dict[str, dict[int, int]]]:
    """The run's id and its labels' lives from its record (known_run: by a prefix of its id
    too, and RunNotFound where no run has it)."""
    run = await known_run(store, run_id)
    return run.run_id, _lives(run)


def _point_table(read: RunValues, table: PointTable) -> pd.DataFrame:
    """A long table of `read`'s values, built from its arrays: labels and keys as categoricals of
    all the run's labels and keys, so tables of a run's subsets concatenate and compare."""
    import pandas as pd

    found = read.found
    # The store's arrays become the columns as they are: no copy (pandas copies unless told), and
    # arrays rather than Series, which the frame would align on their indexes one by one.
    columns = {
        "label": _categorical(found.label, found.labels, read.labels),
        "key": _categorical(found.key, found.keys, read.keys),
        **({"step": pd.arrays.IntegerArray(found.step, found.no_step)} if table == "metrics" else {}),
        "lease_epoch": found.epoch,
        "life": read.life,
        "seq": found.seq,
        "ts": _time_array(found.ts, reuse=True),  # the read's own array: its seconds are not read again
        "value": found.value,
    }
    return pd.DataFrame(columns, copy=False)


def category_codes(
    codes: np.ndarray, names: list[str], categories: list[str], dtype: type[np.integer] | None = None
) -> np.ndarray:
    """Codes into `names` as codes into `categories` (which hold every one of `names`), int32
    or `dtype`."""
    import numpy as np

    if names == categories:  # every label (or key) of the run read: the codes are already theirs
        return codes.astype(dtype or np.int32, copy=False)
    place = {name: at for at, name in enumerate(categories)}
    if len(names) == 1:  # one label or key read: every code is its place
        return np.full(len(codes), place[names[0]], dtype or np.int32)
    remap = np.array([place[name] for name in names], dtype or np.int32)
    return remap[codes] if len(codes) else np.zeros(0, remap.dtype)


def _categorical(codes: np.ndarray, names: list[str], categories: list[str]) -> pd.Categorical:
    import pandas as pd

    # Codes as small as pandas keeps them: made so at once, not made int32 and then copied.
    small = code_type(len(categories))
    return pd.Categorical.from_codes(
        category_codes(codes, names, categories, small), dtype=_category_type(tuple(categories))
    )


@functools.lru_cache(maxsize=16)
def _category_type(categories: tuple[str, ...]) -> pd.CategoricalDtype:
    """The categorical type of `categories`, made once for the reads of a run: pandas checks
    its categories (a hash table of them) each time one is made."""
    import pandas as pd

    return pd.CategoricalDtype(pd.Index(list(categories)))


def _life_column(found: Values, lives: dict[str, dict[int, int]]) -> np.ndarray:
    """Each point's life (storage.rules.lives_of), a run of equal (label, epoch) at a time."""
    import numpy as np

    count = len(found)
    if not count:
        return np.zeros(0, np.int64)
    starts = np.flatnonzero(
        np.concatenate(
            [[True], (found.label[1:] != found.label[:-1]) | (found.epoch[1:] != found.epoch[:-1])]
        )
    )
    lengths = np.diff(np.append(starts, count))
    labels, epochs = found.label[starts].tolist(), found.epoch[starts].tolist()
    each = [_life(lives.get(found.labels[lab], {}), epoch) for lab, epoch in zip(labels, epochs, strict=True)]
    return np.repeat(np.array(each, np.int64), lengths)


def _lives(run: RunSummary) -> dict[str, dict[int, int]]:
    """Each label's lives by lease epoch (storage.rules.lives_of)."""
    return {lab.label: lab.lives for lab in run.labels}


def _life(lives: dict[int, int], epoch: int) -> int:
    # An epoch stored after the run was read (the ingester goes on) is a restart since then.
    return lives.get(epoch, len(lives) + 1)


class _LogColumns:
    """Pages of log lines gathered column by column."""

    def __init__(self) -> None:
        self.label: list[str] = []
        self.epoch, self.life, self.seq, self.ts = array("q"), array("q"), array("q"), array("d")
        self.stream: list[str] = []
        self.level: list[str] = []
        self.text: list[str] = []

    def add(self, page: Sequence[LogLine], lives: dict[int, int]) -> None:
        self.label += [line.label for line in page]
        self.epoch.extend([line.epoch for line in page])
        self.life.extend([_life(lives, line.epoch) for line in page])
        self.seq.extend([line.seq for line in page])
        self.ts.extend([line.ts for line in page])
        self.stream += [line.stream for line in page]
        self.level += [line.level for line in page]
        self.text += [redact_line(line.text) for line in page]

    def table(self) -> pd.DataFrame:
        import numpy as np
        import pandas as pd

        epoch = np.frombuffer(self.epoch, dtype=np.int64)
        life = np.frombuffer(self.life, dtype=np.int64)
        seq = np.frombuffer(self.seq, dtype=np.int64)
        ts = np.frombuffer(self.ts, dtype=np.float64)
        # As `runbus logs` orders them: by ts, then label, epoch, seq, the order the pages came in.
        order = np.argsort(ts, kind="stable")
        return pd.DataFrame(
            {
                "label": _text(np.array(self.label, dtype=object)[order]),
                "lease_epoch": pd.Series(epoch[order]),
                "life": pd.Series(life[order]),
                "seq": pd.Series(seq[order]),
                "ts": _times(ts[order]),
                "stream": _text(np.array(self.stream, dtype=object)[order]),
                "level": _text(np.array(self.level, dtype=object)[order]),
                "text": _text(np.array(self.text, dtype=object)[order]),
            }
        )


# -- columns -------------------------------------------------------------------------------------


def _text(values: Sequence[str | None] | np.ndarray) -> pd.Series:
    """Text as pandas' own text dtype (`str`; missing values NaN)."""
    import pandas as pd

    return pd.Series(cast(Any, values), dtype="str")


def _integers(values: Sequence[int]) -> pd.Series:
    import pandas as pd

    return pd.Series(values, dtype="int64")


def _seconds(ts: float | None) -> float:
    return float("nan") if ts is None else ts


def _times(seconds: Sequence[float] | np.ndarray, reuse: bool = False) -> pd.Series:
    """Seconds since the epoch as UTC timestamps to the microsecond (_time_array) in a Series."""
    import pandas as pd

    return pd.Series(_time_array(seconds, reuse), copy=False)


def _time_array(seconds: Sequence[float] | np.ndarray, reuse: bool = False) -> Any:
    """Seconds since the epoch as UTC timestamps to the microsecond, a pandas DatetimeArray; NaN
    (and any value beyond what a timestamp can hold) as NaT. With `reuse`, `seconds` (a float64
    array the caller gives up) holds them: a table's timestamps cost no copy."""
    import pandas as pd

    whole = micros(seconds, reuse).view("datetime64[us]")
    try:
        # pandas' own constructor of an array it has checked: tz_localize("UTC") would copy the
        # column (8 bytes a value) to change nothing but its type.
        return cast(Any, pd.arrays.DatetimeArray)._simple_new(whole, dtype=pd.DatetimeTZDtype("us", "UTC"))
    except (AttributeError, TypeError):  # a pandas without it: the public way
        return cast(Any, pd.Series(whole, copy=False)).dt.tz_localize("UTC").array


def micros(seconds: Sequence[float] | np.ndarray, reuse: bool = False) -> np.ndarray:
    """Seconds since the epoch as whole microseconds (int64), NaT's value (int64's least) where
    NaN or beyond what a timestamp can hold; with `reuse`, in the buffer of `seconds` (a float64
    array the caller gives up)."""
    import numpy as np

    if reuse and isinstance(seconds, np.ndarray) and seconds.dtype == np.float64 and seconds.flags.writeable:
        whole = np.multiply(seconds, 1e6, out=seconds)
    else:
        whole = np.multiply(np.asarray(seconds, dtype=np.float64), 1e6)
    np.rint(whole, out=whole)
    with np.errstate(invalid="ignore"):
        # NaN compares False: bad too. Two bounds, not abs(): no column made for it.
        bad = ~((whole < MAX_MICROSECONDS) & (whole > -MAX_MICROSECONDS))
    any_bad = bool(bad.any())
    if any_bad:
        whole[bad] = 0
    out: np.ndarray = whole.view(np.int64)
    # Converted in place a slice at a time: numpy copies an overlapping source first, so the
    # slice bounds what that costs.
    for at in range(0, len(out), CAST_SLICE):
        out[at : at + CAST_SLICE] = whole[at : at + CAST_SLICE]
    if any_bad:
        out[bad] = np.iinfo(np.int64).min
    return out
