"""Progress of a long command (`runbus sync`, `runbus export`, a migration) on one line of stderr.

Shown only when stderr is a terminal: in a pipe, a file or a CI log the command stays quiet, and
its output is what it always was. The line is redrawn at most every REDRAW seconds, in place, and
cleared when the work ends, so what the command prints afterwards starts on a clean line.

    with Progress("sync", total=len(files), unit="files") as progress:
        for path in files:
            ...
            progress.advance()
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from runbus.terminal import printable

REDRAW = 0.1  # seconds between redraws at most
CLEAR = "\r\x1b[K"  # to the line's start, then erase it


def shown_on(stream: TextIO) -> bool:
    """Whether progress is drawn on `stream`: a terminal (not a pipe, file or closed stream)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):  # no isatty, or closed: not a terminal
        return False


class Progress:
    """A counter of `unit`s done (of `total`, if known), with a note, drawn on `stream` (stderr)
    only when it is a terminal; `show=True/False` decides instead."""

    def __init__(
        self,
        what: str,
        total: int | None = None,
        unit: str = "",
        stream: TextIO | None = None,
        show: bool | None = None,
    ) -> None:
        self.what = what
        self.total = total
        self.unit = unit
        self.done = 0
        self.note = ""
        self.stream = sys.stderr if stream is None else stream
        self.shown = shown_on(self.stream) if show is None else show
        self._drawn_at = 0.0
        self._drawn = False

    def advance(self, count: int = 1, note: str | None = None) -> None:
        """`count` more units done (and the note, if given)."""
        self.update(self.done + count, note=note)

    def update(self, done: int | None = None, total: int | None = None, note: str | None = None) -> None:
        """Set what is done, the total or the note; redrawn if due."""
        if done is not None:
            self.done = done
        if total is not None:
            self.total = total
        if note is not None:
            self.note = note
        now = time.monotonic()
        if self.shown and now - self._drawn_at >= REDRAW:
            self._drawn_at = now
            self._write(CLEAR + self.line())

    def line(self) -> str:
        """What the line says: `runbus WHAT: DONE[/TOTAL] UNIT[ (PCT%)][ NOTE]`."""
        count = f"{self.done:,}" if self.total is None else f"{self.done:,}/{self.total:,}"
        text = f"runbus {self.what}: {count}" + (f" {self.unit}" if self.unit else "")
        if self.total:
            text += f" ({min(100, 100 * self.done // self.total)}%)"
        if self.note:
            text += f" {self.note}"
        return printable(text.replace("\n", " "))

    def say(self, text: str, stream: TextIO | None = None) -> None:
        """Print a line of the command's own (on stdout, or `stream`) without garbling the
        progress line: it is erased first, and drawn again below."""
        self.close()
        print(text, file=sys.stdout if stream is None else stream, flush=True)
        if self.shown:
            self._drawn_at = 0.0
            self.update()

    def close(self) -> None:
        """Erase the line (if one was drawn)."""
        if self._drawn:
            self._write(CLEAR)
            self._drawn = False

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
            self._drawn = text != CLEAR
        except (OSError, ValueError):  # the terminal went away: the work goes on without it
            self.shown = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
