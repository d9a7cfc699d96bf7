"""The health detector that runs inside every ingest worker: it keeps each label's latest
heartbeat in the store, and every interval judges each live run (storage/health.py) and records
the verdict by compare and set, so that of N workers one records each change, and that one alone
runs the `--on-alert` command.

Nothing else is started: `runbus ingest` keeps every live run's health current by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import orjson

from runbus.errors import StoreError
from runbus.ingester.findings import FindingsReader
from runbus.storage.base import Store
from runbus.storage.beats import RunVitals
from runbus.storage.health import ALERTING, HealthSettings, LabelVitals, judge, redacted, silent_after
from runbus.storage.postmortem import judge_ended
from runbus.wire import Event, of_kind

log = logging.getLogger("runbus.ingester")

LAST_LINES = 10
ALERT_TIMEOUT = 60.0  # an --on-alert command running longer is killed
# Seconds between health checks while the store fails, doubled from the first to the last.
STORE_FAILING_WAIT, STORE_FAILING_WAIT_MAX = 5.0, 60.0
# Seconds from one health check to the next at least, when a stored batch brought steps of a run's
# stragglers' key before the interval is up: at 0.13 s steps a 1 s interval is up to 8 steps
# late, and a slow rank is named within 20 steps of the run's start (bench/stragglers.py).
SOONEST = 0.25


def process_state(pid: object) -> str | None:
    """What /proc says of process `pid` on this host: "running", "stopped" (SIGSTOP, or traced),
    "gone" (no such process, or a zombie), or None where it cannot be read."""
    if type(pid) is not int or pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except FileNotFoundError:
        return "gone"
    except (OSError, IndexError):
        return None
    state = fields[0] if fields else b""
    if state in (b"T", b"t"):
        return "stopped"
    return "gone" if state in (b"Z", b"X", b"x") else "running"


def _looked_at(vitals: LabelVitals, now: float, settings: HealthSettings, host: str) -> LabelVitals:
    """`vitals` with its process looked at, where it is on this host and has gone quiet."""
    beat = vitals.beat or {}
    if beat.get("host") != host or vitals.silent_for(now) <= silent_after(vitals, settings):
        return vitals
    return replace(vitals, process=process_state(beat.get("pid")))


class HealthKeeper:
    """Keeps the health of every live run current from one ingest worker."""

    def __init__(
        self,
        store: Store,
        settings: HealthSettings | None = None,
        interval: float = 1.0,
        on_alert: str | None = None,
    ) -> None:
        self.store = store
        self.settings = settings or HealthSettings()
        self.interval = interval
        self.on_alert = on_alert
        self.alerts = 0  # alerts this worker raised
        self._host = socket.gethostname()
        self._commands: set[asyncio.Task[None]] = set()
        self.findings = FindingsReader(store)
        self._steps_arrived = asyncio.Event()
        # Each live run's latest health object, for the ops endpoint's gauges.
        self.live: dict[str, dict[str, Any]] = {}

    async def note(self, events: Sequence[Event], kinds: Mapping[str, int] | None = None) -> None:
        """Keep the latest heartbeat of each label among `events` (a stored batch, whose events
        of each kind `kinds` counts where given); where it brought steps of a run's stragglers'
        key, check that run's health soon."""
        if self.findings.note(events, kinds):
            self._steps_arrived.set()
        if kinds is not None and not kinds.get("heartbeat"):
            return
        beats = of_kind(events, "heartbeat")
        if not beats:
            return
        try:
            await self.store.save_beats(beats)
        except StoreError as exc:  # the label's next beat comes within its interval
            log.debug("heartbeats not kept: %s", exc)

    async def run(self, stop: asyncio.Event) -> None:
        """Judge every live run each interval until `stop`, and sooner (SOONEST after the last
        check at the soonest) once a stored batch brought steps of a run's stragglers' key; while
        the store fails (locked, away), less and less often: the batches' writes, in the store's
        one thread too, come first."""
        wait = self.interval
        while not stop.is_set():
            self._steps_arrived.clear()
            try:
                await self.tick()
                wait = self.interval
            except StoreError as exc:
                wait = min(STORE_FAILING_WAIT_MAX, max(STORE_FAILING_WAIT, wait * 2))
                log.debug("health check skipped (next in %.0fs): %s", wait, exc)
            await self._rest(stop, wait, soon=wait == self.interval)
        if self._commands:
            await asyncio.wait(self._commands, timeout=ALERT_TIMEOUT)

    async def _rest(self, stop: asyncio.Event, wait: float, soon: bool) -> None:
        """Until `stop` or `wait` seconds; with `soon`, until steps arrive too (SOONEST at least)."""
        deadline = time.monotonic() + wait
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), min(wait, SOONEST) if soon else wait)
        left = deadline - time.monotonic()
        if stop.is_set() or left <= 0 or self._steps_arrived.is_set():
            return
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._steps_arrived.wait())]
        await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        for waiting in waits:
            waiting.cancel()

    async def tick(self) -> int:
        """Judge every run the store lists as live once; how many changes this worker recorded."""
        changed = 0
        runs = await self.store.health_inputs()
        live = {run.run_id for run in runs if run.state == "running"}
        self.findings.forget_others({run.run_id for run in runs})
        for run_id in set(self.live) - live:
            del self.live[run_id]
        for run in runs:
            changed += await self._judge(run)
        return changed

    async def _judge(self, run: RunVitals) -> bool:
        now = time.time()
        labels = [_looked_at(v, now, self.settings, self._host) for v in run.labels]
        ended = run.state != "running"
        if ended and judge_ended(run.state, labels, now, self.settings).settling:
            return False  # its labels' ends are not all known yet: judged again next time
        # Read for an ended run too: its last verdict keeps the run's stragglers and anomalies.
        beats = {v.label: v.beat for v in labels}
        found = await self.findings.read(run.run_id, beats, fresh=ended)
        rule = judge_ended if ended else judge
        verdict = rule(run.state, labels, now, self.settings, found.stragglers, found.anomalies)
        verdict = replace(verdict, band_to=found.band_to)
        key = verdict.key
        since = run.health_since if key == run.health_key else now
        for culprit in verdict.culprits:
            culprit["last_lines"] = await self.store.last_lines(run.run_id, culprit["label"], LAST_LINES)
        doc = verdict.document(since)
        if run.state == "running":
            self.live[run.run_id] = doc
        if not await self.store.record_health(run, verdict.state, key, doc, now):
            return False
        log.log(
            logging.WARNING if verdict.state in ALERTING else logging.INFO,
            "run %s: health %s%s",
            run.run_id,
            verdict.state,
            "".join(f"; {c['label']}: {c['reason']}" for c in verdict.culprits[:3]),
        )
        if verdict.state in ALERTING and self.on_alert:
            self.alerts += 1
            # Redacted as every reader shows it: a heartbeat written by hand may hold anything.
            task = asyncio.create_task(self._alert(redacted({"run": run.run_id, **doc})))
            self._commands.add(task)
            task.add_done_callback(self._commands.discard)
        return True

    async def _alert(self, alert: dict[str, Any]) -> None:
        """Run the --on-alert command with `alert` as JSON on its stdin."""
        assert self.on_alert is not None
        command: asyncio.subprocess.Process | None = None
        try:
            command = await asyncio.create_subprocess_shell(self.on_alert, stdin=asyncio.subprocess.PIPE)
            await asyncio.wait_for(command.communicate(orjson.dumps(alert)), ALERT_TIMEOUT)
        except TimeoutError:
            assert command is not None  # only its communicate() times out
            command.kill()
            await command.wait()
            log.error("--on-alert command ran past %.0fs and was killed", ALERT_TIMEOUT)
            return
        except OSError as exc:
            log.error("--on-alert command could not run: %s", exc)
            return
        if command.returncode:
            log.error("--on-alert command exited %d", command.returncode)
