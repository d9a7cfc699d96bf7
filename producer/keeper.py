"""The console keeper: a process beside a rank that reads everything the rank writes to fds 1 and 2.

`runbus run`'s bootstrap (runbus.producer.bootstrap) points a rank's file descriptors 1 and 2 at
two pipes as its interpreter starts, and forks this keeper to read them. Every byte written there
(by Python, by C and C++ libraries such as NCCL, gloo or CUDA, by the rank's own children) passes
through the keeper, which

- echoes it at once to the rank's real stdout or stderr, by the console echo rule of
  runbus.producer.console: unchanged ("raw"), every line prefixed with `[label] ` ("prefixed"),
  or only the ERROR lines, prefixed ("errors");
- cuts it into lines with their levels, as console.py does for Python's streams, and keeps the
  lines for the rank: they go over a third pipe, the feed, once a Run of the rank adopts them.

Why a process and not a thread of the rank: what a rank writes as it dies (a segfault, an abort
from C++, NCCL's watchdog, os._exit) still reaches the terminal; reading never waits for the
rank's GIL, so C code writing while it holds the GIL cannot fill the pipe and hang; and the
keeper does the cutting and matching off the training process.

When the control pipe ends because the rank is exiting (not an exec) while a Run it claimed has
not finished (SIGKILL, a segfault, the OOM killer: nothing ran in the rank), the keeper reads the
rank's exit status from /proc/PID/stat (the rank is exiting or a zombie until its parent reaps
it: a parent that reaps first leaves it unknown) and stores that the label ended: a `finish` of a
new epoch with the exit code (128 + the signal for a signal), or with a null exit code (crashed)
when the status could not be read (runbus.producer.lease.store_end). A few bounded tries; Redis
away leaves the label to the ingester's crash detection, as before.

Lines wait here (up to MAX_HELD_BYTES; past it the oldest are dropped and counted) and go to the
rank by non-blocking writes: a rank that reads slowly costs memory here, never a blocked writer.

The protocol, all of it in this module:

- control, rank to keeper, one ASCII line per message: `adopt ECHO LABEL` (start sending lines;
  the echo rule and label from now on), `release TOKEN` (read what the pipes hold, cut the
  partial lines, send every line kept, then TOKEN; keep no more lines), `claim JSON` (a Run of
  the rank holds a label's lease: run, label, token, seal secret, Redis URL, host, pid; sent over
  this private pipe, never argv, environment or files), `finished RUN LABEL` (that Run's finish
  reached Redis). The control pipe's end (the rank exited or exec'd) means no one will read
  lines again.
- feed, keeper to rank: frames of a kind byte, a 4-byte length and a payload: a stdout, stderr
  or logging line (its level, NUL, its UTF-8 text), DROPPED (how many lines were dropped, in
  ASCII), ACK (a token).
- marks, in the data pipes, written by the rank's console capture: MARK, a flag, 8 hex digits of
  length, ST, then a payload. ALWAYS and RULE: text to show but not store (the text a logging
  handler prints for a record stored as a record, runbus's own messages), in every echo mode or
  unless only errors are shown. RECORD: a logging record to store (level, NUL, text), in order
  with the stream around it. MARK opens an APC sequence, which terminals do not show.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import selectors
import signal
import struct
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, BinaryIO

from runbus.producer.console import LineCutter, LineLevels, Prefixer

ECHO_MODES = ("raw", "prefixed", "errors")
MAX_HELD_BYTES = 16 << 20
MAX_MARKED_BYTES = 16 << 20
READ_SIZE = 1 << 16
# After the pipes close, how long lines still try to reach a rank that is alive and adopted them.
LINGER_SECONDS = 2.0
# Storing an unfinished Run's end: tries, each connection's timeouts, and the most the keeper
# waits for them before it exits.
END_TRIES = 3
END_CONNECT_TIMEOUT, END_SOCKET_TIMEOUT = 1.0, 2.0
END_WAIT_SECONDS = 12.0
PF_EXITING = 0x4  # /proc/PID/stat flags: the process is exiting

MARK = b"\x1b_runbus:"
ST = b"\x1b\\"
ALWAYS, RULE, RECORD = b"A", b"R", b"L"
_FLAGS = (ALWAYS, RULE, RECORD)
_HEADER_SIZE = len(MARK) + 1 + 8 + len(ST)

FRAME = struct.Struct("!BI")
STDOUT_LINE, STDERR_LINE, LOGGING_LINE, DROPPED, ACK = 1, 2, 3, 4, 5
_LINE_KINDS = {"stdout": STDOUT_LINE, "stderr": STDERR_LINE}
STREAM_OF_KIND = {STDOUT_LINE: "stdout", STDERR_LINE: "stderr", LOGGING_LINE: "logging"}


def marked(flag: bytes, payload: bytes) -> bytes:
    """`payload` marked for the keeper (flag ALWAYS, RULE or RECORD)."""
    if len(payload) > MAX_MARKED_BYTES:
        payload = payload[:MAX_MARKED_BYTES]
    return b"%s%s%08x%s%s" % (MARK, flag, len(payload), ST, payload)


def line_payload(level: str, text: str) -> bytes:
    return f"{level}\0{text}".encode("utf-8", "replace")


def frame(kind: int, payload: bytes) -> bytes:
    return FRAME.pack(kind, len(payload)) + payload


def read_frames(feed: BinaryIO) -> Iterator[tuple[int, bytes]]:
    """(kind, payload) of each frame from a buffered reader, until the feed ends."""
    while True:
        header = feed.read(FRAME.size)
        if len(header) < FRAME.size:
            return
        kind, size = FRAME.unpack(header)
        payload = feed.read(size)
        if len(payload) < size:
            return
        yield kind, payload


def split_line(payload: bytes) -> tuple[str, str]:
    """(level, text) of a line frame's payload."""
    level, _, text = payload.decode("utf-8", "replace").partition("\0")
    return level, text


def _partial_mark(data: bytes) -> int:
    """How many bytes at the end of `data` could be the start of MARK."""
    for size in range(min(len(MARK) - 1, len(data)), 0, -1):
        if MARK.startswith(data[-size:]):
            return size
    return 0


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class _Stream:
    """One of the rank's two streams: its pipe, its real fd, and what is cut from it."""

    def __init__(self, keeper: Keeper, name: str, source: int, target: int, default_level: str) -> None:
        self.keeper = keeper
        self.name = name
        self.kind = _LINE_KINDS[name]
        self.source = source
        self.target = target
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.levels = LineLevels(default_level)
        self.cutter = LineCutter(self._line)
        self.prefixed = Prefixer(keeper.prefix)
        self.carry = b""
        self.echoing = True

    # -- input -----------------------------------------------------------------------------------

    def data(self, chunk: bytes) -> None:
        """Bytes read from the pipe: marks taken out, the rest shown and cut into lines."""
        data = self.carry + chunk if self.carry else chunk
        self.carry = b""
        start = 0
        while True:
            at = data.find(MARK, start)
            if at < 0:
                keep = _partial_mark(data[start:])
                self._plain(data[start : len(data) - keep])
                self.carry = data[len(data) - keep :]
                return
            self._plain(data[start:at])
            header = data[at : at + _HEADER_SIZE]
            if len(header) < _HEADER_SIZE:
                self.carry = data[at:]
                return
            size = self._marked_size(header)
            if size is None:  # MARK's bytes, but no mark: plain output
                self._plain(data[at : at + len(MARK)])
                start = at + len(MARK)
                continue
            end = at + _HEADER_SIZE + size
            if len(data) < end:
                self.carry = data[at:]
                return
            self._marked(data[at + _HEADER_SIZE : end], header[len(MARK) : len(MARK) + 1])
            start = end

    def end(self) -> None:
        """The pipe closed, or a release: whatever waits is plain output, the partial line cut."""
        carry, self.carry = self.carry, b""
        self._plain(carry, final=True)
        self.cutter.end()

    @staticmethod
    def _marked_size(header: bytes) -> int | None:
        flag = header[len(MARK) : len(MARK) + 1]
        digits = header[len(MARK) + 1 : len(MARK) + 9]
        if flag not in _FLAGS or header[-len(ST) :] != ST:
            return None
        try:
            size = int(digits, 16)
        except ValueError:
            return None
        return size if size <= MAX_MARKED_BYTES else None

    def _plain(self, data: bytes, final: bool = False) -> None:
        if not data and not final:
            return
        mode = self.keeper.echo
        if mode == "raw":
            self._show(data)
        text = self.decoder.decode(data, final)
        if not text:
            return
        if mode == "prefixed":
            self._show(self.prefixed(text).encode())
        self.cutter.feed(text)

    def _marked(self, data: bytes, flag: bytes) -> None:
        if flag == RECORD:
            self.keeper.keep(LOGGING_LINE, *split_line(data))
            return
        mode = self.keeper.echo
        if mode == "raw":
            self._show(data)
        elif mode == "prefixed" or flag == ALWAYS:
            self._show(self.prefixed(data.decode("utf-8", "replace")).encode())

    def _line(self, line: str) -> None:
        level = self.levels.level(line)
        self.keeper.keep(self.kind, level, line)
        if level == "ERROR" and self.keeper.echo == "errors":
            prefix = "" if line.startswith(self.keeper.prefix[:-1]) else self.keeper.prefix
            self._show(f"{prefix}{line}\n".encode())

    # -- output ----------------------------------------------------------------------------------

    def _show(self, data: bytes) -> None:
        if not data or not self.echoing:
            return
        try:
            _write_all(self.target, data)
        except OSError:  # the terminal or file went away: keep cutting lines, stop showing them
            self.echoing = False


class Keeper:
    """The keeper's state: the echo rule, the lines kept, and whether the rank takes them."""

    def __init__(
        self,
        stdout: int,
        stderr: int,
        control: int,
        feed: int,
        echo: str,
        label: str,
        shown: tuple[int, int] = (1, 2),
        rank: tuple[int, str] | None = None,
    ) -> None:
        """The pipes to read (`stdout`, `stderr`, `control`), the feed to write, the echo rule
        and label to start with, the fds to show the two streams on (`shown`), and the rank's
        pid and start time (`rank`: whose end to store for its unfinished Runs; None: none)."""
        self.rank = rank
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}  # the rank's unfinished Runs' leases
        self.ending: threading.Thread | None = None
        self.echo = echo
        self.prefix = f"[{label}] "
        self.control: int | None = control
        self.feed = feed
        self.keeping = True  # lines are kept: until a release, or the rank's end
        self.delivering = False  # kept lines go to the rank: from an adopt to the rank's end
        self.pending: deque[tuple[int, bytes]] = deque()
        self.pending_bytes = 0
        self.sent = 0  # bytes of pending[0] already written to the feed
        self.dropped = 0
        self._control_text = b""
        self.streams = {
            stdout: _Stream(self, "stdout", stdout, shown[0], "INFO"),
            stderr: _Stream(self, "stderr", stderr, shown[1], "WARNING"),
        }

    # -- the lines -------------------------------------------------------------------------------

    def keep(self, kind: int, level: str, line: str) -> None:
        if not self.keeping:
            return
        data = frame(kind, line_payload(level, line))
        self.pending.append((kind, data))
        self.pending_bytes += len(data)
        while self.pending_bytes > MAX_HELD_BYTES and self._drop_oldest_line():
            pass

    def _drop_oldest_line(self) -> bool:
        # The first frame may be half-written: it stays. So do ACKs: the rank waits for them.
        first = 1 if self.sent else 0
        for index in range(first, len(self.pending)):
            kind, data = self.pending[index]
            if kind in STREAM_OF_KIND:
                del self.pending[index]
                self.pending_bytes -= len(data)
                self.dropped += 1
                return True
        return False

    def send(self) -> None:
        """Write what the feed takes now, without waiting."""
        if self.dropped and not self.sent:
            note = frame(DROPPED, str(self.dropped).encode())
            self.pending.appendleft((DROPPED, note))
            self.pending_bytes += len(note)
            self.dropped = 0
        while self.pending:
            data = self.pending[0][1]
            try:
                written = os.write(self.feed, memoryview(data)[self.sent :])
            except BlockingIOError:
                return
            except OSError:  # the rank is gone
                self._discard()
                return
            self.sent += written
            if self.sent == len(data):
                self.pending.popleft()
                self.pending_bytes -= len(data)
                self.sent = 0

    def _discard(self) -> None:
        self.keeping = self.delivering = False
        self.pending.clear()
        self.pending_bytes = 0
        self.sent = 0
        self.dropped = 0

    # -- control ---------------------------------------------------------------------------------

    def control_data(self, data: bytes) -> None:
        self._control_text += data
        while b"\n" in self._control_text:
            line, _, self._control_text = self._control_text.partition(b"\n")
            self._command(line)

    def _command(self, line: bytes) -> None:
        if line.startswith(b"claim "):
            self._claim(line[len(b"claim ") :])
            return
        words = line.decode("ascii", "replace").split()
        if len(words) == 3 and words[0] == "finished":
            self.claims.pop((words[1], words[2]), None)
        elif len(words) == 3 and words[0] == "adopt" and words[1] in ECHO_MODES:
            self.echo = words[1]
            self.prefix = f"[{words[2]}] "
            for stream in self.streams.values():
                stream.prefixed.prefix = self.prefix
            self.keeping = self.delivering = True
        elif len(words) == 2 and words[0] == "release" and self.delivering:
            self._drain()
            for stream in self.streams.values():
                stream.end()
            self.pending.append((ACK, frame(ACK, words[1].encode())))
            self.keeping = False

    def _drain(self) -> None:
        """Read whatever the pipes hold now: all the rank wrote before it asked for a release."""
        for source, stream in list(self.streams.items()):
            while True:
                try:
                    chunk = os.read(source, READ_SIZE)
                except BlockingIOError:
                    break
                if not chunk:
                    self._close(source)
                    break
                stream.data(chunk)

    def _claim(self, text: bytes) -> None:
        try:
            claim = json.loads(text)
            self.claims[(claim["run"], claim["label"])] = claim
        except (ValueError, TypeError, KeyError):  # not the rank's message: nothing to store
            pass

    def control_closed(self) -> None:
        self.control = None
        self._discard()
        if self.claims and self.rank is not None:
            ended, status = rank_status(*self.rank)  # at once: a parent may reap the rank soon
            if ended:
                claims = list(self.claims.values())
                self.claims.clear()
                self.ending = threading.Thread(target=store_ends, args=(claims, status), daemon=True)
                self.ending.start()

    def _close(self, source: int) -> None:
        stream = self.streams.pop(source)
        stream.end()
        with contextlib.suppress(OSError):
            os.close(source)

    # -- the loop --------------------------------------------------------------------------------

    def serve(self) -> None:
        """Until both pipes have closed (the rank and every child holding them have exited), and
        the end of the rank's unfinished Runs is stored (at most END_WAIT_SECONDS more)."""
        try:
            self._serve()
        finally:
            if self.ending is not None:
                self.ending.join(END_WAIT_SECONDS)

    def _serve(self) -> None:
        for fd in (*self.streams, self.feed):
            os.set_blocking(fd, False)
        selector = selectors.DefaultSelector()
        for source in self.streams:
            selector.register(source, selectors.EVENT_READ)
        if self.control is not None:
            selector.register(self.control, selectors.EVENT_READ)
        writing = False
        linger_until: float | None = None
        while True:
            if not self.streams:
                if not (self.delivering and self.pending and self.control is not None):
                    return
                linger_until = linger_until or time.monotonic() + LINGER_SECONDS
                if time.monotonic() >= linger_until:
                    return
            writing = self._watch_feed(selector, writing)
            timeout = None if linger_until is None else max(0.0, linger_until - time.monotonic())
            self._read_ready(selector, timeout)
            if self.delivering and self.pending:
                self.send()

    def _watch_feed(self, selector: selectors.BaseSelector, writing: bool) -> bool:
        """Watch the feed for room to write while there is something to deliver, else not;
        whether it is watched now (`writing`: whether it was)."""
        want_write = self.delivering and bool(self.pending)
        if want_write != writing:
            if want_write:
                selector.register(self.feed, selectors.EVENT_WRITE)
            else:
                selector.unregister(self.feed)
        return want_write

    def _read_ready(self, selector: selectors.BaseSelector, timeout: float | None) -> None:
        """Wait at most `timeout` (None: for ever) for the control pipe, an output pipe or the
        feed, and read the pipes that are ready (the feed is written after)."""
        for key, _ in selector.select(timeout):
            fd = key.fd
            if fd == self.feed:
                continue
            if fd == self.control:
                self._read_control(selector)
            elif fd in self.streams:
                self._read_stream(selector, fd)

    def _read_control(self, selector: selectors.BaseSelector) -> None:
        assert self.control is not None
        try:
            data = os.read(self.control, 4096)
        except OSError:
            data = b""
        if data:
            self.control_data(data)
            return
        selector.unregister(self.control)
        with contextlib.suppress(OSError):
            os.close(self.control)
        self.control_closed()

    def _read_stream(self, selector: selectors.BaseSelector, source: int) -> None:
        try:
            chunk = os.read(source, READ_SIZE)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            self.streams[source].data(chunk)
            return
        selector.unregister(source)
        self._close(source)


def rank_status(pid: int, ticks: str) -> tuple[bool, int | None]:
    """(whether the process `pid` that started at `ticks` has ended, its wait status if it can be
    read): from /proc/PID/stat, whose field 52 holds it while the process exits and until its
    parent reaps it (Linux 3.5+). Gone (reaped: a free pid, or another process) is ended,
    status unknown; alive and not exiting (it exec'd) is not ended."""
    fields = _proc_stat(pid)
    if len(fields) < 20 or fields[19].decode() != ticks:
        return True, None
    if fields[0] not in (b"Z", b"X") and not int(fields[6]) & PF_EXITING:
        return False, None
    return True, (int(fields[49]) if len(fields) > 49 else None)


def exit_code_of_status(status: int) -> tuple[int | None, int | None]:
    """(the exit code as a shell shows it: 128 + N when killed by signal N, and N or None) of a
    wait status; (None, None) for one that is no end."""
    try:
        code = os.waitstatus_to_exitcode(status)
    except ValueError:
        return None, None
    return (128 - code, -code) if code < 0 else (code, None)


def store_ends(claims: list[dict[str, Any]], status: int | None) -> None:
    """Store that each claim's Run ended, with the rank's wait status (None: unknown), a few
    bounded tries each (runbus.producer.lease.store_end)."""
    exit_code, killed_by = exit_code_of_status(status) if status is not None else (None, None)
    try:
        from runbus.producer.lease import store_end
        from runbus.redis import sync_client
    except Exception:  # a broken install: the ingester's crash detection stays
        return
    for claim in claims:
        for attempt in range(END_TRIES):
            try:
                client = sync_client(
                    claim["url"],
                    socket_connect_timeout=END_CONNECT_TIMEOUT,
                    socket_timeout=END_SOCKET_TIMEOUT,
                    retry_on_timeout=False,
                )
                try:
                    store_end(client, claim, exit_code, killed_by)
                finally:
                    client.close()
                break
            except Exception:  # Redis away or refusing: tried again, then left to crash detection
                time.sleep(0.2 * (attempt + 1))


def serve(stdout: int, stderr: int, control: int, feed: int, echo: str, label: str) -> None:
    """The keeper process's body (in a process forked by the bootstrap, which then _exits)."""
    # Ctrl-C, a hang-up or a TERM sent to the whole process group are for the rank; the keeper
    # ends when the rank's pipes close, having shown all the rank wrote.
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    rank = os.getppid()  # forked by the rank: its parent is the rank, until the rank exits
    ticks = _start_ticks(rank)
    _name_process(b"runbus-console")
    keeper = Keeper(stdout, stderr, control, feed, echo, label, rank=(rank, ticks) if ticks else None)
    keeper.serve()


def _proc_stat(pid: int) -> list[bytes]:
    """The fields of /proc/PID/stat after the command name ([state, ppid, ...]); [] where there
    is none. (runbus.producer.lease reads it too, but importing it costs every rank at start.)"""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rpartition(b")")[2].split()
    except OSError:
        return []


def _start_ticks(pid: int) -> str:
    """Field 22 of /proc/PID/stat, the process's start time: with the pid, which process it is."""
    fields = _proc_stat(pid)
    return fields[19].decode() if len(fields) > 19 else ""


def _name_process(name: bytes) -> None:
    """Shown by ps and top in place of the rank's command line (Linux; best effort)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
