"""Helpers the integrations' tests share: a launcher-free environment, the one run a job made."""

from __future__ import annotations

import collections
import subprocess
import sys

from tests.helpers import ingest, read_store, unset_runbus

LAUNCHER_VARIABLES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "TORCHELASTIC_RUN_ID", "MASTER_PORT"}


def clean_env() -> dict[str, str]:
    """This process's environment without any RUNBUS_* variable, nor a launcher's rank."""
    return {k: v for k, v in unset_runbus().items() if k not in LAUNCHER_VARIABLES}


def run_job(argv: list[str], timeout: float = 100) -> subprocess.CompletedProcess[str]:
    """Run `python ARGV` in clean_env(); its output, once it exited 0."""
    result = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=clean_env(), timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def the_only_run(redis_url: str, store_url: str):
    """Ingest what Redis holds; the store must then hold exactly one run: its RunSummary."""
    ingest(redis_url, store_url)
    runs = read_store(store_url, "runs")
    assert len(runs) == 1, [r.run_id for r in runs]
    return read_store(store_url, "run", runs[0].run_id)


def series(store_url: str, run_id: str) -> dict[tuple[str, str], list[tuple[int | None, float]]]:
    """(label, metric) -> [(step, value), ...] of a run, in stored order."""
    points = collections.defaultdict(list)
    for point in read_store(store_url, "metrics", run_id):
        points[point.label, point.key].append((point.step, point.value))
    return points
