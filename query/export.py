"""`runbus export`: a run's metrics, logs or system samples as CSV, JSON lines or Parquet.

The tables are the notebook API's (query/frames.py), complete, with the same columns and order.
CSV and JSON lines go to stdout unless --out names a file; Parquet needs --out. A file is written
beside its final name and moved there once complete, so a failed export leaves none half-written.
In JSON lines, ts is ISO 8601 with its UTC offset and a non-finite value is "NaN", "Infinity" or
"-Infinity", as `runbus metrics --json` writes it. On a terminal, stderr shows the rows written
(runbus.progress), unless the rows themselves go to it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

import orjson

from runbus.errors import CommandError, MissingDependency
from runbus.progress import Progress, shown_on
from runbus.query import frames
from runbus.query.cli import add_run_options, catching_up, known_run, read_run
from runbus.query.documents import json_value
from runbus.storage import Store

if TYPE_CHECKING:
    import pandas as pd

FORMATS = ("csv", "jsonl", "parquet")
# What a file's name says of its format, where --format is not given.
SUFFIXES = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
TABLES: dict[str, Callable[[Store, str], Awaitable[pd.DataFrame]]] = {
    "metrics": frames.history_table,
    "logs": frames.logs_table,
    "system": frames.system_table,
}
CHUNK_ROWS = 10_000  # rows turned into CSV or JSON lines at a time


def add_export(parser: argparse.ArgumentParser) -> None:
    add_run_options(parser)
    parser.add_argument(
        "--format",
        choices=FORMATS,
        help="csv, jsonl or parquet (default: from --out's suffix, else csv)",
    )
    parser.add_argument(
        "--what", choices=tuple(TABLES), default="metrics", help="which table (default metrics)"
    )
    parser.add_argument(
        "--out", metavar="PATH", help="write to this file (default stdout; parquet needs one)"
    )
    parser.set_defaults(handler=cmd_export)


def export_format(given: str | None, out: str | None) -> str:
    """The format to write: the one given, else the one --out's suffix names, else csv."""
    if given is not None:
        return given
    if out is None or out == "-":
        return "csv"
    return SUFFIXES.get(Path(out).suffix.lower(), "csv")


def cmd_export(args: argparse.Namespace) -> int:
    form = export_format(args.format, args.out)
    to_stdout = args.out is None or args.out == "-"
    if form == "parquet":
        if to_stdout:
            raise CommandError("parquet is written to a file: name one with --out PATH")
        require_pyarrow()
    frames.require_pandas()
    build = TABLES[args.what]

    async def exported(store: Store) -> pd.DataFrame:
        run = await known_run(store, args.run, args.redis, catching_up(args))
        return await build(store, run.run_id)

    # Progress on stderr, when it is a terminal and the rows are not printed on one.
    with Progress(
        "export", unit="rows", show=shown_on(sys.stderr) and not (to_stdout and shown_on(sys.stdout))
    ) as progress:
        progress.update(note=f"reading {args.run}")
        table: pd.DataFrame = read_run(args, exported)
        progress.update(0, total=len(table), note=f"writing {form}")
        if to_stdout:
            write(table, form, sys.stdout.buffer, progress)
            return 0
        with written(Path(cast(str, args.out))) as out:
            write(table, form, out, progress)
    return 0


def require_pyarrow(what: str = "parquet files") -> None:
    """Raise MissingDependency, naming the extra to install, where pyarrow is not installed."""
    try:
        import pyarrow  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "pyarrow":
            raise
        raise MissingDependency(
            f"{what} need pyarrow, which is not installed: pip install 'runbus[parquet]'"
        ) from exc


def write(table: pd.DataFrame, form: str, out: IO[bytes], progress: Progress | None = None) -> None:
    """`table` written to the binary stream `out` as `form` (rows told to `progress`)."""
    if form == "csv":
        write_csv(table, out, progress)
    elif form == "jsonl":
        write_jsonl(table, out, progress)
    else:
        table.to_parquet(out, engine="pyarrow", index=False)
        if progress is not None:
            progress.update(len(table))


def write_csv(table: pd.DataFrame, out: IO[bytes], progress: Progress | None = None) -> None:
    """CSV with a header line, CHUNK_ROWS rows at a time (the same text as in one call)."""
    table.iloc[:0].to_csv(out, index=False, encoding="utf-8")
    for start in range(0, len(table), CHUNK_ROWS):
        table.iloc[start : start + CHUNK_ROWS].to_csv(out, index=False, header=False, encoding="utf-8")
        if progress is not None:
            progress.update(min(len(table), start + CHUNK_ROWS))


def write_jsonl(table: pd.DataFrame, out: IO[bytes], progress: Progress | None = None) -> None:
    """One JSON object per row, with the table's column names (see the module for ts and NaN)."""
    for start in range(0, len(table), CHUNK_ROWS):
        chunk = table.iloc[start : start + CHUNK_ROWS]
        columns = [_json_column(chunk[name]) for name in chunk.columns]
        names = [str(name) for name in chunk.columns]
        rows = (orjson.dumps(dict(zip(names, row, strict=True))) for row in zip(*columns, strict=True))
        out.write(b"\n".join(rows) + b"\n")
        if progress is not None:
            progress.update(start + len(chunk))


def _json_column(column: pd.Series) -> list[Any]:
    import pandas as pd

    if isinstance(column.dtype, pd.DatetimeTZDtype):
        return [None if pd.isna(t) else t.isoformat() for t in column]
    if column.dtype.kind == "f":
        return [json_value(v) for v in column.tolist()]
    return column.astype(object).where(column.notna(), None).tolist()


@contextlib.contextmanager
def written(path: Path) -> Iterator[IO[bytes]]:
    """A file to write `path`'s content into: it becomes `path` once the block ends without error."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with open(partial, "xb") as out:
            yield out
        os.replace(partial, path)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise CommandError(f"cannot write {path}: {exc.strerror or exc}") from exc
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
