"""Finishing live Runs when the process ends: normal exit, an uncaught exception, or SIGTERM.

torchrun stops workers with SIGTERM, whose default action skips atexit; a handler is installed
only where none is (SIG_DFL), finishes every Run with exit code 128+15, then lets the signal
do what it would have done. Hooks added with at_end() run after the Runs are finished, with the
same exit code: runbus.producer.bootstrap stores there the console of a rank that made no Run.

The handler runs in the main thread, between two of its bytecodes: if that thread was inside
code that holds a lock finishing takes (a full outbox's wait, its Events, a finish under way),
finishing there would wait for itself forever. Such code is registered with guard_signals();
a SIGTERM that interrupts it is deferred to its next safe_point(), a few bytecodes or one
wait slice later.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runbus.producer.run import Run

_live: list[Run] = []
_end_hooks: list[Callable[[int], None]] = []
_lock = threading.Lock()
_installed = False
_uncaught = False
_guarded: set[CodeType] = set()
_deferred: int | None = None  # a SIGTERM that interrupted guarded code, handled at its safe point
_ending = False  # a SIGTERM is being handled: a second one waits for the first to re-raise it


def guard_signals(*functions: Callable[..., Any]) -> None:
    """Defer a SIGTERM that interrupts the main thread inside any of `functions` (which take
    locks that finishing takes) until one of them calls safe_point()."""
    _guarded.update(function.__code__ for function in functions)


def safe_point() -> None:
    """Handle a deferred SIGTERM now, unless a guarded caller further up still holds its locks
    (its own safe point will). Call it where the caller holds no lock."""
    if _deferred is None or threading.current_thread() is not threading.main_thread():
        return
    if not _in_guarded_code(sys._getframe(2)):  # callers above the one calling
        _end_by_signal(_deferred)


def _in_guarded_code(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code in _guarded:
            return True
        frame = frame.f_back
    return False


def track(run: Run) -> None:
    """Finish `run` at process end unless it has finished by then."""
    with _lock:
        _live.append(run)
    safe_point()
    _install()


def forget(run: Run) -> None:
    with _lock:
        if run in _live:
            _live.remove(run)
    safe_point()


def live_runs() -> list[Run]:
    with _lock:
        runs = list(_live)
    safe_point()
    return runs


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


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    global _deferred
    if _ending:
        return  # the first SIGTERM's handler re-raises it once the Runs are finished
    if _in_guarded_code(frame):
        _deferred = signum
        return
    _end_by_signal(signum)


def _end_by_signal(signum: int) -> None:
    global _deferred, _ending
    _ending, _deferred = True, None
    finish_all(128 + signum)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


_previous_excepthook = sys.excepthook


def _after_fork_in_child() -> None:
    # Threads do not survive fork: the parent's Runs cannot ship from here, and their seq
    # numbers are the parent's. Their calls become no-ops; the child may init() its own label.
    global _lock, _deferred, _ending
    _lock = threading.Lock()
    _deferred, _ending = None, False
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


guard_signals(track, forget, live_runs)
