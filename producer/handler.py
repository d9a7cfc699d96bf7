"""A logging.Handler that ships each record as a `log` event of a Run."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runbus.producer.run import Run

# Records from these loggers are never shipped: they are about shipping itself, and shipping
# them could feed back into the very outage they report.
_OWN_LOGGERS = ("runbus", "redis")


class RunHandler(logging.Handler):
    """Formats records with the handler's formatter and ships them with their level name."""

    def __init__(self, run: Run, level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.run = run

    def handle(self, record: logging.LogRecord) -> bool:
        # Filtered before logging takes this handler's lock: a thread waiting in log_text() for
        # room (back-pressure) holds it, and the shipper must never wait for that lock.
        if record.name.startswith(_OWN_LOGGERS) or threading.current_thread().name.startswith("runbus-"):
            return False
        return super().handle(record)

    def emit(self, record: logging.LogRecord) -> None:
        if self.run.finished:
            return
        try:
            self.run.log_text(self.format(record), level=record.levelname, stream="logging")
        except Exception:  # as logging.Handler.emit does: a failing handler never breaks the caller
            self.handleError(record)
