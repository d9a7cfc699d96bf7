"""The background thread that turns queued events into stream entries and ships them to Redis.

It owns the Redis connection: the handshake (the label's lease, epoch and primary claim, see
runbus.producer.lease; announcing the stream), batched pipelined XADDs, heartbeats, and
reconnecting with capped, jittered backoff. Nothing here runs on the training thread, and nothing
here raises into it: while Redis is away, or refuses the credentials, events are buffered and the
problem is logged once. A handshake done late (Redis was away at init) that finds the label in
use, or a run this job may not join, stops shipping instead, with one error. Log lines have their
secrets redacted here, as they are encoded (runbus.redact).

Two threads: this one moves events from the outbox into the backlog (encoding them) and decides
what to send next; its courier (runbus.producer.courier) makes the Redis calls, one at a time. So
the outbox drains into the backlog whatever Redis does (paused, slow, failing over, out of
memory), and a full outbox makes `log()` wait only for encoding. What finds the backlog (memory,
then spool) full waits too while Redis takes events (back-pressure: nothing is dropped while it
answers), else is dropped, counted: a Redis call in flight for longer than REDIS_WAIT, an outage,
or an `-OOM` answer count as not taking them.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from runbus import config, wire
from runbus.config import safe_url
from runbus.errors import LabelInUse, PrimaryConflict, RunbusError, RunExists, RunNotFound
from runbus.producer.backlog import (
    Backlog,
    Chunk,
    Record,
    Spool,
    orphan_spools,
    rows_of,
    ship_spool,
    spool_path,
)
from runbus.producer.courier import Call, Courier
from runbus.producer.environment import Identity
from runbus.producer.lease import LabelLease, default_ttl
from runbus.producer.outbox import Outbox, Pending
from runbus.producer.vitals import Progress, beat_fields
from runbus.redact import LineRedactor

if TYPE_CHECKING:
    from redis.commands.core import Script

    from runbus.redis import SyncClient

log = logging.getLogger("runbus.producer")

# How long the shipper works without a break while there is work: then heartbeats and stop()
# get their turn.
PUMP_SLICE = 0.2
# The longest log() waits on Redis. While Redis takes events, the backlog is kept a few batches
# ahead of it (AHEAD batches) and a full outbox makes log() wait for shipping, as back-pressure;
# a put waiting longer than this, or a Redis call in flight for longer, and the backlog takes
# what is queued (up to its bound; past it, with Redis not taking events, they are dropped).
REDIS_WAIT = 0.1
AHEAD = 2
# A put waits for room only while the shipper thread went round this recently: longer means it
# is stuck (for instance on a logging lock the waiting thread holds), so waiting could be forever.
STALL_AFTER = 2.0
# Redis near its maxmemory answers -OOM on and off while ingesters trim: said once in this long.
OOM_WARN_EVERY = 300.0


@dataclass(frozen=True, slots=True)
class ShipperOptions:
    """Tunables of the shipping thread (see runbus.init for their meaning)."""

    flush_interval: float = 0.05
    batch_size: int = 2000
    max_buffer_bytes: int = 128 << 20
    spool_dir: str | None = None
    max_spool_bytes: int = 4 << 30
    heartbeat_interval: float = 10.0
    primary_ttl: float = 30.0
    lease_ttl: float | None = None  # None: three heartbeats, at least 30 s
    connect_timeout: float = 2.0
    socket_timeout: float = 10.0
    max_backoff: float = 5.0

    def __post_init__(self) -> None:
        if self.lease_ttl is not None and not self.lease_ttl > self.heartbeat_interval:
            raise ValueError(
                f"lease_ttl ({self.lease_ttl}s) must be longer than heartbeat_interval "
                f"({self.heartbeat_interval}s), which renews it"
            )


def connect(url: str, options: ShipperOptions) -> SyncClient:
    """A redis-py client for `url`, a server or a cluster (redis-py is imported lazily, so
    `import runbus` stays cheap)."""
    from runbus.redis import sync_client

    return sync_client(
        url,
        socket_connect_timeout=options.connect_timeout,
        socket_timeout=options.socket_timeout,
        retry_on_timeout=False,
    )


def _wire_number(value: Any) -> float | int | str:
    if type(value) is float:
        return value if math.isfinite(value) else wire.finite_to_wire(value)
    if type(value) is bool:  # what `.item()` gives for a bool tensor
        return int(value)
    if type(value) is int:
        # log() refuses ints beyond 64 bits (orjson stops there), but a device tensor read here
        # (unsigned 64-bit) may hold one: it travels as a float, as the ingester reads it.
        return value if -(2**63) <= value < 2**63 else float(value)
    # A 0-d tensor or numpy scalar: `.item()` happens here, off the training thread, so a CUDA
    # tensor synchronises the shipper, never the caller.
    return _wire_number(value.item())


def encode_data(kind: str, data: Any) -> str:
    """The `data` field of one event, as JSON text.

    Text rather than orjson's bytes: those keep orjson's whole 4 KiB output buffer allocated,
    which a million buffered events would turn into gigabytes.
    """
    if kind in ("metric", "system"):
        # Fast path: plain finite numbers encode as they are. orjson writes NaN and infinities
        # as null and refuses tensors and 64-bit-plus ints, and a metric is never null: then
        # each value is converted.
        try:
            blob = orjson.dumps(data)
        except TypeError:
            blob = b"null"
        if b"null" not in blob:
            return blob.decode()
        # A str subclass as a name (a StrEnum member that log() took for a known name): orjson
        # takes only str keys.
        data = {str.__str__(key): _wire_number(value) for key, value in data.items()}
    return orjson.dumps(data).decode()


class Shipper(threading.Thread):
    """Ships one Run's outbox to its stream until asked to stop and the outbox is empty."""

    def __init__(self, identity: Identity, outbox: Outbox, options: ShipperOptions) -> None:
        super().__init__(name=f"runbus-shipper-{identity.label}", daemon=True)
        self.identity = identity
        self.outbox = outbox
        self.options = options
        self.key = wire.stream_key(identity.run_id, identity.label)
        self.primary = identity.primary
        self.epoch: int | None = None
        self.lease = LabelLease(
            identity.run_id,
            identity.label,
            identity.restart_count,
            identity.resume,
            ttl=options.lease_ttl or default_ttl(options.heartbeat_interval),
            primary_ttl=options.primary_ttl,
            redis_url=identity.redis_url,
        )
        # Why this process ships nothing (more): the label is another's, or the run not to join.
        self.refused: RunbusError | None = None
        self.shipped = 0
        self.left_in_spool = 0  # events left in the spool file at the end (none shipped since)
        self.failed_encodes = 0
        self.describe_hardware = True
        self.describe_git = True
        self.gpu_device_ids: tuple[int, ...] | None = None
        spool = None
        if options.spool_dir:
            path = spool_path(options.spool_dir, identity.run_id, identity.label, os.getpid())
            spool = Spool(path, owner=(identity.run_id, identity.label))
        self.backlog = Backlog(
            options.max_buffer_bytes, spool, options.max_spool_bytes, outbox.drops, options.batch_size
        )
        self._held_start: Pending | None = None
        self._described = False
        self._hardware_info: dict[str, Any] | None = None
        self._git_info: dict[str, Any] | None = None
        self._redactors: dict[str, LineRedactor] = {}  # per log stream: its lines come in order
        self._orphans_checked = False
        self._client: SyncClient | None = None
        self._xadd_many: Script | None = None
        # The seal secret of each epoch this process ships (wire.seal): its own, the spare
        # epochs it gave earlier processes' events, and the epochs dead processes' spools recorded.
        self._secrets: dict[int, bytes] = {}
        # The Redis calls are the courier's; the one in flight, if any. It wakes this thread
        # through the outbox's demand event when a call is done.
        self._courier = Courier(f"runbus-redis-{identity.label}", outbox.demand)
        self._call: Call | None = None
        self._next_try = 0.0
        self._renew_due = False
        self._stopping = threading.Event()
        self._deadline: float | None = None
        self._next_heartbeat = time.monotonic() + options.heartbeat_interval
        # The step as encoded metric events show it, and the thread whose stack beats carry (the
        # one that called init(): the training loop's), for the health detector.
        self.progress = Progress()
        self.watched_thread: int | None = None
        self._outage_since: float | None = None
        self._outage_failures = 0
        self._failures_at_stop = 0  # _outage_failures when stop() was called
        self._denied_logged = False  # an AccessDenied logged in this outage
        self._oom_warned_at: float | None = None  # the last -OOM warning (OOM_WARN_EVERY)
        self._outage_oom = False  # the outage is Redis answering -OOM, nothing else
        # Jittered, so that the ranks of a job that lost Redis together do not reconnect in step.
        self._retry = config.backoff(options.max_backoff)
        # When this thread last went round or encoded a batch (see STALL_AFTER).
        self._progress_at = time.monotonic()
        outbox.may_wait = self.may_wait

    @property
    def unshipped(self) -> int:
        """Events not yet in Redis (queued, encoded in memory, or spooled: at least 1 if any)."""
        return len(self.outbox) + len(self.backlog) + (self._held_start is not None) + self.left_in_spool

    def may_wait(self) -> bool:
        """Whether a put that finds the outbox full should wait for room rather than drop: this
        thread is moving events into a backlog with room, or Redis is taking them. Never on this
        thread or the courier's, which would wait for themselves."""
        now = time.monotonic()
        current = threading.current_thread()
        if current is self or current is self._courier or not self.is_alive():
            return False
        if now - self._progress_at > STALL_AFTER:
            return False
        return self.backlog.has_room() or self._redis_taking(now)

    def _redis_taking(self, now: float) -> bool:
        """Whether Redis takes events now: reached, no outage, no call in flight past REDIS_WAIT."""
        call = self._call
        return (
            self.epoch is not None
            and self._outage_since is None
            and (call is None or now - call.started < REDIS_WAIT)
        )

    # -- the handshake -------------------------------------------------------------------------

    def handshake(self) -> None:
        """Claim the label's lease, a new epoch and (as the primary) the primary role, and
        announce the stream (from init(), before this thread starts).

        Raises LabelInUse when another live process holds this run and label, RunExists /
        RunNotFound as the resume mode says, PrimaryConflict when another label holds a live
        primary claim, and redis-py's ConnectionError / TimeoutError when Redis cannot be reached.
        """
        self._took_epoch(self._claim())

    def _claim(self) -> int:
        client = self._connection()
        epoch = self.lease.claim(client, self.primary)
        client.sadd(wire.REGISTRY_KEY, self.key)
        return epoch

    def _took_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._secrets[epoch] = self.lease.secret
        if self.backlog.spool is not None:
            self.backlog.spool.note_epoch(epoch, self.lease.secret)
        self._tell_keeper()

    def _tell_keeper(self) -> None:
        """Under `runbus run`, tell the console keeper of the lease: it stores the label's end if
        this process dies before its finish reaches Redis (runbus.producer.keeper)."""
        from runbus.producer import bootstrap

        capture, holder = bootstrap.current(), self.lease.holder
        if capture is None or holder is None:
            return
        ident = self.identity
        claim: dict[str, str | int] = {
            "run": ident.run_id,
            "label": ident.label,
            "token": holder.token,
            "secret": self.lease.secret.hex(),
            "url": ident.redis_url,
            "host": holder.host,
            "pid": holder.pid,
        }
        capture.note_claim(claim)

    def _claim_later(self) -> int:
        """The courier's handshake (Redis was away at init): another live primary demotes this
        label; LabelInUse, RunExists and RunNotFound are raised, to stop shipping."""
        try:
            return self._claim()
        except PrimaryConflict as exc:
            self._demote(exc)
            return self._claim()

    def _handshaken(self, epoch: int) -> None:
        self._took_epoch(epoch)
        self._encode_held_start()

    def _describe(self) -> None:
        """The courier describes the hardware and the git state for the start event: off the
        thread that encodes, as NVML can take a second to start on a big host, and git status
        a while in a big tree."""
        if self.describe_hardware:
            self._hardware_info = self._describe_hardware()
        if self.describe_git:
            from runbus.producer import gitstate

            self._git_info = gitstate.describe()

    def _have_described(self, _: None) -> None:
        self._described = True
        self._encode_held_start()

    def _to_describe(self) -> bool:
        return (self.describe_hardware or self.describe_git) and not self._described

    def _start_ready(self) -> bool:
        """Whether the start event can be encoded: its primary flag is settled by the handshake,
        and the hardware and git state described (if asked for)."""
        return self.epoch is not None and not self._to_describe()

    def _renew_claims(self) -> str | None:
        """The courier's renewal of the lease and the primary claim, if still ours: the label of
        another live primary, if any. Raises LabelInUse when the lease was taken over."""
        import redis

        if self.epoch is None or self.refused is not None:
            return None
        try:
            return self.lease.renew(self._connection(), self.primary)
        except (redis.RedisError, OSError) as exc:  # the next send finds the outage
            log.debug("runbus: could not renew the lease: %s", exc)
            return None

    def _renewed(self, other_primary: str | None) -> None:
        if other_primary is not None and self.primary:
            self._demote(
                PrimaryConflict(
                    f"run {self.identity.run_id!r} has another live primary, label {other_primary!r}"
                )
            )

    def _demote(self, exc: PrimaryConflict) -> None:
        log.error("runbus: %s; this label goes on as a non-primary", exc)
        self.primary = False

    def _refuse(self, exc: RunbusError) -> None:
        """Stop shipping for good: what is not in Redis yet is discarded, the spool removed."""
        left = self.unshipped
        self.refused = exc
        self._discard()
        log.error(
            "runbus: %s. This process ships nothing more as %s/%s (%d events discarded); "
            "finish() returns False",
            exc,
            self.identity.run_id,
            self.identity.label,
            left,
        )

    def _discard(self) -> None:
        self._held_start = None
        if self.backlog.spool is not None:
            self.backlog.spool.close(remove=True)
        self.backlog = Backlog(
            self.options.max_buffer_bytes, None, 0, self.outbox.drops, self.options.batch_size
        )
        self.outbox.take(len(self.outbox), force=True)  # values waiting for a GPU too

    def _discard_until_stopped(self) -> None:
        """After a refusal: keep the queue that log() feeds empty until finish()."""
        while not self._stopping.wait(self.options.flush_interval):
            self._progress_at = time.monotonic()
            self._discard()
        self._discard()

    def release(self, exit_code: int) -> None:
        """At finish, once everything is shipped: give the lease and the primary claim up, if
        still ours; the primary leaves the run's finished marker."""
        if self.refused is not None or self._client is None or self._outage_since is not None:
            return
        try:
            if not self.lease.release(self._client, self.primary, exit_code):
                ident = self.identity
                log.error("runbus: %s/%s was taken over before finish", ident.run_id, ident.label)
        except Exception as exc:  # the claims then lapse by their TTLs
            log.debug("runbus: could not release the lease: %s", exc)

    def _connection(self) -> SyncClient:
        if self._client is None:
            self._client = connect(self.identity.redis_url, self.options)
        return self._client

    # -- the loop --------------------------------------------------------------------------------

    def stop(self, deadline: float | None = None) -> None:
        """Ship what is queued, then end; past `deadline` (monotonic), spool the rest and end."""
        self._deadline = deadline
        self._failures_at_stop = self._outage_failures
        if self.epoch is None:
            self._next_try = 0.0  # Redis never answered: one more try now, not after the backoff
        self._stopping.set()
        self.outbox.demand.set()

    def run(self) -> None:
        self._courier.start()
        try:
            self._loop()
        finally:
            self._courier.close()
            self.outbox.wake_waiters()  # puts waiting for room drop instead: nobody ships now

    def _loop(self) -> None:
        busy = False
        while True:
            self._progress_at = time.monotonic()
            if not busy:
                self._rest()
            self._maybe_heartbeat()
            if self.refused is not None:
                self._discard_until_stopped()
                return
            busy = self._work()
            if self._stopping.is_set() and self._stopped():
                return

    def _stopped(self) -> bool:
        """At finish: whether this thread is done, everything shipped or, past the deadline,
        what is left spooled (if there is a spool)."""
        if not self.unshipped:
            self._close_spool(remove=True)
            return True
        if self._time_left() <= 0 or self._offline():
            self._give_up()
            return True
        return False

    def _offline(self) -> bool:
        """At finish: whether this process never reached Redis, and a try since finish() began
        failed too, with a spool to keep the events in: then it ends now, not at the deadline
        (`runbus sync` ships the spool)."""
        return (
            self.epoch is None
            and self.refused is None
            and self.backlog.spool is not None
            and self._outage_since is not None
            and self._outage_failures > self._failures_at_stop
        )

    def _rest(self) -> None:
        """Wait a flush interval, or less: until a put finds the outbox full, a Redis call is
        done, or stop()."""
        wake = self.outbox.demand
        wake.wait(max(0.0, min(self.options.flush_interval, self._time_left())))
        wake.clear()

    def _work(self) -> bool:
        """Collect the Redis call that is done and start the next, and encode the outbox into
        the backlog a batch at a time, until neither has anything to do or a time slice has
        passed: True when work is left then."""
        until = time.monotonic() + PUMP_SLICE
        while True:
            called = self._dispatch()
            encoded = self._encode_batch()
            now = self._progress_at = time.monotonic()
            if not (called or encoded) or self.refused is not None:
                return False
            if now > until or (self._stopping.is_set() and self._time_left() <= 0):
                return True

    def _dispatch(self) -> bool:
        """Settle the call in flight if it is done, then start the next one due; whether either
        happened."""
        call = self._call
        if call is not None:
            if not call.done.is_set():
                return False
            self._call = None
            self._settle(call)
            if self.refused is not None:
                return True
        if time.monotonic() < self._next_try:
            return call is not None
        following = self._next_call()
        if following is None:
            return call is not None
        self._call = following
        self._courier.submit(following)
        return True

    def _next_call(self) -> Call | None:
        """What the courier does next: the handshake (Redis was away at init), describing the
        hardware (once, for the start event), a renewal of the claims, the spools of dead
        processes, else shipping the backlog's oldest batch."""
        if self.epoch is None:
            return Call(self._claim_later, self._handshaken)
        if self._to_describe():
            return Call(self._describe, self._have_described)
        if self._renew_due:
            self._renew_due = False
            return Call(self._renew_claims, self._renewed)
        if not self._orphans_checked:
            self._orphans_checked = True
            return Call(self._ship_orphans)
        batch = self.backlog.peek(self.options.batch_size)
        if not batch:
            return None
        epoch = self.epoch
        return Call(lambda: self._send(rows_of(batch), epoch), lambda _: self._sent(batch))

    def _settle(self, call: Call) -> None:
        """A call's outcome, on this thread: its `then`, a refusal, or an outage."""
        import redis

        exc = call.error
        if exc is None:
            call.then(call.result)
            self._note_recovery()
        elif isinstance(exc, LabelInUse | RunExists | RunNotFound):
            self._refuse(exc)
        elif isinstance(exc, redis.RedisError | OSError):
            # Unreachable, past the socket timeout, out of memory, a READONLY replica, a wrong
            # password: retried with backoff, logged once; the events wait in the backlog.
            self._next_try = time.monotonic() + self.note_outage(exc)
        else:
            raise exc

    def _note_recovery(self) -> None:
        if self._outage_since is not None:
            log.log(
                logging.INFO if self._outage_oom else logging.WARNING,
                "runbus: Redis at %s is back after %.1fs; %d events shipped so far",
                safe_url(self.identity.redis_url),
                time.monotonic() - self._outage_since,
                self.shipped,
            )
            self._outage_since = None
            self._outage_failures = 0
            self._denied_logged = False

    def _time_left(self) -> float:
        return float("inf") if self._deadline is None else self._deadline - time.monotonic()

    def _give_up(self) -> None:
        """Out of time at finish, or offline: keep what is left in the spool (if any) for
        `runbus sync` or the next init() of this run and label."""
        while self._encode_batch(taking=False, force=True):
            pass
        self._encode_held_start(force=True)
        spool = self.backlog.spool
        try:
            self.backlog.persist()
        except OSError as exc:  # an unwritable directory, a full disk: the events stay in memory
            log.error("runbus: cannot write the spool %s: %s", spool and spool.path, exc)
            spool = None
        if spool is None:
            log.warning("runbus: finish() gave up with %d events not shipped to Redis", self.unshipped)
            return
        self.left_in_spool = spool.held
        self._close_spool(remove=False)
        self._say_spooled(spool.held, spool.path)

    def _say_spooled(self, count: int, path: str) -> None:
        """Where the events that did not reach Redis wait, and the command that ships them: the
        primary says it for the run (a warning), every other label for itself (info) when the
        process never reached Redis, else as a warning."""
        ident = self.identity
        directory = os.path.dirname(path)
        command = f"runbus sync {ident.run_id}"
        if os.path.abspath(directory) != os.path.abspath(config.spool_dir() or ""):
            command += f" --spool-dir {shlex.quote(directory)}"
        if self.epoch is not None:
            log.warning(
                "runbus: %d events of %s/%s could not reach Redis in time and wait in %s: `%s` "
                "ships them (so does the next init() of this run and label)",
                count,
                ident.run_id,
                ident.label,
                path,
                command,
            )
        elif self.primary:
            log.warning(
                "runbus: Redis at %s was not reachable: run %s waits on this machine in %s "
                "(%d events of label %s%s); once Redis is up, bring it in with: %s",
                safe_url(ident.redis_url),
                ident.run_id,
                directory,
                count,
                ident.label,
                ", and each other rank's in a file of its own" if (ident.world_size or 1) > 1 else "",
                command,
            )
        else:
            log.info(
                "runbus: %d events of %s/%s wait in %s for `%s`",
                count,
                ident.run_id,
                ident.label,
                path,
                command,
            )

    def _close_spool(self, remove: bool) -> None:
        if self.backlog.spool is not None:
            self.backlog.spool.close(remove=remove and not self.backlog.spool.unread())

    def note_outage(self, exc: Exception) -> float:
        """Log an outage once (a refusal of access once too, as an error; an `-OOM` answer once,
        as back-pressure), drop the connection (not for OOM); the delay before the next try."""
        from runbus.redis import access_denied

        denied = access_denied(exc, self.identity.redis_url)
        oom = out_of_memory(exc)
        # First, before anything is logged: a put waiting for room looks again (and drops if
        # the backlog is full), and so lets go of any logging lock it holds that the lines below
        # may need.
        outage_began = self._outage_since is None
        now = time.monotonic()
        if outage_began:
            self._outage_since = now
        self._outage_oom = oom and (outage_began or self._outage_oom)
        self.outbox.wake_waiters()
        if denied is not None and not self._denied_logged:
            self._denied_logged = True
            log.error("runbus: %s; nothing is shipped until it is fixed, %s", denied, self._buffering())
        elif oom and (self._oom_warned_at is None or now - self._oom_warned_at > OOM_WARN_EVERY):
            self._oom_warned_at = now
            log.warning(
                "runbus: Redis at %s is out of memory (%s); holding events and retrying, %s "
                "(an ingester trims acknowledged entries to make room)",
                safe_url(self.identity.redis_url),
                exc,
                self._buffering(),
            )
        elif outage_began and denied is None and not oom:
            log.warning(
                "runbus: cannot ship to Redis at %s (%s); %s",
                safe_url(self.identity.redis_url),
                exc,
                self._buffering(),
            )
        if not oom:  # the connection is fine: Redis answered
            self._drop_connection()
        delay = self._retry.compute(self._outage_failures)
        self._outage_failures += 1
        return delay

    def _buffering(self) -> str:
        return f"buffering up to {self.options.max_buffer_bytes >> 20} MiB in memory" + (
            f", then in {self.options.spool_dir}" if self.options.spool_dir else ""
        )

    def _drop_connection(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception as exc:  # a broken socket may fail to close; it is gone either way
                log.debug("runbus: closing a broken connection: %s", exc)

    def _maybe_heartbeat(self) -> None:
        """Put a heartbeat when one is due (none once the finish is put: nothing follows it),
        and mark the label's lease (and the primary claim) due a renewal."""
        now = time.monotonic()
        if self.outbox.closed:
            return
        scheduled = now >= self._next_heartbeat
        # A beat out of schedule when the step stops advancing, and when it moves on again.
        if not (self.progress.beat_due(time.time()) or scheduled):
            return
        data = {**self.outbox.drops.report(), "buffered": self.unshipped, "shipped": self.shipped}
        try:
            data.update(beat_fields(self.progress, self.watched_thread, self.options.heartbeat_interval))
        except Exception as exc:  # the beat itself matters more than what it tells of the stack
            log.debug("runbus: heartbeat without vitals: %s", exc)
        blocked_at = self.outbox.blocked_at
        if blocked_at is None:
            self.outbox.put("heartbeat", None, data)
        else:  # ahead of the events that wait for the GPU, saying how long they have waited
            data["gpu_wait_s"] = round(now - blocked_at, 3)
            self.outbox.put_first("heartbeat", None, data)
        if not scheduled:
            return
        self._next_heartbeat = now + self.options.heartbeat_interval
        if self._client is not None and self._outage_since is None:
            self._renew_due = True

    def _encode_batch(self, taking: bool | None = None, force: bool = False) -> bool:
        """Queued events → encoded records in the backlog, one batch (no network); whether any.

        While Redis takes events (`taking`, else asked) a batch is taken only when the backlog
        has room, and when it is less than AHEAD batches ahead of shipping or a put has waited
        for room longer than REDIS_WAIT; each of its events is kept whatever the bound: nothing
        is dropped, log() waits instead. Otherwise every queued event is taken, and what finds
        the backlog full is dropped. `force`: events that wait for their GPU too (giving up).
        """
        if not len(self.outbox) and not self.outbox.unnumbered_drops:
            return False
        now = time.monotonic()
        if taking is None:
            taking = self._redis_taking(now)
        if taking and not self._room_ahead(now):
            return False
        taken = self.outbox.take(self.options.batch_size, force)
        for pending in taken:
            if pending[0] == "start" and not self._start_ready():
                self._held_start = pending  # encoded first once ready (_encode_held_start)
                continue
            record = self._record(pending)
            if record is not None:
                self.backlog.add(record, keep=taking)
        self._note_progress(taken)
        return bool(taken)

    def _note_progress(self, taken: list[Pending]) -> None:
        """The step of a batch's last event that has one, for the heartbeats: once a batch, not
        once an event, so that encoding costs no more than it did."""
        for _, _, ts, step, _ in reversed(taken):
            if step is not None:
                self.progress.saw(step, ts)
                return

    def _room_ahead(self, now: float) -> bool:
        """While Redis takes events: whether the backlog takes another batch now."""
        backlog = self.backlog
        if not backlog.has_room():
            return False
        if len(backlog) < AHEAD * self.options.batch_size:
            return True
        since = self.outbox.waiting_since
        return since is not None and now - since > REDIS_WAIT

    def _encode_held_start(self, force: bool = False) -> None:
        """The held start event, first in the backlog (only when no call is in flight, or at
        the end: a batch in flight was peeked from the backlog's front)."""
        if self._held_start is not None and (self._start_ready() or force):
            record = self._record(self._held_start)
            self._held_start = None
            if record is not None:
                self.backlog.add_first(record)

    def _record(self, pending: Pending) -> Record | None:
        kind, seq, ts, step, data = pending
        if kind == "start":
            data = {**data, "primary": self.primary}
            if self._to_describe():  # forced out at the end, before the courier described it
                self._describe()
                self._described = True
            if self._hardware_info is not None:
                data["hardware"] = self._hardware_info
            if self._git_info is not None:
                data["git"] = self._git_info
        elif kind == "finish":
            data = {**data, **self.outbox.drops.report()}
        elif kind == "log":
            data = self._redacted_log(data)
        try:
            blob = encode_data(kind, data)
        except Exception as exc:  # whatever a value's read raises: counted as a drop, never fatal
            # Values were checked by log(); a device tensor whose read fails (its device died, or
            # still computes it when finish() gives up) lands here. It counts as dropped, so its
            # gap is explained and finish() says so.
            self.failed_encodes += 1
            self.outbox.drops.note(seq)
            log.error("runbus: event seq %d (%s) could not be encoded: %s", seq, kind, exc)
            return None
        return Record(kind, self.epoch or 0, seq, ts, step, blob)

    def _redacted_log(self, data: dict[str, Any]) -> dict[str, Any]:
        """A log event's data, its text's secrets redacted (runbus.redact) before it leaves the
        process: here, off the thread that printed or logged it."""
        stream = data["stream"]
        redactor = self._redactors.get(stream)
        if redactor is None:
            redactor = self._redactors[stream] = LineRedactor()
        text = redactor(data["text"])
        return data if text is data["text"] else {**data, "text": text}

    def _describe_hardware(self) -> dict[str, Any] | None:
        # Not in init(): NVML can take a second to start on a big host.
        from runbus.producer.hardware import describe
        from runbus.producer.system import sampled_devices

        try:
            return describe(sampled_devices(self.gpu_device_ids)[1])
        except Exception as exc:  # the start is never lost for want of a description
            log.warning("runbus: cannot describe the hardware: %s", exc)
            return None

    def _send(self, records: list[Any], epoch: int) -> None:
        """The courier's XADDs of one batch (records, each a sequence in Record's order), in one
        round trip (a Lua script)."""
        client = self._connection()
        xadd_many = self._xadd_many
        if xadd_many is None or xadd_many.registered_client is not client:
            xadd_many = self._xadd_many = client.register_script(wire.XADD_MANY_SCRIPT)
        entries = ((kind, ep or epoch, seq, ts, step, data) for kind, ep, seq, ts, step, data in records)
        ident = self.identity
        xadd_many(
            keys=[self.key], args=wire.xadd_many_args(ident.run_id, ident.label, entries, self._secrets)
        )

    def _sent(self, batch: Chunk | list[Record]) -> None:
        self.backlog.shipped(batch)
        self.shipped += len(batch)

    def _ship_orphans(self) -> None:
        """The courier ships the spools that earlier processes of this run and label left behind
        when they died (only this thread touches them)."""
        if not self.options.spool_dir:
            return
        client = self._connection()
        for spool in orphan_spools(
            self.options.spool_dir, self.identity.run_id, self.identity.label, os.getpid()
        ):
            epoch, secret = spool.recorded_seal()
            if epoch is not None and secret:
                self._secrets.setdefault(epoch, secret)
            shipped = ship_spool(
                spool, self._send, lambda: self._earlier_epoch(client), self.options.batch_size
            )
            log.warning("runbus: shipped %d events left in %s by an earlier process", shipped, spool.path)
            spool.close(remove=True)

    def _earlier_epoch(self, client: SyncClient) -> tuple[int, bytes]:
        epoch = self.lease.earlier_epoch(client)
        self._secrets[epoch] = self.lease.secret
        return epoch, self.lease.secret


def out_of_memory(exc: BaseException) -> bool:
    """Whether Redis answered `-OOM` (over maxmemory with noeviction): back-pressure, not an
    outage; the connection is fine."""
    from redis.exceptions import OutOfMemoryError, ResponseError

    return isinstance(exc, OutOfMemoryError) or (
        isinstance(exc, ResponseError) and str(exc).startswith("OOM")
    )
