"""A rank's console captured from its first byte, fds 1 and 2 included: the start of `runbus run`.

`runbus run` (runbus.producer.launch) puts runbus's sitecustomize.py (producer/boot/) first on
PYTHONPATH, so that every Python process of the job calls start() as its interpreter starts.
start() claims the console of a process that is a rank of the job:

- a process a launcher gave a rank (RANK, LOCAL_RANK, SLURM_PROCID, OMPI_COMM_WORLD_RANK,
  PMI_RANK), or the command `runbus run` was given itself, when that is Python (`runbus run --
  python train.py`: the job's one rank);
- never a launcher (torchrun's agent, `python -m torch.distributed.run`, accelerate, deepspeed,
  lightning): its workers are the ranks, and its own output is shown, not stored;
- never a rank's child. Claiming sets RUNBUS_CONSOLE_OWNER to the claimer's pid and rank
  variables; a process with the same rank variables (DataLoader workers, multiprocessing pools,
  subprocesses; fork or spawn) leaves the console to the rank, and what it writes is the rank's
  console (its fds 1 and 2 are the rank's pipes). The rank's own exec (same pid) claims again.

Claiming forks the keeper (runbus.producer.keeper), points fds 1 and 2 at pipes to it, makes
Python's sys.stdout and C's stdout line-buffered (what is written reaches the pipe, and the
store, in the order it was written), and returns at once: no thread runs in the rank until a Run
adopts the console. The keeper holds the lines until then.

A Run adopts the console as it starts its console capture (runbus.producer.console): the lines
from process start come first, and every later line follows, fd-level writes included. A rank
that never calls runbus.init() gets a Run made for it as it ends, which stores its console with
the exit code runbus.producer.exits reads (sys.exit's, an uncaught exception's, a signal's,
os._exit's). A rank killed otherwise (SIGKILL, a segfault) stores what its Run had shipped; the
keeper shows the rest on the terminal, and stores the label's end with the exit status it reads
(runbus.producer.keeper): each Run tells it of its lease (note_claim) and of its finish.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType

from runbus import config

# A launcher's rank variables: any of them makes a process a rank (runbus.producer.launchers
# reads what each means). Checked by name alone, before anything else is imported.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
# Commands that start ranks rather than being one: by module (`python -m X`) and by script name.
LAUNCHER_MODULES = frozenset(
    {
        "torch.distributed.run",
        "torch.distributed.launch",
        "accelerate.commands.launch",
        "accelerate.commands.accelerate_cli",
        "deepspeed.launcher.runner",
        "lightning.fabric.cli",
    }
)
LAUNCHER_SCRIPTS = frozenset({"torchrun", "accelerate", "deepspeed", "lightning", "fabric"})
# Interpreter options that take the next argument as their value.
_OPTIONS_WITH_VALUE = frozenset({"-W", "-X", "--check-hash-based-pycs"})
RELEASE_TIMEOUT = 5.0
FALLBACK_FINISH_TIMEOUT = 10.0
_PIPE_SIZE = 1 << 20

PutLine = Callable[[str, str, str], None]

_current: FdCapture | None = None


def rank_key(env: Mapping[str, str]) -> str:
    """The rank variables as `NAME=value,...` (absent ones empty): equal for a rank's children."""
    return ",".join(f"{name}={env.get(name, '')}" for name in RANK_VARIABLES)


def owner_marker(pid: int, env: Mapping[str, str]) -> str:
    """RUNBUS_CONSOLE_OWNER's value for a claimer: its pid and rank variables."""
    return f"{pid}:{rank_key(env)}"


def owned_by_another(marker: str, env: Mapping[str, str], pid: int) -> bool:
    """Whether another process with this process's rank variables claimed the console (mirrored
    in boot/sitecustomize.py, which reads the marker without importing runbus)."""
    owner, _, key = marker.partition(":")
    if owner == str(pid):
        return False
    pairs = [pair.partition("=") for pair in key.split(",") if pair]
    return all(env.get(name, "") == value for name, _, value in pairs)


def is_launcher(argv: Sequence[str]) -> bool:
    """Whether the interpreter command line `argv` (sys.orig_argv) runs a launcher of ranks."""
    args = iter(argv[1:])
    for arg in args:
        if arg in _OPTIONS_WITH_VALUE:
            next(args, None)
        elif arg == "-m" or (arg.startswith("-m") and not arg.startswith("--")):
            module = arg[2:] or next(args, "")
            return module in LAUNCHER_MODULES
        elif arg == "-c" or arg == "-" or (arg.startswith("-c") and not arg.startswith("--")):
            return False
        elif not arg.startswith("-"):
            return os.path.basename(arg) in LAUNCHER_SCRIPTS
    return False


def claims_console(env: Mapping[str, str], argv: Sequence[str], pid: int) -> bool:
    """Whether this process is a rank of a `runbus run` job whose console no other process holds."""
    launch = env.get(config.LAUNCH_ENV)
    if not launch:
        return False
    if (env.get(config.CONSOLE_ENV) or "primary") == "off" or is_launcher(argv):
        return False
    marker = env.get(config.CONSOLE_OWNER_ENV)
    if marker and owned_by_another(marker, env, pid):
        return False
    return any(env.get(name) for name in RANK_VARIABLES) or launch == str(pid)


def current() -> FdCapture | None:
    """This process's fd capture, if it claimed one (not a parent's, in a forked child)."""
    capture = _current
    return capture if capture is not None and capture.pid == os.getpid() else None


def start() -> FdCapture | None:
    """Claim this process's console if it is a rank of a `runbus run` job (see the module doc)."""
    global _current
    if current() is not None:
        return _current
    if not claims_console(os.environ, sys.orig_argv, os.getpid()):
        return None
    try:
        _current = _claim()
    except Exception as exc:  # the job runs on, its console shown but not stored
        with contextlib.suppress(Exception):
            sys.stderr.write(f"runbus: this process's console is not captured: {exc}\n")
        return None
    return _current


class FdCapture:
    """The rank's side of its keeper: the control and feed pipes, and the feed's reader thread."""

    def __init__(self, keeper_pid: int, control: int, feed: int, pipes: dict[int, tuple[int, int]]) -> None:
        self.pid = os.getpid()
        self.keeper_pid = keeper_pid
        self.control = control
        self.feed = feed
        self.pipes = pipes  # fd -> (st_dev, st_ino) of the pipe it was pointed at
        self.ever_adopted = False
        self.closed = False
        self._put_line: PutLine | None = None
        self._acks: dict[str, threading.Event] = {}
        self._tokens = 0
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None

    def points_at_keeper(self, fd: int) -> bool:
        """Whether `fd` is still the pipe to the keeper (the script may have redirected it)."""
        try:
            status = os.fstat(fd)
        except OSError:
            return False
        return self.pipes.get(fd) == (status.st_dev, status.st_ino)

    def adopt(self, echo: str, label: str, put_line: PutLine) -> bool:
        """Take the console's lines from now on, those from process start first, through
        `put_line(stream, level, text)`; the keeper echoes by `echo` with `[label] `."""
        if self.pid != os.getpid() or self.closed:
            return False
        with self._lock:
            self._put_line = put_line
            if not self._tell(f"adopt {echo} {label}\n"):
                self._put_line = None
                return False
            self.ever_adopted = True
            if self._reader is None:
                self._reader = threading.Thread(target=self._read_feed, name="runbus-console", daemon=True)
                self._reader.start()
        return True

    def release(self, timeout: float = RELEASE_TIMEOUT) -> bool:
        """Put every line written so far (partial lines cut), then take no more; False when the
        keeper did not answer within `timeout` seconds."""
        if self.pid != os.getpid() or self.closed:
            return False
        with self._lock:
            self._tokens += 1
            token = str(self._tokens)
            answered = self._acks[token] = threading.Event()
            if not self._tell(f"release {token}\n"):
                return False
        done = answered.wait(timeout)
        self._acks.pop(token, None)
        return done

    def note_claim(self, claim: dict[str, str | int]) -> None:
        """Tell the keeper that a Run of this rank holds a label's lease (run, label, token, seal
        secret, Redis URL, host, pid): if the rank dies before note_finished, the keeper stores
        the label's end. Over the private control pipe: the secret and URL go nowhere else."""
        if self.pid == os.getpid() and not self.closed:
            self._tell("claim " + json.dumps(claim, separators=(",", ":")) + "\n")

    def note_finished(self, run: str, label: str) -> None:
        """Tell the keeper that this Run's finish reached Redis: its end is stored."""
        if self.pid == os.getpid() and not self.closed:
            self._tell(f"finished {run} {label}\n")

    def write_marked(self, fd: int, flag: bytes, payload: bytes) -> bool:
        """Write a keeper mark to `fd` (1 or 2); False when `fd` no longer reaches the keeper."""
        from runbus.producer.keeper import marked

        if self.pid != os.getpid() or not self.points_at_keeper(fd):
            return False
        view = memoryview(marked(flag, payload))
        while view:
            view = view[os.write(fd, view) :]
        return True

    def _tell(self, message: str) -> bool:
        try:
            os.write(self.control, message.encode("ascii", "replace"))
        except OSError:  # the keeper is gone
            self.closed = True
            return False
        return True

    def _read_feed(self) -> None:
        from runbus.producer import keeper

        with open(self.feed, "rb", buffering=1 << 16, closefd=False) as feed:
            for kind, payload in keeper.read_frames(feed):
                stream = keeper.STREAM_OF_KIND.get(kind)
                put_line = self._put_line
                if stream is not None and put_line is not None:
                    put_line(stream, *keeper.split_line(payload))
                elif kind == keeper.DROPPED and put_line is not None:
                    count = payload.decode("ascii", "replace")
                    text = f"runbus: {count} console lines were not stored (more than the keeper holds)"
                    put_line("stderr", "WARNING", text)
                elif kind == keeper.ACK:
                    self._put_line = None
                    event = self._acks.get(payload.decode("ascii", "replace"))
                    if event is not None:
                        event.set()
        self.closed = True

    def _forget_in_child(self) -> None:
        # A forked child writes into the rank's pipes, as the rank's; it must not hold the rank's
        # control and feed ends (they tell the keeper when the rank is gone).
        for fd in (self.control, self.feed):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.closed = True


def _claim() -> FdCapture:
    from runbus.producer import console, environment, keeper

    identity = environment.resolve()
    echo = console.echo_mode(console.default_mode(), identity.primary, identity.rank)
    for fd in (1, 2):
        os.fstat(fd)  # OSError (a closed stdout): nothing to capture
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    feed_read, feed_write = os.pipe()
    control_read, control_write = os.pipe()
    _widen(feed_write)
    keeper_pid = os.fork()
    if keeper_pid == 0:  # the keeper: never returns into the rank's code
        try:
            for fd in (out_write, err_write, feed_read, control_write):
                os.close(fd)
            keeper.serve(out_read, err_read, control_read, feed_write, echo, identity.label)
        finally:
            os._exit(0)
    for fd in (out_read, err_read, feed_write, control_read):
        os.close(fd)
    os.dup2(out_write, 1)
    os.dup2(err_write, 2)
    os.close(out_write)
    os.close(err_write)
    pipes = {fd: (os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (1, 2)}
    capture = FdCapture(keeper_pid, control_write, feed_read, pipes)
    os.environ[config.CONSOLE_OWNER_ENV] = owner_marker(capture.pid, os.environ)
    _line_buffered()
    _install(capture)
    return capture


def _widen(fd: int) -> None:
    """A bigger pipe for the feed (Linux): the rank reads it when it has the GIL."""
    import fcntl

    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)


def _line_buffered() -> None:
    """Line-buffer Python's sys.stdout and C's stdout, as they were for a terminal: each line
    reaches the pipe when written, in order with fd-level writes, and is shown at once."""
    if isinstance(sys.stdout, io.TextIOWrapper) and not sys.stdout.line_buffering:
        sys.stdout.reconfigure(line_buffering=True)
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        c_stdout = ctypes.c_void_p.in_dll(libc, "stdout")
        libc.setvbuf(c_stdout, None, 1, 0)  # _IOLBF, before anything was written to it
    except (OSError, ValueError, AttributeError):  # not glibc: C's stdout stays as it was
        pass


def _install(capture: FdCapture) -> None:
    # redis imports concurrent.futures.thread, which cannot be first imported once the
    # interpreter is shutting down, when store_unadopted may need redis: import it now (7 ms).
    import concurrent.futures.thread  # noqa: F401

    from runbus.producer import exits

    os.register_at_fork(after_in_child=capture._forget_in_child)
    exits.at_end(store_unadopted)  # installs exits' hooks: excepthook, atexit, signals, os._exit
    global _previous_excepthook
    _previous_excepthook = sys.excepthook
    sys.excepthook = _excepthook


def store_unadopted(exit_code: int) -> None:
    """A Run for a rank that never made one, storing its console: at its end, once."""
    capture = current()
    if capture is None or capture.ever_adopted or capture.closed:
        return
    producer = sys.modules.get("runbus.producer")
    if producer is not None and producer._active:  # the script made Runs of its own (console off)
        return
    from runbus.producer import init

    try:
        run = init(system_interval=None, finish_timeout=FALLBACK_FINISH_TIMEOUT)
    except Exception as exc:  # at the rank's exit: say why, never fail the exit over it
        sys.stderr.write(f"runbus: this rank's console is not stored: {exc}\n")
        return
    run.finish(exit_code=exit_code)
    if _interrupted and exit_code == 128 + signal.SIGINT:
        _die_of_sigint()


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    global _interrupted
    _interrupted = issubclass(exc_type, KeyboardInterrupt)
    _previous_excepthook(exc_type, exc, tb)


_previous_excepthook = sys.excepthook
_interrupted = False  # the uncaught exception was a KeyboardInterrupt


def _die_of_sigint() -> None:
    """End as Python ends after an uncaught Ctrl-C: killed by SIGINT. Python would do it after
    its own finalisation, but forgets to once code has been exec'd from a string since the
    interrupt (redis's first import, in store_unadopted, does)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
