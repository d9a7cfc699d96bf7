"""The git state of the working directory, for a label's `start` event; never raises.

`describe()` gives `{"commit", "branch", "dirty", "remote"}`: the full sha of HEAD, the branch
checked out (None: a detached HEAD), whether tracked files have uncommitted changes (staged or
not; untracked files are not looked at, as `git status --untracked-files=no`: listing them is
what makes `status` slow in a big tree; None when `status` did not answer in time), and the URL
of the `origin` remote with its credentials hidden (runbus.redact.safe_remote), left out where
there is none. Git has 2 s for all of it, and is killed with its children at the deadline. It
gives None outside a repository, in one without a commit, without a git binary, or when HEAD
could not be read in time. Run on the shipper's courier thread, never on the one that called
runbus.init().
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from typing import Any

from runbus.redact import safe_remote

logger = logging.getLogger("runbus.producer")

DEADLINE = 2.0
# No prompt for credentials, no pager, no lock on the index that a git command the user runs at
# the same moment would trip over (status refreshes the index's stat data when it may).
_GIT_ENV = {"GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0", "GIT_PAGER": "cat", "LC_ALL": "C"}


class _GitFailed(Exception):
    """A git command that exited non-zero, timed out or could not start."""


def describe(cwd: str | None = None, deadline: float | None = None) -> dict[str, Any] | None:
    """The start event's `git` field for the repository holding `cwd` (None: the working
    directory), or None where there is none to record; git is given `deadline` seconds in all
    (None: DEADLINE)."""
    end = time.monotonic() + (DEADLINE if deadline is None else deadline)
    try:
        commit, head = _run(("rev-parse", "HEAD", "--abbrev-ref", "HEAD"), cwd, end).split("\n")[:2]
    except (_GitFailed, ValueError) as exc:
        logger.debug("runbus: no git state recorded: %s", exc)
        return None
    info: dict[str, Any] = {"commit": commit, "branch": None if head == "HEAD" else head}
    try:
        info["dirty"] = bool(_run(("status", "--porcelain", "--untracked-files=no"), cwd, end))
    except _GitFailed as exc:
        logger.debug("runbus: git status did not answer: %s", exc)
        info["dirty"] = None
    try:
        remote = _run(("config", "--get", "remote.origin.url"), cwd, end)
    except _GitFailed:
        remote = ""  # no origin remote (git config exits 1), or no time left to ask
    if remote:
        info["remote"] = safe_remote(remote)
    return info


def _run(args: tuple[str, ...], cwd: str | None, end: float) -> str:
    """git's stdout, stripped; raises _GitFailed. Its own process group, killed whole at the
    deadline: a helper git started that kept the pipe open would otherwise hold this thread."""
    left = end - time.monotonic()
    if left <= 0:
        raise _GitFailed(f"git {args[0]}: no time left")
    try:
        child = subprocess.Popen(
            ("git", *args),
            cwd=cwd,
            env={**os.environ, **_GIT_ENV},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError as exc:  # no git binary, or a working directory since removed
        raise _GitFailed(f"git cannot start: {exc}") from None
    try:
        out, _ = child.communicate(timeout=left)
    except subprocess.TimeoutExpired:
        _kill_group(child)
        raise _GitFailed(f"git {args[0]} did not answer in time") from None
    if child.returncode != 0:
        raise _GitFailed(f"git {args[0]} exited {child.returncode}")
    return out.decode(errors="replace").strip()


def _kill_group(child: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except OSError as exc:  # it ended between the timeout and the kill
        logger.debug("runbus: git's process group already gone: %s", exc)
    child.communicate()
