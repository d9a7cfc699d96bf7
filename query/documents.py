"""The JSON documents the CLI prints and the dashboard's API answers: one shape for each record.

A run's metadata (config, summary, name, tags) and its log lines are shown redacted
(`runbus.redact`) even where the store holds them as written by hand or by an older runbus; the
CLI's JSON text has the controls a terminal would obey escaped (`json_printable`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, replace
from typing import Any

import orjson

from runbus.redact import LineRedactor, redact, redact_text, safe_remote
from runbus.storage.anomalies import Anomaly
from runbus.storage.base import LabelSummary, LogLine, Point, RunSummary
from runbus.terminal import json_printable
from runbus.wire import finite_to_wire


def json_value(value: float) -> float | str:
    """A value as the wire writes it: non-finite floats become 'NaN', 'Infinity', '-Infinity'."""
    return finite_to_wire(value) if isinstance(value, float) else value


def dumps(document: Any) -> str:
    """`document` as indented JSON text, as the CLI prints it."""
    return json_printable(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode())


def run_head(run: RunSummary) -> dict[str, Any]:
    """A run's own fields, as the CLI's and the API's JSON documents start."""
    return {
        "run_id": run.run_id,
        "name": None if run.name is None else redact_text(run.name),
        "tags": [redact_text(tag) for tag in run.tags],
        "state": run.state,
        "primary": run.primary,
        "exit_code": run.exit_code,
        "started_ts": run.started_ts,
        "ended_ts": run.ended_ts,
        "last_ts": run.last_ts,
        "label_count": run.label_count,
        "counts": run.counts,
    }


def run_document(run: RunSummary) -> dict[str, Any]:
    """The `runbus show --json` object."""
    return {
        **run_head(run),
        "labels": [
            {
                "label": lab.label,
                "primary": lab.primary,
                "state": lab.state,
                "exit_code": lab.exit_code,
                "lease_epoch": lab.epoch,
                "life": lab.life,
                "last_seq": lab.last_seq,
                "events": lab.events,
                "missing": lab.missing,
                "gaps": [
                    {
                        "lease_epoch": g.epoch,
                        "life": lab.lives.get(g.epoch),
                        "first": g.first,
                        "last": g.last,
                        "dropped": g.dropped,
                    }
                    for g in lab.gaps
                ],
                **label_metadata(lab),
                "git": git_document(lab.start),
            }
            for lab in run.labels
        ],
        **run_metadata(run),
        "primary_refused": refused_primaries(run),
    }


def git_document(start: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A label's git state from its start data (runbus.producer.gitstate), as shown: its known
    fields only, strings redacted and the remote's credentials hidden (an entry written by hand
    may hold anything); None for a label that recorded none."""
    git = (start or {}).get("git")
    if not isinstance(git, Mapping):
        return None
    commit, branch, dirty, remote = (git.get(field) for field in ("commit", "branch", "dirty", "remote"))
    return {
        "commit": redact_text(commit) if isinstance(commit, str) else None,
        "branch": redact_text(branch) if isinstance(branch, str) else None,
        "dirty": dirty if isinstance(dirty, bool) else None,
        "remote": safe_remote(remote) if isinstance(remote, str) else None,
    }


def config_document(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """A run's config (or summary) as the CLI and the API show it: secrets redacted."""
    return None if config is None else redact(config)


def run_metadata(run: RunSummary) -> dict[str, Any]:
    """A run's merged config and summary, and which label set each value (`set_by`: a key of
    each to its label, and the labels that set the name and the tags shown)."""
    return {
        "config": config_document(run.config),
        "summary": config_document(run.summary),
        "set_by": {
            "config": _labels_by_key(run.set_by.config),
            "summary": _labels_by_key(run.set_by.summary),
            "name": run.set_by.name,
            "tags": run.set_by.tags,
        },
    }


def _labels_by_key(labels: dict[str, str]) -> dict[str, str]:
    # Keyed as the redacted config shows its keys: a key shaped like a secret is hidden too.
    return {redact_text(key): label for key, label in labels.items()}


def label_metadata(label: LabelSummary) -> dict[str, Any]:
    """What one label set: its config and summary, and the run's name and tags as it set them."""
    return {
        "config": redact(label.config),
        "summary": redact(label.summary),
        "name": None if label.name is None else redact_text(label.name),
        "tags": None if label.tags is None else [redact_text(tag) for tag in label.tags],
    }


def refused_primaries(run: RunSummary) -> list[dict[str, Any]]:
    """The labels that claimed the run's primary role while another held it, with when they
    last did (the claims were refused and changed nothing)."""
    return [
        {"label": lab.label, "ts": lab.primary_refused_ts}
        for lab in run.labels
        if lab.primary_refused_ts is not None
    ]


def runs_document(runs: Sequence[RunSummary]) -> list[dict[str, Any]]:
    """The `runbus runs --json` list: each run's own fields, its name, tags and summary."""
    return [
        {
            **{k: v for k, v in asdict(run).items() if k not in _NOT_LISTED},
            "name": None if run.name is None else redact_text(run.name),
            "tags": [redact_text(tag) for tag in run.tags],
            "summary": config_document(run.summary),
        }
        for run in runs
    ]


# What `runbus runs --json` leaves to `runbus show --json`.
_NOT_LISTED = ("labels", "counts", "config", "summary", "set_by")


def point_document(point: Point) -> dict[str, Any]:
    """One metric value, as `runbus metrics --json` lists it."""
    return {
        "label": point.label,
        "key": point.key,
        "step": point.step,
        "seq": point.seq,
        "lease_epoch": point.epoch,
        "ts": point.ts,
        "value": json_value(point.value),
    }


def shown_log_lines(lines: Iterable[LogLine]) -> list[LogLine]:
    """Log lines as they are shown, secrets redacted: each label's stream through its own
    LineRedactor, so that a private key stored a line per row is hidden too."""
    redactors: dict[tuple[str, str], LineRedactor] = {}
    shown = []
    for line in lines:
        redactor = redactors.get((line.label, line.stream))
        if redactor is None:
            redactor = redactors[line.label, line.stream] = LineRedactor()
        text = redactor(line.text)
        shown.append(line if text is line.text else replace(line, text=text))
    return shown


def log_document(line: LogLine) -> dict[str, Any]:
    """One log line, as `runbus logs --json` and the API's logs list it (of shown_log_lines)."""
    return {
        "label": line.label,
        "lease_epoch": line.epoch,
        "seq": line.seq,
        "ts": line.ts,
        "stream": line.stream,
        "level": line.level,
        "text": line.text,
    }


def anomaly_document(anomaly: Anomaly) -> dict[str, Any]:
    """A label's first NaN or inf of a key (storage.anomalies), or where it left the cross-rank
    band (storage.outliers): `runbus show --json`'s "anomalies" and GET /api/runs/RUN/anomalies."""
    return anomaly.document()
