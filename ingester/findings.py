"""What the health detector reads of a live run's metrics besides its heartbeats: its stragglers
(from each label's compute or step times, the time lost to each counted as the steps come in) and
its anomalies (first NaN/inf values, labels that left the cross-rank band).

The stragglers are re-read whenever this worker stored new steps of their key since the last
read (or of any key while the run has no better key than a derived one: `perf/compute_s` comes
from a run's second step on), and at least every `steps_every` seconds (another worker may store
them): a read takes only
the steps since the tally's last counted one and each label's last WINDOW, as arrays, so a slow
rank is named a few of its steps after the rules could. The NaN/inf search at most every `every`
seconds per run; the band leavers at most every `band_every` seconds (they read every label's
128-step rollups, and a departure shows only once two of its 128-step buckets are closed)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import attrgetter, contains, eq, is_not
from typing import Any

from runbus.errors import StoreError
from runbus.storage import steptimes
from runbus.storage.anomalies import Anomaly, in_order, non_finite
from runbus.storage.base import Store
from runbus.storage.outliers import band_leavers
from runbus.storage.rollups import LAST, TS_AXIS
from runbus.storage.stragglers import WINDOW, StepTimes, Tally, find, latest
from runbus.wire import Event, of_kind

log = logging.getLogger("runbus.ingester")

# The keys whose values are a label's time per step, best first; without any, step times are
# derived from when DERIVED_FROM (else the run's first key) was logged.
TIME_KEYS = ("perf/compute_s", "perf/step_s")
DERIVED_FROM = "loss"
# The system figures put beside a straggler (its own, as its label samples them: producer/system.py),
# by the end of their key: its GPUs' utilisation, clock, power and temperature, its process's CPU.
FIGURES = (".util", ".sm_clock_mhz", ".power_w", ".temp_c", "proc.cpu_percent")
FIGURED = 5  # stragglers given figures at most, the first
_RUN, _STEP, _DATA = attrgetter("run"), attrgetter("step"), attrgetter("data")


@dataclass(slots=True)
class Findings:
    """One run's stragglers and anomalies as last read, and the running tally of lost time."""

    read_at: float = -math.inf
    steps_read_at: float = -math.inf
    # Whether this worker stored steps of the stragglers' key since they were read.
    arrived: bool = False
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    anomalies: list[dict[str, Any]] = field(default_factory=list)
    band_to: int | None = None  # band leavers are known up to this step (outliers.band_leavers)
    band_read_at: float = -math.inf
    band_leavers: list[Anomaly] = field(default_factory=list)
    tally: Tally = field(default_factory=Tally)
    source: str | None = None  # the key the step times come from
    time_key: bool = False  # whether its values are the times
    # Each label's latest heartbeat seen (an ended run's last verdict still says where it ran).
    beats: dict[str, Mapping[str, Any]] = field(default_factory=dict)


def _brought(events: Sequence[Event], run_id: str, key: str | None) -> bool:
    """Whether any of `events` of run `run_id` is at a step, and holds a value of `key` where
    given: lazily, in C, so that a batch is not filtered whole where its first event answers."""
    mine = compress(events, map(eq, map(_RUN, events), repeat(run_id)))
    if key is None:
        return any(map(is_not, map(_STEP, mine), repeat(None)))
    listed = list(mine)
    stepped = compress(listed, map(is_not, map(_STEP, listed), repeat(None)))
    return any(map(contains, map(_DATA, stepped), repeat(key)))


def _source(keys: list[str]) -> tuple[str, bool] | None:
    """The key a run's step times come from, and whether its values are the times."""
    for key in TIME_KEYS:
        if key in keys:
            return key, True
    plain = [k for k in keys if not k.startswith("perf/")]
    if DERIVED_FROM in plain:
        return DERIVED_FROM, False
    return (plain[0], False) if plain else None


def _choose_source(found: Findings, keys: list[str]) -> None:
    """Read the run's step times from the best of `keys` (counted afresh from a better key)."""
    source = _source(keys)
    if source is not None and source[0] != found.source:
        found.source, found.time_key, found.tally = source[0], source[1], Tally()


class FindingsReader:
    """Reads each live run's stragglers (as their steps arrive, at least every `steps_every`
    seconds) and anomalies (at most every `every` seconds) for the detector; forgets the runs no
    longer live."""

    def __init__(
        self, store: Store, every: float = 2.0, band_every: float = 10.0, steps_every: float = 1.0
    ) -> None:
        self.store = store
        self.every = every
        self.band_every = band_every
        self.steps_every = steps_every
        self._runs: dict[str, Findings] = {}

    def note(self, events: Sequence[Event], kinds: Mapping[str, int] | None = None) -> bool:
        """Note the runs whose stragglers `events` (a stored batch, whose events of each kind
        `kinds` counts where given) may change: steps of their key, or of any key while they
        have none or a key worse than the best (it may have come now); their stragglers are due.
        Whether there were any."""
        sources = {run_id: found.source for run_id, found in self._runs.items()}
        if not sources:
            return False
        # Filtered in C: this runs for every stored batch, where a loop in Python over its events
        # took a twentieth of a worker's CPU (bench/ingest.py); not at all where all are metrics.
        all_metrics = kinds is not None and kinds.get("metric") == len(events)
        metrics = events if all_metrics else of_kind(events, "metric")
        best = TIME_KEYS[0]
        runs = [
            run_id
            for run_id in set(map(_RUN, metrics)).intersection(sources)
            if _brought(metrics, run_id, best if sources[run_id] == best else None)
        ]
        for run_id in runs:
            self._runs[run_id].arrived = True
        return bool(runs)

    def forget_others(self, live: set[str]) -> None:
        """Drop what is kept of runs not in `live`."""
        for run_id in set(self._runs) - live:
            del self._runs[run_id]

    async def read(
        self, run_id: str, beats: Mapping[str, Mapping[str, Any] | None], fresh: bool = False
    ) -> Findings:
        """The run's findings, each part re-read when due (all of them if `fresh`: an ended run's)."""
        found = self._runs.setdefault(run_id, Findings())
        found.beats.update((label, beat) for label, beat in beats.items() if beat)
        now = time.monotonic()
        anomalies = fresh or now - found.read_at >= self.every
        steps = anomalies or found.arrived or now - found.steps_read_at >= self.steps_every
        if not steps:
            return found
        try:
            if anomalies:
                found.read_at = now
                await self._read_anomalies(run_id, found, fresh)
            found.steps_read_at, found.arrived = now, False
            await self._read_stragglers(run_id, found)
        except StoreError:
            raise  # the detector's tick is skipped, as for its other reads
        except Exception:  # a bug here must neither stop ingest nor the stall detector: kept as read
            log.exception("run %s: stragglers and anomalies not read", run_id)
        return found

    async def _read_anomalies(self, run_id: str, found: Findings, fresh: bool) -> None:
        keys = await self.store.metric_keys(run_id)
        if fresh or found.read_at - found.band_read_at >= self.band_every:
            found.band_read_at = found.read_at
            found.band_leavers, found.band_to = await band_leavers(self.store, run_id, keys)
        nans = await non_finite(self.store, run_id, keys)
        found.anomalies = [a.document() for a in in_order([*nans, *found.band_leavers])]
        _choose_source(found, keys)

    async def _read_stragglers(self, run_id: str, found: Findings) -> None:
        if found.source != TIME_KEYS[0]:  # a better key may have come since the keys were read
            _choose_source(found, await self.store.metric_keys(run_id))
        if found.source is None:
            return
        key, time_key = found.source, found.time_key
        times = await steptimes.read(self.store, run_id, key, time_key, WINDOW, since=found.tally.done + 1)
        found.tally.count(times)
        step_times = StepTimes(key, not time_key, latest(times), found.tally.lost)
        found.stragglers = find(step_times, found.beats)
        await self._add_figures(run_id, found.stragglers[:FIGURED])

    async def _add_figures(self, run_id: str, slow: list[dict[str, Any]]) -> None:
        """Give each of `slow` its latest system figures (`system`: key -> value), where sampled."""
        if not slow:
            return
        keys = [k for k in await self.store.system_keys(run_id) if k.endswith(FIGURES)]
        for straggler in slow:
            figures: dict[str, float] = {}
            for key in keys:
                rows = await self.store.open_buckets(run_id, key, TS_AXIS, [straggler["label"]], "system")
                if rows:
                    figures[key] = max(rows, key=lambda r: (r.epoch, r.bucket)).part[LAST]
            straggler["system"] = figures
