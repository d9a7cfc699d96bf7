"""A run's values as a pyarrow Table, built from the store's arrays without pandas.

What `runbus.Api().run(ID).arrow()` returns: the columns of the long history (query/frames.py
says each), labels and keys as dictionaries of all the run's labels and keys, ts as
timestamp[us, UTC], step null where none was given. pyarrow comes with the `parquet` extra.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from runbus.query import frames
from runbus.query.export import require_pyarrow
from runbus.storage.base import PointTable, Store

if TYPE_CHECKING:
    import pyarrow as pa


async def arrow_table(
    store: Store,
    run_id: str,
    table: PointTable = "metrics",
    keys: str | Iterable[str] | None = None,
    labels: str | Iterable[str] | None = None,
    steps: tuple[int | None, int | None] | None = None,
    exact: bool = False,
) -> pa.Table:
    """Every value of a run's `table` (of `keys`, of `labels`, at `steps`) as a pyarrow Table;
    `exact` as frames.read_values takes it."""
    require_pyarrow("Api().run(ID).arrow()")
    import numpy as np
    import pyarrow as pa

    read = await frames.read_values(store, run_id, table, keys, labels, steps, exact)
    found = read.found
    ts = frames.micros(found.ts, reuse=True)  # the read's own array: its seconds are not read again
    columns = {
        "label": _dictionary(frames.category_codes(found.label, found.labels, read.labels), read.labels),
        "key": _dictionary(frames.category_codes(found.key, found.keys, read.keys), read.keys),
        **({"step": pa.array(found.step, pa.int64(), mask=found.no_step)} if table == "metrics" else {}),
        "lease_epoch": pa.array(found.epoch, pa.int64()),
        "life": pa.array(read.life, pa.int64()),
        "seq": pa.array(found.seq, pa.int64()),
        "ts": pa.array(ts, pa.timestamp("us", tz="UTC"), mask=ts == np.iinfo(np.int64).min),
        "value": pa.array(found.value, pa.float64()),
    }
    return pa.table(columns)


def _dictionary(codes: object, names: list[str]) -> pa.DictionaryArray:
    import pyarrow as pa

    return pa.DictionaryArray.from_arrays(pa.array(codes, pa.int32()), pa.array(names, pa.string()))
