"""`runbus ingest`: one worker in this process, or with `--workers N` N worker processes in one
consumer group and a supervisor over them. Either way each worker process is set up and run the
same way (ingester/process.py).

Worker i is consumer `{base}-{i}` (base: `--consumer`, else host-pid of the supervisor) in every
life: a worker restarted after a crash comes back under its old name and first re-reads the
entries it left pending, instead of waiting for another worker to claim them. A worker that exits
abnormally is restarted after a capped, doubling, jittered delay (reset once it has run for a
while); one that Redis or the store refused access is not restarted, since only a change of
configuration helps (the supervisor's exit code is then 1), nor a `--burst` one that gave up on
an unreachable Redis or store (`--give-up-after`): a burst restarted would never end. On
SIGTERM or SIGINT each worker gets SIGTERM, finishes and acknowledges its batches in flight, and
exits; one still running after drain timeout + margin is killed (its batches stay pending, so
nothing is lost, but the exit code is then 1). A second signal kills them at once.

Workers are started with multiprocessing's "spawn": a fresh interpreter each, given its settings
by pickle (never on a command line, where `ps` would show the store's password).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

from runbus import config
from runbus.ingester.worker import Worker, WorkerSettings

log = logging.getLogger("runbus.ingester")

# Set up a worker process before it runs (the CLI configures logging there); given its consumer name.
Setup = Callable[[str], None]
# A worker's exit code when Redis or the store refused access: not restarted (EX_CONFIG).
ACCESS_DENIED_EXIT = 78
# A burst worker's exit code when Redis or the store stayed unreachable: not restarted
# (EX_TEMPFAIL): a burst that restarted would never end.
GAVE_UP_EXIT = 75


@dataclass
class SupervisorSettings:
    """How many workers, how crashed ones come back, and how long a stop may take."""

    workers: int = 2
    http: tuple[str, int] | None = None  # worker i serves the ops endpoints on (host, port + i)
    restart_delay: float = 0.5  # the first restart's delay at most (half of it at least)
    max_restart_delay: float = 30.0
    stable_after: float = 60.0  # a worker that ran this long restarts without delay growth
    kill_margin: float = 5.0
    handle_signals: bool = True


@dataclass
class Slot:
    """Worker i across its lives."""

    index: int
    settings: WorkerSettings
    http: tuple[str, int] | None
    process: BaseProcess | None = None
    started: float = 0.0
    failures: int = 0  # lives in a row that ended abnormally before stable_after
    delay: float = 0.0  # before its latest restart
    restart_at: float | None = None
    restarts: int = 0
    exit_codes: list[int] = field(default_factory=list)


def die_with(parent: int) -> None:
    """On Linux, SIGTERM this process when `parent` dies: a SIGKILLed supervisor leaves no orphan
    workers behind, which a new supervisor would run beside under the same consumer names."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the line above
        sys.exit(0)


def run_child(
    settings: WorkerSettings, http: tuple[str, int] | None, setup: Setup | None, parent: int
) -> None:
    """The body of a worker process."""
    # Until the worker's own handlers are in place a terminal's Ctrl-C must not raise in here:
    # the supervisor forwards SIGTERM to every worker anyway.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with(parent)
    if setup is not None:
        setup(settings.consumer)
    worker = Worker(settings)
    code = worker.run(http)
    if worker.access_denied is not None:
        code = ACCESS_DENIED_EXIT
    elif worker.gave_up is not None:
        code = GAVE_UP_EXIT
    sys.exit(code)


class Supervisor:
    """Starts the workers, restarts crashed ones, and stops them all on a signal."""

    def __init__(
        self, worker: WorkerSettings, settings: SupervisorSettings | None = None, setup: Setup | None = None
    ) -> None:
        self.settings = settings or SupervisorSettings()
        if self.settings.workers < 1:
            raise ValueError(f"--workers must be at least 1, not {self.settings.workers}")
        self.worker = worker
        self.setup = setup
        self.slots = [
            Slot(
                index=i,
                settings=dataclasses.replace(
                    worker,
                    consumer=f"{worker.consumer}-{i}",
                    share=(i, self.settings.workers) if self.settings.workers > 1 else None,
                ),
                http=(self.settings.http[0], self.settings.http[1] + i)
                if self.settings.http and self.settings.http[1]
                else self.settings.http,
            )
            for i in range(self.settings.workers)
        ]
        # Jittered, so that workers that failed together (Redis lost) do not restart in step.
        self._restart_backoff = config.backoff(self.settings.max_restart_delay, self.settings.restart_delay)
        self._context = multiprocessing.get_context("spawn")
        self._signals = 0
        self._stop_deadline: float | None = None
        self._killed = False
        self._wake_r, self._wake_w = -1, -1

    def run(self) -> int:
        """Supervise until every worker has exited; 0 when all of them exited cleanly."""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        previous = {}
        if self.settings.handle_signals:
            previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        log.info(
            "supervisor %d starting %d workers, %s-0 to %s-%d",
            os.getpid(),
            len(self.slots),
            self.worker.consumer,
            self.worker.consumer,
            len(self.slots) - 1,
        )
        try:
            for slot in self.slots:
                self._start(slot)
            self._supervise()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self._kill_all()  # only after an error here: normally none is left
            os.close(self._wake_r)
            os.close(self._wake_w)
        clean = not self._killed and all(
            slot.exit_codes and slot.exit_codes[-1] in (0, -signal.SIGTERM) for slot in self.slots
        )
        log.info(
            "supervisor stopped: %d restarts; last exit codes %s",
            sum(slot.restarts for slot in self.slots),
            [slot.exit_codes[-1] if slot.exit_codes else None for slot in self.slots],
        )
        return 0 if clean else 1

    def request_stop(self) -> None:
        """Stop every worker (as SIGTERM does); callable from a signal handler."""
        self._signals += 1
        with contextlib.suppress(OSError):  # a full pipe wakes the loop all the same
            os.write(self._wake_w, b"\0")

    def _on_signal(self, signum: int, frame: object) -> None:
        self.request_stop()

    def _supervise(self) -> None:
        while True:
            now = time.monotonic()
            if self._signals:
                self._stop(now)
            self._reap(now)
            alive = [slot.process for slot in self.slots if slot.process is not None]
            deadline = self._stop_deadline
            if deadline is not None:
                if self._drained(now, deadline, alive):
                    return
            elif self._all_done(now, alive):
                return  # every worker finished by itself (--burst)
            ready = wait([*(p.sentinel for p in alive), self._wake_r], self._wait_time(now))
            if self._wake_r in ready:
                os.read(self._wake_r, 64)

    def _drained(self, now: float, deadline: float, alive: list[BaseProcess]) -> bool:
        """While stopping: whether every worker has exited; past `deadline` they are killed."""
        if not alive:
            return True
        if now >= deadline and not self._killed:
            log.error("workers still running %.0fs after SIGTERM: killing them", self._grace())
            self._kill_all()
        return False

    def _all_done(self, now: float, alive: list[BaseProcess]) -> bool:
        """Start the workers whose restart is due (added to `alive`); whether every worker has
        finished by itself (--burst)."""
        for slot in self.slots:
            if slot.restart_at is not None and now >= slot.restart_at:
                alive.append(self._start(slot))
        return not alive and all(slot.restart_at is None for slot in self.slots)

    def _wait_time(self, now: float) -> float | None:
        """How long to wait for a worker's exit or a signal: until the next restart is due, or
        the end of a stop's grace (None: no limit)."""
        wake_at = [slot.restart_at for slot in self.slots if slot.restart_at is not None]
        if self._stop_deadline is not None and not self._killed:
            wake_at = [self._stop_deadline]
        return max(0.0, min(wake_at) - now) if wake_at else None

    def _grace(self) -> float:
        return self.worker.drain_timeout + self.settings.kill_margin

    def _start(self, slot: Slot) -> BaseProcess:
        slot.restart_at = None
        slot.process = process = self._context.Process(
            target=run_child,
            args=(slot.settings, slot.http, self.setup, os.getpid()),
            name=slot.settings.consumer,
        )
        process.start()
        slot.started = time.monotonic()
        log.info("worker %s started (pid %d)", slot.settings.consumer, process.pid)
        return process

    def _reap(self, now: float) -> None:
        for slot in self.slots:
            process = slot.process
            if process is None or process.exitcode is None:
                continue
            code = process.exitcode
            process.close()
            slot.process = None
            slot.exit_codes.append(code)
            if self._stop_deadline is not None or code == 0:
                log.info("worker %s exited with %d", slot.settings.consumer, code)
                continue
            if code in (ACCESS_DENIED_EXIT, GAVE_UP_EXIT):
                log.error(
                    "worker %s %s (its error is above): not restarting it",
                    slot.settings.consumer,
                    "was refused access" if code == ACCESS_DENIED_EXIT else "gave up",
                )
                continue
            if now - slot.started >= self.settings.stable_after:
                slot.failures = 0
            slot.delay = self._restart_backoff.compute(slot.failures)
            slot.failures += 1
            slot.restart_at = now + slot.delay
            slot.restarts += 1
            log.error(
                "worker %s exited with %s; restarting it in %.1fs",
                slot.settings.consumer,
                _describe(code),
                slot.delay,
            )

    def _stop(self, now: float) -> None:
        if self._stop_deadline is None:
            log.info("stopping %d workers (at most %.0fs)", len(self.slots), self._grace())
            self._stop_deadline = now + self._grace()
            for slot in self.slots:
                slot.restart_at = None
                if slot.process is not None and slot.process.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(slot.process.pid, signal.SIGTERM)
        elif self._signals > 1 and not self._killed:
            log.warning("second signal: killing the workers now")
            self._kill_all()
        self._signals = min(self._signals, 1)

    def _kill_all(self) -> None:
        for slot in self.slots:
            if slot.process is not None and slot.process.exitcode is None:
                self._killed = True
                slot.process.kill()
                slot.process.join()


def _describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def ingest(
    settings: WorkerSettings,
    workers: int = 1,
    http: tuple[str, int] | None = None,
    setup: Setup | None = None,
) -> int:
    """`runbus ingest`: the exit code. One worker runs in this process; any other count starts a
    supervisor over that many worker processes, `setup` run first in each (the CLI configures
    logging there). With `http` (host, port), each worker serves its ops endpoints, worker i of
    several on port + i."""
    if workers == 1:
        return Worker(settings).run(http)
    return Supervisor(settings, SupervisorSettings(workers=workers, http=http), setup).run()
