"""runbus's settings from the environment: every `RUNBUS_*` name, its default, and how to show URLs.

Nothing else reads a `RUNBUS_*` variable directly: each has a name constant and a reader here, so
the names, their defaults and their documentation live in one place. URLs are shown through
`safe_url` (from runbus.redact, re-exported here), which never lets a password reach a log line,
an error message or a page.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from runbus.errors import CommandError
from runbus.redact import safe_url as safe_url  # re-exported: URLs are shown through it

if TYPE_CHECKING:
    from redis.backoff import AbstractBackoff, EqualJitterBackoff

REDIS_URL_ENV = "RUNBUS_REDIS_URL"
STORE_ENV = "RUNBUS_STORE"
RUN_ID_ENV = "RUNBUS_RUN_ID"
LABEL_ENV = "RUNBUS_LABEL"
RESUME_ENV = "RUNBUS_RESUME"
CONSOLE_ENV = "RUNBUS_CONSOLE"
API_TOKEN_ENV = "RUNBUS_API_TOKEN"  # noqa: S105 - the variable's name, not a token
DEMO_STEPS_ENV = "RUNBUS_DEMO_STEPS"
DECODER_ENV = "RUNBUS_DECODER"
DASHBOARD_URL_ENV = "RUNBUS_DASHBOARD_URL"
QUIET_ENV = "RUNBUS_QUIET"
REQUIRE_SEAL_ENV = "RUNBUS_REQUIRE_SEAL"
GIT_ENV = "RUNBUS_GIT"
CATCH_UP_ENV = "RUNBUS_CATCH_UP"
SPOOL_DIR_ENV = "RUNBUS_SPOOL_DIR"
COLLECTIVES_ENV = "RUNBUS_COLLECTIVES"
# Set by runbus.init() beside a RUNBUS_RUN_ID it exported (a run id it made), to the pid of that
# process: a child that inherits the id learns whose it is.
RUN_ID_FROM_ENV = "RUNBUS_RUN_ID_FROM"
# Set by `runbus run` for its command: the pid the command runs as (runbus.producer.launch).
LAUNCH_ENV = "RUNBUS_LAUNCH"
# Set by the process that captures a rank's console: its pid and rank variables.
CONSOLE_OWNER_ENV = "RUNBUS_CONSOLE_OWNER"

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
STORE_FILE = "runbus.db"
# The ingester's stream decoders: its fast path (the default), and runbus.wire's reference.
DECODERS = ("fast", "reference")
# How long runbus's HTTP servers (`runbus serve`, `runbus ingest --http`) keep a connection that
# has not sent a whole request head: from its opening, or from the end of its last response
# (keep-alive). A client that never finishes its request (half-open, slowloris) is closed then.
HTTP_IDLE_TIMEOUT = 15.0


def redis_url(env: Mapping[str, str] | None = None) -> str:
    """The Redis URL from RUNBUS_REDIS_URL, else the local default."""
    return (os.environ if env is None else env).get(REDIS_URL_ENV) or DEFAULT_REDIS_URL


def api_token(env: Mapping[str, str] | None = None) -> str | None:
    """The dashboard's token from RUNBUS_API_TOKEN, else None (an empty value is none)."""
    return (os.environ if env is None else env).get(API_TOKEN_ENV) or None


def dashboard_url(env: Mapping[str, str] | None = None) -> str | None:
    """The dashboard's address from RUNBUS_DASHBOARD_URL (e.g. http://host:8080), else None: the
    line runbus.init() prints links a run's page there."""
    url = (os.environ if env is None else env).get(DASHBOARD_URL_ENV) or None
    return url.rstrip("/") if url else None


_TRUE, _FALSE = frozenset({"1", "true", "yes", "on"}), frozenset({"", "0", "false", "no", "off"})


def quiet(env: Mapping[str, str] | None = None) -> bool:
    """RUNBUS_QUIET: 1/true/yes/on silences the line runbus.init() prints; unset or 0/false/no/off
    does not; anything else is a ValueError naming the variable."""
    return _flag(QUIET_ENV, env)


def record_git(env: Mapping[str, str] | None = None) -> bool:
    """RUNBUS_GIT: unset, empty or 1/true/yes/on records the working directory's git commit,
    branch, dirty state and origin URL in each label's start event; 0/false/no/off does not;
    anything else is a ValueError naming the variable."""
    env = os.environ if env is None else env
    return not env.get(GIT_ENV, "").strip() or _flag(GIT_ENV, env)


def time_collectives(env: Mapping[str, str] | None = None) -> bool:
    """RUNBUS_COLLECTIVES: unset, empty or 1/true/yes/on lets a rank's heartbeats say which
    torch.distributed collective it is inside and for how long (runbus.producer.collectives);
    0/false/no/off leaves torch.distributed unwrapped; anything else is a ValueError naming it."""
    env = os.environ if env is None else env
    return not env.get(COLLECTIVES_ENV, "").strip() or _flag(COLLECTIVES_ENV, env)


def catch_up(env: Mapping[str, str] | None = None) -> bool:
    """RUNBUS_CATCH_UP: unset, empty or 1/true/yes/on lets `runbus show`, `metrics`, `logs` and
    runbus.Api.run() store a run's events that wait in Redis with no ingester running
    (runbus.query.catchup); 0/false/no/off does not; anything else is a ValueError naming it."""
    env = os.environ if env is None else env
    return not env.get(CATCH_UP_ENV, "").strip() or _flag(CATCH_UP_ENV, env)


def require_seal(env: Mapping[str, str] | None = None) -> bool:
    """RUNBUS_REQUIRE_SEAL: 1/true/yes/on makes ingesters refuse every entry without its epoch's
    seal, also of labels no sealing producer wrote (docs/wire.md, Fencing); off by default. Any
    other value is a CommandError: `runbus ingest` says so in one line."""
    try:
        return _flag(REQUIRE_SEAL_ENV, env)
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def _flag(name: str, env: Mapping[str, str] | None) -> bool:
    text = (os.environ if env is None else env).get(name, "").strip().lower()
    if text not in _TRUE | _FALSE:
        raise ValueError(f"{name}={text[:40]!r} is not one of 1, true, yes, on, 0, false, no, off")
    return text in _TRUE


def demo_steps(env: Mapping[str, str] | None = None, default: int = 40) -> int:
    """The steps a `runbus demo` rank runs, from RUNBUS_DEMO_STEPS (set by the demo for its ranks)."""
    text = (os.environ if env is None else env).get(DEMO_STEPS_ENV)
    return int(text) if text else default


def data_dir(env: Mapping[str, str] | None = None) -> Path:
    """runbus's per-user data directory: `$XDG_DATA_HOME/runbus`, else `~/.local/share/runbus`."""
    env = os.environ if env is None else env
    base = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "runbus"


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """runbus's per-user cache directory: `$XDG_CACHE_HOME/runbus`, else `~/.cache/runbus`."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "runbus"


def spool_dir(env: Mapping[str, str] | None = None) -> str | None:
    """Where producers keep the events Redis has not taken (runbus.producer.backlog): the
    directory RUNBUS_SPOOL_DIR names, else `spool` in the per-user cache directory; None (no
    spool: events beyond the memory buffer are dropped) when RUNBUS_SPOOL_DIR is `off`."""
    env = os.environ if env is None else env
    given = env.get(SPOOL_DIR_ENV, "").strip()
    if given.lower() == "off":
        return None
    return given or str(cache_dir(env) / "spool")


def default_store_url(env: Mapping[str, str] | None = None) -> str:
    """The store URL from RUNBUS_STORE, else one SQLite file in the per-user data directory, so
    every command finds the same runs from any working directory."""
    env = os.environ if env is None else env
    return env.get(STORE_ENV) or f"sqlite:///{data_dir(env) / STORE_FILE}"


def decoder(env: Mapping[str, str] | None = None) -> str:
    """Which decoder the ingester uses, from RUNBUS_DECODER: 'fast' (the default) or 'reference'
    (runbus.wire's, entry by entry: the same results, slower; to rule the fast path out)."""
    name = (os.environ if env is None else env).get(DECODER_ENV) or DECODERS[0]
    if name not in DECODERS:
        raise CommandError(f"{DECODER_ENV}={name[:40]!r} is not one of: {', '.join(DECODERS)}")
    return name


def backoff(cap: float, base: float = 0.1) -> AbstractBackoff:
    """The one retry delay policy: exponential from `base` up to `cap` seconds, with equal jitter,
    so that N workers or ranks that lost Redis together do not reconnect in lockstep.

    `compute(n)`, n counting the failures before this one from 0, is a delay between half and all
    of min(cap, base * 2**n): 0 gives at most `base`, and no number of failures raises.
    """
    return _equal_jitter()(cap=cap, base=base)


@functools.cache
def _equal_jitter() -> type[EqualJitterBackoff]:
    from redis.backoff import EqualJitterBackoff

    class EqualJitter(EqualJitterBackoff):
        """redis-py's EqualJitterBackoff, safe for any count: its 2**failures overflows a float
        after about a thousand failures, an hour and a half of an outage at a 5 s cap."""

        def compute(self, failures: int) -> float:
            return super().compute(min(failures, MAX_DOUBLINGS))

    return EqualJitter


# Doublings past which no delay grows: 2**64 times any base is past any cap.
MAX_DOUBLINGS = 64
