"""The one line runbus.init() prints on the primary's stderr: the run, its label, where to look.

    runbus: run run-20250101-120000-k3m9q2xa, label rank0 (torchrun, 4 ranks): runbus show run-... | http://host:8080/#/run/run-...

Only the primary prints it, once per init() that starts a Run; quiet=True or RUNBUS_QUIET=1
silences it, and under `runbus run` the wrapper prints the job's line instead (run_line). The
dashboard address (RUNBUS_DASHBOARD_URL) is shown through safe_url and printable: no password
or token, no control character reaches the terminal.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TextIO
from urllib.parse import quote, urlsplit, urlunsplit

from runbus import config
from runbus.producer.environment import Identity
from runbus.terminal import printable


def banner(identity: Identity, env: Mapping[str, str] | None = None) -> str:
    """The line for `identity`, without its newline."""
    where = [identity.launcher] if identity.launcher != "none" else []
    if identity.world_size is not None and identity.world_size > 1:
        where.append(f"{identity.world_size} ranks")
    return run_line(identity.run_id, f"label {identity.label}", where, env)


def run_line(
    run_id: str, label: str | None = None, where: Sequence[str] = (), env: Mapping[str, str] | None = None
) -> str:
    """`runbus: run ID[, LABEL][ (WHERE)]: runbus show ID[ | PAGE]`: the line init() and
    `runbus run` print, the dashboard page (RUNBUS_DASHBOARD_URL) masked and printable."""
    line = f"runbus: run {run_id}" + (f", {label}" if label else "")
    if where:
        line += f" ({', '.join(where)})"
    line += f": runbus show {run_id}"
    dashboard = config.dashboard_url(env)
    if dashboard is not None:
        line += f" | {run_page(dashboard, run_id)}"
    return printable(line)


def run_page(dashboard: str, run_id: str) -> str:
    """The address of `run_id`'s page on the dashboard at `dashboard`, its secrets masked."""
    parts = urlsplit(dashboard)
    page = parts._replace(path=parts.path or "/", fragment=f"/run/{quote(run_id, safe='')}")
    return config.safe_url(urlunsplit(page))


def announce(identity: Identity, quiet: bool, stream: TextIO | None = None) -> None:
    """Print the banner on stderr if this is the primary and `quiet` is False, unless `runbus
    run` started the job: it printed the job's line already."""
    if quiet or not identity.primary or config.LAUNCH_ENV in os.environ:
        return
    stream = sys.stderr if stream is None else stream
    with contextlib.suppress(OSError, ValueError):  # a closed stderr: the run goes on without it
        print(banner(identity), file=stream, flush=True)
