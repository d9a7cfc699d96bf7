"""Run metadata derived from the labels' stored settings, and migration 5 that first derived it:
the SQL (with `?` placeholders, storage/dialect.py) and rows both backends use alike."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import orjson

from runbus.storage import rows
from runbus.storage.rules import LabelState, Setting

UPDATE_METADATA_SQL = (
    "UPDATE runs SET config = ?, summary = ?, name = ?, tags = ?, set_by = ? WHERE run_id = ?"
)


def metadata_rows(
    settings: Mapping[str, list[Setting]], primaries: Mapping[str, str | None]
) -> list[rows.Params]:
    """The UPDATE_METADATA_SQL rows that merge the stored settings (rows.run_settings) of the runs
    `primaries` names, each with its primary, into the runs' config, summary, name, tags and set_by."""
    return [(*rows.meta_columns(settings[run], primary), run) for run, primary in primaries.items()]


# Migration 5's reads: the stored starts, in the columns as of version 5 (whatever later versions
# add); then the runs whose metadata it derives, those a label has started (config stays None for
# the others, as it is until a label starts or sets any).
START_CONFIGS_SQL = (
    "SELECT id, run_id, label, start_epoch, start_seq, start_data, first_ts FROM labels "
    "WHERE start_data IS NOT NULL"
)
STARTED_RUNS_SQL = (
    "SELECT run_id, primary_label FROM runs "
    "WHERE run_id IN (SELECT run_id FROM labels WHERE start_data IS NOT NULL)"
)


def start_setting_rows(found: Iterable[Sequence[Any]]) -> list[rows.SettingRow]:
    """Migration 5's label_values rows (rows.setting_rows): each stored start's config (the rows
    of START_CONFIGS_SQL) as its label's settings."""
    settings: list[rows.SettingRow] = []
    for label_id, run, name, epoch, seq, start, first_ts in found:
        label = LabelState(run, name, start_pos=(epoch, seq), start_data=orjson.loads(start))
        settings += rows.setting_rows([(label_id, rows.start_event(run, label, first_ts))])
    return settings
