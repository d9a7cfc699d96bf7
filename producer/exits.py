"""Finishing live Runs when the process ends, with the exit status the process ends with.

- A normal end: 0. `sys.exit(code)` (and any SystemExit that ends the main thread): the status
  Python exits with, as `exit_code_of` reads it (None 0, an int its low 8 bits, else 1). An
  uncaught exception: 1; an uncaught KeyboardInterrupt: 130 (128 + SIGINT: Python then kills
  itself with SIGINT, which a shell shows as 130).
- SIGTERM (torchrun stops workers with it), SIGHUP and SIGINT, where their handler is SIG_DFL
  (their default action skips atexit): a handler finishes every Run with 128 + the signal, then
  lets the signal do what it would have done. Python's own SIGINT handler (KeyboardInterrupt)
  is left alone. A handler of the script's is never replaced.
- `os._exit(code)`: the Runs finish with `code` first (DDP scripts use it to skip a slow
  teardown); in a forked child whose Runs are its parent's, it exits at once.
- An uncaught exception in another thread ends only that thread (CPython exits 0 unless the
  main thread fails): the process's status is stored, the traceback is in the console.
- SIGKILL, and whatever kills the process from outside without a handler, cannot be seen from
  inside it: under `runbus run` its console keeper stores the end at once, with the exit status
  it reads (runbus.producer.keeper); otherwise the ingester marks a label crashed once it has
  been silent for `--crash-after`.

How the SystemExit's code is read: atexit handlers run after Python has taken the code from the
exception and dropped it (Py_FinalizeEx after _Py_HandleSystemExit), and sys.excepthook never
sees a SystemExit. On Python 3.12+ a sys.monitoring PY_UNWIND callback sees every exception that
leaves the main thread's outermost frame, `raise SystemExit(n)` included, at the cost of a
check per frame an exception unwinds. Python 3.11 has no such event short of tracing every call
(sys.settrace, sys.setprofile: too slow for a training loop), so there `sys.exit` is wrapped and
remembers the SystemExit it raises, with the main thread's outermost frame; at exit that frame's
last instruction says whether it returned (the SystemExit was caught: 0) or was left by an
exception. A SystemExit raised without sys.exit on 3.11 (`raise SystemExit(n)`) is not seen:
such a process is stored with 0, as one that ends normally.

Hooks added with at_end() run after the Runs are finished, with the same exit code:
runbus.producer.bootstrap stores there the console of a rank that made no Run.

A signal handler runs in the main thread, between two of its bytecodes: if that thread was
inside code that holds a lock finishing takes (a full outbox's wait, its Events, a finish under
way), finishing there would wait for itself forever. Such code is registered with
guard_signals(); a signal that interrupts it is deferred to its next safe_point(), a few
bytecodes or one wait slice later.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import CodeType, FrameType, TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from runbus.producer.run import Run

# The signals whose default action ends the process without atexit, handled where SIG_DFL.
ENDING_SIGNALS = ("SIGTERM", "SIGHUP", "SIGINT")
MONITORING_TOOL_IDS = (4, 3)  # sys.monitoring ids no tool is named for (debuggers, coverage...)

_live: list[Run] = []
_end_hooks: list[Callable[[int], None]] = []
_lock = threading.Lock()
_installed = False
_guarded: set[CodeType] = set()
_deferred: int | None = None  # a signal that interrupted guarded code, handled at its safe point
_ending = False  # a signal is being handled: another one waits for the first to re-raise it
_ended_by: BaseException | None = None  # what left the main thread's outermost frame, where seen
# sys.exit's last code (Python 3.11), with the frame it must leave to end the process: see
# ending_code. The code, not the SystemExit: a caught one's traceback is not kept alive.
_exit_raised: tuple[int, FrameType] | None = None
_real_exit = os._exit
_real_sys_exit = sys.exit


def exit_code_of(exc: BaseException) -> int:
    """The exit status a process ends with when `exc` leaves its main thread (as CPython's
    _Py_HandleSystemExit reads a SystemExit's code, and exit() keeps its low 8 bits)."""
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code & 0xFF if -(2**63) <= code < 2**63 else 0xFF  # past a C long: -1
        return 1  # a message, printed on stderr
    if isinstance(exc, KeyboardInterrupt):
        return 128 + signal.SIGINT
    return 1


def guard_signals(*functions: Callable[..., Any]) -> None:
    """Defer a signal that interrupts the main thread inside any of `functions` (which take
    locks that finishing takes) until one of them calls safe_point()."""
    _guarded.update(function.__code__ for function in functions)


def safe_point() -> None:
    """Handle a deferred signal now, unless a guarded caller further up still holds its locks
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


def ending_code() -> int:
    """The exit status this process is ending with, as far as it can be seen from inside (see
    the module doc): at exit, once the main thread has ended."""
    if _ended_by is not None:
        return exit_code_of(_ended_by)
    if _exit_raised is not None and not _returned(_exit_raised[1]):
        return _exit_raised[0]
    return 0


def _returned(frame: FrameType) -> bool:
    """Whether `frame`, which has ended, ended by returning rather than by an exception."""
    import dis

    try:
        return dis.opname[frame.f_code.co_code[frame.f_lasti]].startswith("RETURN")
    except IndexError:  # no such instruction: not a return
        return False


def _outermost(frame: FrameType | None) -> FrameType | None:
    while frame is not None and frame.f_back is not None:
        frame = frame.f_back
    return frame


def _at_exit() -> None:
    finish_all(ending_code())


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    global _ended_by
    if _ended_by is None and exc is not None:
        _ended_by = exc
    _previous_excepthook(exc_type, exc, tb)


def _on_unwind(code: CodeType, offset: int, exc: BaseException) -> None:
    """sys.monitoring's PY_UNWIND (Python 3.12+): an exception leaves a frame; the main thread's
    outermost frame's is what the process ends with."""
    global _ended_by
    if sys._getframe(1).f_back is None and threading.current_thread() is threading.main_thread():
        _ended_by = exc


def _sys_exit(*status: Any) -> NoReturn:
    """sys.exit on Python 3.11: remembers the SystemExit it raises, and the frame it must leave
    to end the process."""
    global _exit_raised
    try:
        _real_sys_exit(*status)
    except SystemExit as exc:
        if threading.current_thread() is threading.main_thread():
            outermost = _outermost(sys._getframe(1))
            if outermost is not None:
                _exit_raised = (exit_code_of(exc), outermost)
        raise
    raise AssertionError("unreachable: sys.exit returned")


def _exit_after_finishing(code: int) -> NoReturn:
    """os._exit: the Runs finish first, with `code` (a forked child has none of its parent's)."""
    with contextlib.suppress(BaseException):  # exiting now is the caller's one wish
        finish_all(code)
    _real_exit(code)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _deferred
    if _ending:
        return  # the first signal's handler re-raises it once the Runs are finished
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
    global _lock, _deferred, _ending, _ended_by, _exit_raised
    _lock = threading.Lock()
    _deferred, _ending, _ended_by, _exit_raised = None, False, None, None
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
    os._exit = _exit_after_finishing  # type: ignore[assignment]
    if not _watch_unwinding():
        sys.exit = _sys_exit
    if threading.current_thread() is threading.main_thread():
        for name in ENDING_SIGNALS:
            number = getattr(signal, name, None)
            if number is not None and signal.getsignal(number) is signal.SIG_DFL:
                signal.signal(number, _on_signal)


def _watch_unwinding() -> bool:
    """Register _on_unwind with sys.monitoring (Python 3.12+); False where it cannot be."""
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is None:
        return False
    for tool in MONITORING_TOOL_IDS:
        if monitoring.get_tool(tool) is None:
            monitoring.use_tool_id(tool, "runbus")
            monitoring.register_callback(tool, monitoring.events.PY_UNWIND, _on_unwind)
            monitoring.set_events(tool, monitoring.events.PY_UNWIND)
            return True
    return False


guard_signals(track, forget, live_runs)
