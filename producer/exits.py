"""Finishing live Runs when the process ends: normal exit, an uncaught exception, or SIGTERM.

torchrun stops workers with SIGTERM, whose default action skips atexit; a handler is installed
only where none is (SIG_DFL), finishes every Run with exit code 128+15, then lets the signal
do what it would have done. Hooks added with at_end() run after the Runs are finished, with the
same exit code: runbus.producer.bootstrap stores there the console of a rank that made no Run.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runbus.producer.run import Run

_live: list[Run] = []
_end_hooks: list[Callable[[int], None]] = []
_lock = threading.Lock()
_installed = False
_uncaught = False


def track(run: Run) -> None:
    """Finish `run` at process end unless it has finished by then."""
    with _lock:
        _live.append(run)
    _install()


def forget(run: Run) -> None:
    with _lock:
        if run in _live:
            _live.remove(run)


def live_runs() -> list[Run]:
    with _lock:
        return list(_live)


def at_end(hook: Callable[[int], None]) -> None:
    """Call `hook(exit_code)` at process end (exit, uncaught exception, SIGTERM), after the Runs."""
    _end_hooks.append(hook)
    _install()


def finish_all(exit_code: int) -> None:
    """Finish every live Run (each within its own finish timeout), then run the end hooks."""
    for run in live_runs():
        run.finish(exit_code=exit_code)
    for hook in list(_end_hooks):
        hook(exit_code)


def _at_exit() -> None:
    finish_all(1 if _uncaught else 0)


def _excepthook(exc_type, exc, tb) -> None:
    global _uncaught
    _uncaught = True
    _previous_excepthook(exc_type, exc, tb)


def _on_sigterm(signum, frame) -> None:
    finish_all(128 + signum)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


_previous_excepthook = sys.excepthook


def _after_fork_in_child() -> None:
    # Threads do not survive fork: the parent's Runs cannot ship from here, and their seq
    # numbers are the parent's. Their calls become no-ops; the child may init() its own label.
    global _lock
    _lock = threading.Lock()
    for run in _live:
        run._disown()
    _live.clear()


def _install() -> None:
    global _installed, _previous_excepthook
    if _installed:
        return
    _installed = True
    os.register_at_fork(after_in_child=_after_fork_in_child)
    atexit.register(_at_exit)
    _previous_excepthook = sys.excepthook
    sys.excepthook = _excepthook
    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
