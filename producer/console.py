"""Console capture: this process's stdout, stderr and `logging` records as `log` events of a Run.

sys.stdout and sys.stderr are replaced by tees. Every write still reaches the terminal (or not,
by the echo rule below) at once; the captured copy is cut into lines, one `log` event per line:

- A line ends at "\\n" (or "\\r\\n"). A partial line waits for its newline, and is cut only when
  it reaches MAX_LINE_CHARS or the capture stops; flush() does not cut it, so `print(...,
  end="", flush=True)` prompts and progress bars store whole lines.
- A bare "\\r" overwrites the line, as on a terminal: a progress bar stores its last state.
- Bytes written to `.buffer` are decoded as UTF-8 with replacement characters; text that cannot
  be encoded as UTF-8 (lone surrogates) is stored with replacement characters too.
- Levels: stdout lines are INFO, stderr lines WARNING, and a line of either stream that looks
  like an error is ERROR: a traceback (every line, through its exception line), an exception
  line (`ValueError: …`), the words ERROR / CRITICAL / FATAL, `error:`, a fatal Python error.

`logging` records are shipped as records (stream "logging", their own level, the message
formatted as `logging.Formatter()` does) when they are made, that is once their logger's level
lets them through, whatever handlers print them. This hooks the log-record factory, not the root
logger: a handler there would make `logging.basicConfig()` a no-op and silence logging's
last-resort output. The text a StreamHandler prints for a shipped record is echoed but not
captured a second time. Records of the `runbus` and `redis` loggers are echoed, never stored:
they are about shipping itself. Neither are records that a `run.logging_handler()` of the same
Run will ship anyway.

Only what Python code writes is captured this way: C and C++ libraries (NCCL, gloo) writing to
the file descriptors directly reach the terminal unchanged and are not stored. Under `runbus run`
the whole console is captured instead, fds 1 and 2 included, from the process's start ("fd mode",
runbus.producer.bootstrap): a keeper process reads the fds, echoes by the rule below and cuts the
lines (LineCutter, LineLevels); the Run adopts them, those from before init() first. Python's
streams are then only marked: the text of a record stored as a record, and runbus's own
messages, are shown but not stored; records go through the keeper, in order with stderr.

Echo (what still reaches the terminal), by `console` mode:

- "primary": the primary, and any process not launched as a rank (no RANK), echo unchanged;
  the other ranks echo only ERROR lines and records (and runbus's own warnings), prefixed with
  `[label] `.
- "all": every line of every rank, prefixed with `[label] `.
- "off": no capture at all (init() never builds a ConsoleCapture).

One capture per process: sys.stdout belongs to one label, so a second Run in the same process
logs without one. Forked children (DataLoader workers) echo but do not capture: their copy of
the Run has no shipper.
"""

from __future__ import annotations

import codecs
import contextlib
import logging
import os
import re
import sys
import threading
import traceback
import weakref
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, BinaryIO, Generic, TextIO, TypeVar

from runbus.config import CONSOLE_ENV

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

    from runbus.producer.bootstrap import FdCapture
    from runbus.producer.run import Run

MODES = ("primary", "all", "off")
MAX_LINE_CHARS = 1 << 16
OWN_LOGGERS = ("runbus", "redis")
# Set on a record that is stored as a record (by the capture or by the Run's own logging
# handler), so that the text a StreamHandler prints for it is not stored a second time.
SHIPPED = "runbus_shipped"

_TOKENS = re.compile(r"\r\n|\n|\r|[^\r\n]+")
_LINE_ENDS = frozenset({"\n", "\r\n"})
_CR = "\r"
_TRACEBACK_START = re.compile(
    r"^(?:Traceback \(most recent call last\):|Exception in thread |Exception ignored in"
    r"|During handling of the above exception|The above exception was the direct cause)"
)
_ERROR_WORDS = re.compile(
    r"\b(?:ERROR|CRITICAL|FATAL)\b|\berror:|^Fatal Python error|^Segmentation fault"
    # What C and C++ print as a process dies: an uncaught C++ exception, abort().
    r"|^terminate called|^\s*what\(\):|\(core dumped\)|^Aborted\b"
)
_EXCEPTION_LINE = re.compile(r"(?:[A-Za-z_]\w*\.)*\w*(?:Error|Exception|Interrupt)(?::|$)")
# Substrings every error line has: most lines are ruled out by these alone, without a regex.
_ERROR_HINT = re.compile(
    r"rror|RROR|xception|Interrupt|FATAL|CRITICAL|Segmentation|terminate|what\(\)|dumped|Abort"
)
_TRACEBACK_HINTS = ("Traceback", "Exception", "During", "The above", "[rank")
# torch.distributed's excepthook prints tracebacks with this prefix on every line.
_TORCH_RANK_PREFIX = re.compile(r"\[rank\d+\]: ")
_STREAM_EMIT = logging.StreamHandler.emit.__code__

_lock = threading.Lock()
_owner: ConsoleCapture | None = None
_tees: weakref.WeakSet[_TextTee] = weakref.WeakSet()


def check_mode(mode: object) -> str:
    """`mode` if it is a console mode, else ValueError."""
    if mode not in MODES:
        raise ValueError(f"console must be one of {', '.join(MODES)}; got {mode!r}")
    return mode


def echo_mode(mode: str, primary: bool, rank: int | None) -> str:
    """What a process shows of its console: "raw" (unchanged: the primary, or a process not
    launched as a rank), "prefixed" (every line with `[label] `, mode "all"), "errors" (only ERROR
    lines, prefixed: the other ranks, mode "primary")."""
    if mode == "all":
        return "prefixed"
    return "raw" if primary or rank is None else "errors"


def default_mode(env: Mapping[str, str] | None = None) -> str:
    """RUNBUS_CONSOLE, else "primary"."""
    env = os.environ if env is None else env
    return check_mode(env.get(CONSOLE_ENV) or "primary")


def clean_text(text: str) -> str:
    """`text` as valid UTF-8: lone surrogates (from undecodable bytes) become U+FFFD."""
    if text.isascii():
        return text
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return text


class LineLevels:
    """The level of each line of one stream; remembers whether it is inside a traceback."""

    def __init__(self, default: str) -> None:
        self.default = default
        self.in_traceback = False

    def level(self, line: str) -> str:
        if line.startswith(_TRACEBACK_HINTS):
            prefix = _TORCH_RANK_PREFIX.match(line)
            if prefix:
                line = line[prefix.end() :]
            if _TRACEBACK_START.match(line):
                self.in_traceback = True
                return "ERROR"
        if self.in_traceback:
            if not line or line[0] in " \t":
                return "ERROR"
            self.in_traceback = False  # the exception line ends it
            return "ERROR"
        if not _ERROR_HINT.search(line):
            return self.default
        return "ERROR" if _EXCEPTION_LINE.match(line) or _ERROR_WORDS.search(line) else self.default


class LineCutter:
    """Cuts a stream's text into lines as a terminal shows them, and hands each to `emit`.

    A line ends at "\\n" or "\\r\\n"; a bare "\\r" overwrites the line; a partial line waits for
    its newline and is cut only at MAX_LINE_CHARS or by end().
    """

    __slots__ = ("_emit", "_overwrite", "_pieces", "_size")

    def __init__(self, emit: Callable[[str], None]) -> None:
        self._emit = emit
        self._pieces: list[str] = []
        self._size = 0
        self._overwrite = False

    def feed(self, text: str) -> None:
        if text == "\n":  # print()'s end
            self._overwrite = False
            self._end_line()
            return
        if not text:  # write(""): no line to start
            return
        if "\n" not in text and _CR not in text:
            self._add(text)
            return
        for token in _TOKENS.findall(text):
            if token in _LINE_ENDS:
                self._overwrite = False
                self._end_line()
            elif token == _CR:
                self._overwrite = True
            else:
                self._add(token)

    def _add(self, piece: str) -> None:
        """Add text without a line end to the partial line (replacing it after a bare CR)."""
        if self._overwrite:
            self._pieces.clear()
            self._size = 0
            self._overwrite = False
        self._pieces.append(piece)
        self._size += len(piece)
        if self._size >= MAX_LINE_CHARS:
            self._spill()

    def end(self) -> None:
        """Hand over the partial line, if any (the stream stops here)."""
        if self._pieces:
            self._end_line()
        self._overwrite = False

    def _end_line(self) -> None:
        line = "".join(self._pieces)
        self._pieces.clear()
        self._size = 0
        self._emit(line)

    def _spill(self) -> None:
        text = "".join(self._pieces)
        cut = len(text) - len(text) % MAX_LINE_CHARS
        for start in range(0, cut, MAX_LINE_CHARS):
            self._emit(text[start : start + MAX_LINE_CHARS])
        self._pieces = [text[cut:]] if cut < len(text) else []
        self._size = len(text) - cut


class Prefixer:
    """Puts `prefix` at the start of every line of a stream's echo (a "\\r" starts a line too)."""

    __slots__ = ("at_line_start", "prefix")

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.at_line_start = True

    def __call__(self, text: str) -> str:
        out = []
        for token in _TOKENS.findall(text):
            if self.at_line_start and token not in _LINE_ENDS:
                out.append(self.prefix)
            out.append(token)
            self.at_line_start = token in _LINE_ENDS or token == _CR
        return "".join(out)


StreamT = TypeVar("StreamT", bound=IO[Any])


class _StandIn(Generic[StreamT]):
    """What the stand-ins for a stream share: flush() and every attribute they do not define
    are the stream's (`_original`)."""

    _original: StreamT

    def flush(self) -> None:
        self._original.flush()

    def __getattr__(self, name: str) -> Any:
        original = self.__dict__.get("_original")
        if original is None:  # half-built (copy, pickle): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(original, name)


class _TextTee(_StandIn[TextIO]):
    """Stands in for sys.stdout or sys.stderr: echoes each write and captures it by lines."""

    def __init__(self, capture: ConsoleCapture, original: TextIO, name: str, default_level: str) -> None:
        self._capture = capture
        self._echo_mode = capture.echo
        self._original = original
        self._name = name
        self._levels = LineLevels(default_level)
        self._cutter = LineCutter(self._emit)
        self._prefixed = Prefixer(capture.prefix)
        self._capturing = True
        self._lock = threading.RLock()
        self._binary: _BinaryTee | None = None
        _tees.add(self)

    # -- the file interface ----------------------------------------------------------------------

    def write(self, text: str) -> int:
        if type(text) is not str and not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if not self._capturing:
            return self._original.write(text)
        caller = sys._getframe(1)
        with self._lock:
            if caller.f_code is _STREAM_EMIT:  # the text of a logging record
                record = caller.f_locals.get("record")
                self._route(text, record if isinstance(record, logging.LogRecord) else None)
            elif threading.current_thread().name.startswith("runbus-"):
                self._echo(text, always=True)
            else:
                if self._echo_mode == "raw":
                    self._original.write(text)
                else:
                    self._echo(text, always=False)
                self._feed(text)
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    @property
    def buffer(self) -> _BinaryTee:
        if self._binary is None:
            self._binary = _BinaryTee(self, self._original.buffer)
        return self._binary

    def __repr__(self) -> str:
        return f"<runbus console tee of {self._original!r}>"

    # -- echo and capture ------------------------------------------------------------------------

    def _route(self, text: str, record: logging.LogRecord | None) -> None:
        if record is not None:
            if record.name.startswith(OWN_LOGGERS):
                self._echo(text, always=True)
                return
            if getattr(record, SHIPPED, False):
                self._echo(text, always=record.levelno >= logging.ERROR)
                return
        elif threading.current_thread().name.startswith("runbus-"):
            self._echo(text, always=True)
            return
        self._echo(text, always=False)
        self._feed(text)

    def _echo(self, text: str, always: bool) -> None:
        echo = self._echo_mode
        if echo == "raw":
            self._original.write(text)
        elif echo == "prefixed" or always:
            self._write_prefixed(text)

    def _write_prefixed(self, text: str) -> None:
        self._original.write(self._prefixed(text))

    def _feed(self, text: str) -> None:
        self._cutter.feed(text)

    def _emit(self, line: str, level: str | None = None, echo: bool = True) -> None:
        level = level or self._levels.level(line)
        self._capture.put_line(self._name, level, line)
        if echo and level == "ERROR" and self._echo_mode == "errors":
            prefix = "" if line.startswith(self._capture.prefix[:-1]) else self._capture.prefix
            self._original.write(f"{prefix}{line}\n")
            self._original.flush()

    # -- the capture's side ----------------------------------------------------------------------

    def record_lines(self, text: str, level: str) -> None:
        """Store `text` line by line at `level`, without echoing it."""
        with self._lock:
            if self._capturing:
                for line in text.splitlines():
                    self._emit(line, level, echo=False)

    def detach(self) -> None:
        """Store the partial line, then pass every later write straight through."""
        with self._lock:
            if not self._capturing:
                return
            self._cutter.end()
            self._capturing = False

    def forget_after_fork(self) -> None:
        self._lock = threading.RLock()
        self._capturing = False


class _BinaryTee(_StandIn[BinaryIO]):
    """Stands in for sys.stdout.buffer: bytes are echoed as bytes and captured as UTF-8 text."""

    def __init__(self, text_tee: _TextTee, original: BinaryIO) -> None:
        self._text_tee = text_tee
        self._original = original
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def write(self, data: ReadableBuffer) -> int:
        size = memoryview(data).nbytes
        tee = self._text_tee
        if not tee._capturing:
            return self._original.write(data)
        with tee._lock:
            text = self._decoder.decode(bytes(data))
            if tee._echo_mode == "raw":
                self._original.write(data)
                tee._feed(text)
            else:
                tee._route(text, None)
        return size


class _MarkingTee(_StandIn[TextIO]):
    """Stands in for sys.stdout or sys.stderr while the keeper captures fds 1 and 2 (fd mode).

    Every write goes to the stream unchanged, to be captured through the fd in order with what C
    code and child processes write there. Only text that must be shown but not stored is marked
    for the keeper: the text a StreamHandler prints for a record stored as a record, and what
    runbus's own threads and loggers print.
    """

    def __init__(self, capture: ConsoleCapture, original: TextIO, fd_capture: FdCapture) -> None:
        self._capture = capture
        self._original = original
        self._fd_capture = fd_capture
        self._marking = True

    def write(self, text: str) -> int:
        if self._marking:
            caller = sys._getframe(1)
            if caller.f_code is _STREAM_EMIT:  # the text of a logging record
                record = caller.f_locals.get("record")
                if isinstance(record, logging.LogRecord):
                    if record.name.startswith(OWN_LOGGERS):
                        return self._mark(text, always=True)
                    if getattr(record, SHIPPED, False):
                        return self._mark(text, always=record.levelno >= logging.ERROR)
            elif threading.current_thread().name.startswith("runbus-"):
                return self._mark(text, always=True)
        return self._original.write(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def detach(self) -> None:
        self._marking = False

    def _mark(self, text: str, always: bool) -> int:
        from runbus.producer.keeper import ALWAYS, RULE

        try:
            fd = self._original.fileno()
        except (AttributeError, OSError, ValueError):
            fd = -1
        try:
            data = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            data = text.encode("utf-8", "replace")
        self._original.flush()  # what was written before goes first
        if not self._fd_capture.write_marked(fd, ALWAYS if always else RULE, data):
            return self._original.write(text)  # no keeper reads this fd: plain text
        return len(text)

    def __repr__(self) -> str:
        return f"<runbus console marker of {self._original!r}>"


class _RecordFactory:
    """Wraps the log-record factory: ships each record it makes while its capture is on."""

    def __init__(self, capture: ConsoleCapture, previous: Callable[..., logging.LogRecord]) -> None:
        self.capture = capture
        self.previous = previous
        self.active = True
        self.formatter = logging.Formatter()

    def __call__(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        record = self.previous(*args, **kwargs)
        if not self.active or self.capture.pid != os.getpid():
            return record
        name = record.name
        # makeLogRecord() makes an empty record (name None) to fill in: a copy of a record
        # made elsewhere, left to be captured as text if a StreamHandler prints it.
        if not isinstance(name, str) or name.startswith(OWN_LOGGERS):
            return record
        if threading.current_thread().name.startswith("runbus-"):
            return record
        if self._shipped_by_handler(name):
            setattr(record, SHIPPED, True)
            return record
        try:
            text = self.formatter.format(record)
        except Exception:  # bad format arguments: logging reports them when a handler formats
            return record
        self.capture.put_record(record.levelname, text)
        setattr(record, SHIPPED, True)
        return record

    def _shipped_by_handler(self, name: str) -> bool:
        from runbus.producer.handler import RunHandler

        run = self.capture.run
        logger: logging.Logger | None = logging.getLogger(name)
        while logger is not None:
            if any(isinstance(h, RunHandler) and h.run is run for h in logger.handlers):
                return True
            logger = logger.parent if logger.propagate else None
        return False


class ConsoleCapture:
    """One Run's hold on the process console; start() installs the tees, stop() restores."""

    def __init__(self, run: Run, mode: str) -> None:
        self.run = run
        self.mode = check_mode(mode)
        ident = run.identity
        self.echo = echo_mode(mode, ident.primary, ident.rank)
        self.prefix = f"[{ident.label}] "
        self.pid = os.getpid()
        self._tees: dict[str, _TextTee | _MarkingTee] = {}
        self._factory: _RecordFactory | None = None
        self._repointed: list[tuple[logging.StreamHandler[Any], _TextTee | _MarkingTee]] = []
        self._fd_capture: FdCapture | None = None
        self._tracebacks: list[str] = []  # to store after the keeper's lines, in fd mode

    @classmethod
    def start_for(cls, run: Run, mode: str) -> ConsoleCapture | None:
        """A started capture for `run`, or None when another Run of this process holds one."""
        global _owner
        with _lock:
            if _owner is not None:
                logging.getLogger("runbus.producer").debug(
                    "runbus: the console is captured by %s already; %s logs without it", _owner.run, run
                )
                return None
            capture = _owner = cls(run, mode)
        try:
            capture._start()
        except Exception as exc:  # an odd stream object: logging goes on, without the console
            capture.stop()
            logging.getLogger("runbus.producer").warning("runbus: console capture is off: %s", exc)
            return None
        return capture

    def put_line(self, stream: str, level: str, text: str) -> None:
        # Its secrets are redacted by the shipper, off this thread.
        self.run._put("log", None, {"stream": stream, "level": level, "text": clean_text(text)})

    def put_record(self, level: str, text: str) -> None:
        """A logging record's line: in fd mode through the keeper, in order with stderr."""
        fd_capture = self._fd_capture
        if fd_capture is not None:
            from runbus.producer.keeper import RECORD, line_payload

            with contextlib.suppress(Exception):
                sys.stderr.flush()
            if fd_capture.write_marked(2, RECORD, line_payload(level, clean_text(text))):
                return
        self.put_line("logging", level, text)

    def _start(self) -> None:
        from runbus.producer import bootstrap

        fd_capture = bootstrap.current()
        if fd_capture is not None and fd_capture.adopt(self.echo, self.run.label, self.put_line):
            self._fd_capture = fd_capture
        for name, level in (("stdout", "INFO"), ("stderr", "WARNING")):
            original = getattr(sys, name)
            if original is None:  # pythonw, or a daemon with its streams closed
                continue
            tee: _TextTee | _MarkingTee
            if fd_capture is not None and self._fd_capture is fd_capture:
                tee = _MarkingTee(self, original, fd_capture)
            else:
                tee = _TextTee(self, original, name, level)
            self._tees[name] = tee
            setattr(sys, name, tee)
            self._repoint(original, tee)
        self._factory = _RecordFactory(self, logging.getLogRecordFactory())
        logging.setLogRecordFactory(self._factory)

    def _repoint(self, original: Any, tee: _TextTee | _MarkingTee) -> None:
        # logging.basicConfig() before init() holds the real stream; pointing its handler at
        # the tee lets the echo rule apply to what it prints.
        loggers = [logging.getLogger()] + [
            lg for lg in list(logging.Logger.manager.loggerDict.values()) if isinstance(lg, logging.Logger)
        ]
        for logger in loggers:
            for handler in logger.handlers:
                if type(handler) is logging.StreamHandler and handler.stream is original:
                    handler.setStream(tee)
                    self._repointed.append((handler, tee))

    def record_exception(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Store a traceback as ERROR lines of stderr (echoed later by Python, not here)."""
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        if self._fd_capture is not None:
            self._tracebacks.append(text)  # after what the keeper still holds: stop() stores it
            return
        tee = self._tees.get("stderr")
        if isinstance(tee, _TextTee):
            tee.record_lines(text, "ERROR")

    def stop(self) -> None:
        """Store partial lines, put the original streams and handlers back; idempotent."""
        global _owner
        factory, self._factory = self._factory, None
        if factory is not None:
            factory.active = False
            if logging.getLogRecordFactory() is factory:
                logging.setLogRecordFactory(factory.previous)
        fd_capture, self._fd_capture = self._fd_capture, None
        if fd_capture is not None:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            if not fd_capture.release():
                logging.getLogger("runbus.producer").warning(
                    "runbus: the console keeper did not hand over its last lines in time"
                )
            for text in self._tracebacks:
                for line in text.splitlines():
                    self.put_line("stderr", "ERROR", line)
            self._tracebacks.clear()
        for name, tee in self._tees.items():
            tee.detach()
            if getattr(sys, name) is tee:
                setattr(sys, name, tee._original)
        for handler, tee in self._repointed:
            if handler.stream is tee:
                handler.setStream(tee._original)
        self._repointed.clear()
        with _lock:
            if _owner is self:
                _owner = None


def _after_fork_in_child() -> None:
    global _owner, _lock
    _lock = threading.Lock()
    _owner = None
    for tee in list(_tees):
        tee.forget_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
