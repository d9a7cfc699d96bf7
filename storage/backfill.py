"""The data migrations that roll up the values already stored (6: metrics, 7: system samples):
their reads (with `?` placeholders, storage/dialect.py) and what each page needs of its labels."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from runbus.storage import rollups
from runbus.storage.base import PointTable, point_table

# Migrations 6 and 7 roll up the values already stored, a page at a time: the labels first, then
# the pages in the table's key order, each past the last row of the one before.
STORED_LABELS_SQL = "SELECT id, run_id, start_epoch, start_data FROM labels"
StoredLabels = dict[int, tuple[str, int, str | None]]


def stored_labels(found: Iterable[Sequence[Any]]) -> StoredLabels:
    """Each label id's (run, start epoch, start data JSON) from the rows of STORED_LABELS_SQL."""
    return {row[0]: (row[1], row[2], row[3]) for row in found}


def stored_page_sql(table: PointTable) -> str:
    """A page of `table`'s stored values past a (label id, key, epoch, seq); its size the last
    argument (the backends' MIGRATION_PAGE)."""
    step = "step, " if table == "metrics" else ""
    return (
        f"SELECT label_id, key, epoch, seq, {step}ts, value FROM {point_table(table)} "
        "WHERE (label_id, key, epoch, seq) > (?, ?, ?, ?) ORDER BY label_id, key, epoch, seq LIMIT ?"
    )


def page_labels(
    labels: StoredLabels, fine: Iterable[rollups.FineKey], table: PointTable
) -> tuple[dict[int, str], dict[int, tuple[int, int | None]]]:
    """For a page's fine partials: each label id's series run, and its latest start's (epoch,
    restart count), as the backends' _roll_up takes them."""
    ids = {label_id for label_id, *_ in fine}
    run_of = {i: rollups.series_run(labels[i][0], table) for i in ids}
    return run_of, {i: _latest_start(*labels[i][1:]) for i in ids}


def _latest_start(epoch: int, start: str | None) -> tuple[int, int | None]:
    return epoch, rollups.restart_count(orjson.loads(start) if start else None)
