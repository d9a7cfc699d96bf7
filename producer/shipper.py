"""The background thread that turns queued events into stream entries and ships them to Redis.

It owns the Redis connection: the handshake (the label's lease, epoch and primary claim, see
runbus.producer.lease; announcing the stream), batched pipelined XADDs, heartbeats, and
reconnecting with capped, jittered backoff. Nothing here runs on the training thread, and nothing
here raises into it: while Redis is away, or refuses the credentials, events are buffered and the
problem is logged once. A handshake done late (Redis was away at init) that finds the label in
use, or a run this job may not join, stops shipping instead, with one error. Log lines have their
secrets redacted here, as they are encoded (runbus.redact).

While Redis answers, the shipper takes from the outbox only what the backlog has room for, so
nothing is dropped: a full outbox makes `log()` wait (back-pressure) instead. While Redis is away
it encodes everything into the bounded backlog and spool, and what finds them full is dropped.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from runbus import config, wire
from runbus.config import safe_url
from runbus.errors import LabelInUse, PrimaryConflict, RunbusError, RunExists, RunNotFound
from runbus.producer.backlog import Backlog, Record, Spool, orphan_spools, spool_path
from runbus.producer.environment import Identity
from runbus.producer.lease import LabelLease, default_ttl
from runbus.producer.outbox import Outbox, Pending
from runbus.redact import LineRedactor

if TYPE_CHECKING:
    from redis.commands.core import Script

    from runbus.redis import SyncClient

log = logging.getLogger("runbus.producer")

# How long the shipper ships without a break while there is work: then heartbeats and stop()
# get their turn.
PUMP_SLICE = 0.2


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
        self.failed_encodes = 0
        self.describe_hardware = True
        self.gpu_device_ids: tuple[int, ...] | None = None
        spool = None
        if options.spool_dir:
            spool = Spool(spool_path(options.spool_dir, identity.run_id, identity.label, os.getpid()))
        self.backlog = Backlog(options.max_buffer_bytes, spool, options.max_spool_bytes, outbox.drops)
        self._held_start: Pending | None = None
        self._redactors: dict[str, LineRedactor] = {}  # per log stream: its lines come in order
        self._orphans_checked = False
        self._client: SyncClient | None = None
        self._xadd_many: Script | None = None
        # The seal secret of each epoch this process ships (wire.seal): its own, the spare
        # epochs it gave earlier processes' events, and the epochs dead processes' spools recorded.
        self._secrets: dict[int, bytes] = {}
        self._stopping = threading.Event()
        self._deadline: float | None = None
        self._next_heartbeat = time.monotonic() + options.heartbeat_interval
        self._outage_since: float | None = None
        self._outage_failures = 0
        self._denied_logged = False  # an AccessDenied logged in this outage
        # Jittered, so that the ranks of a job that lost Redis together do not reconnect in step.
        self._retry = config.backoff(options.max_backoff)
        # When the loop last went round or shipped a batch. A put waits for room only while it
        # is recent: longer than a few Redis calls may take (one that times out is an outage)
        # means the shipper is stuck, for instance on a logging lock the waiting thread holds.
        self._progress_at = time.monotonic()
        self._stall_after = options.connect_timeout + 3 * options.socket_timeout + 1.0
        outbox.may_wait = self.answering

    @property
    def unshipped(self) -> int:
        """Events not yet in Redis (queued, encoded in memory, or spooled: at least 1 if any)."""
        return len(self.outbox) + len(self.backlog) + (self._held_start is not None)

    def answering(self) -> bool:
        """Whether a put that finds the outbox full should wait for room: Redis answers and
        this thread is shipping (never on this thread itself, which would wait for itself)."""
        return (
            self.epoch is not None
            and self._outage_since is None
            and threading.current_thread() is not self
            and self.is_alive()
            and time.monotonic() - self._progress_at < self._stall_after
        )

    # -- the handshake -------------------------------------------------------------------------

    def handshake(self) -> None:
        """Claim the label's lease, a new epoch and (as the primary) the primary role, and
        announce the stream.

        Raises LabelInUse when another live process holds this run and label, RunExists /
        RunNotFound as the resume mode says, PrimaryConflict when another label holds a live
        primary claim, and redis-py's ConnectionError / TimeoutError when Redis cannot be reached.
        """
        client = self._connection()
        epoch = self.lease.claim(client, self.primary)
        client.sadd(wire.REGISTRY_KEY, self.key)
        self.epoch = epoch
        self._secrets[epoch] = self.lease.secret
        if self.backlog.spool is not None:
            self.backlog.spool.note_epoch(self.epoch, self.lease.secret)

    def _handshake_later(self) -> bool:
        """The handshake from this thread (Redis was away at init): another live primary demotes
        this label; a label in use or a run not to join stops shipping. Whether it succeeded."""
        try:
            try:
                self.handshake()
            except PrimaryConflict as exc:
                self._demote(exc)
                self.handshake()
        except (LabelInUse, RunExists, RunNotFound) as exc:
            self._refuse(exc)
            return False
        return True

    def _renew_claims(self, client: SyncClient) -> None:
        """With each heartbeat: extend the lease and the primary claim, if still ours."""
        import redis

        if self.epoch is None or self.refused is not None:
            return
        try:
            other_primary = self.lease.renew(client, self.primary)
        except LabelInUse as exc:
            self._refuse(exc)
            return
        except (redis.RedisError, OSError) as exc:  # the next flush finds the outage
            log.debug("runbus: could not renew the lease: %s", exc)
            return
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
        self.backlog = Backlog(self.options.max_buffer_bytes, None, 0, self.outbox.drops)
        self.outbox.take(len(self.outbox))

    def _discard_until_stopped(self) -> None:
        """After a refusal: keep the queue that log() feeds empty until finish()."""
        while not self._stopping.wait(self.options.flush_interval):
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
        self._stopping.set()
        self.outbox.demand.set()

    def run(self) -> None:
        try:
            self._loop()
        finally:
            self.outbox.wake_waiters()  # puts waiting for room drop instead: nobody ships now

    def _loop(self) -> None:
        import redis

        next_try, busy = 0.0, False
        while True:
            self._progress_at = time.monotonic()
            if not busy:
                self._rest()
            busy = False
            renew_claims = self._maybe_heartbeat()
            if self.refused is not None:
                self._discard_until_stopped()
                return
            if time.monotonic() < next_try and self._time_left() > 0:
                # Redis is away: encoding goes on, so the queue feeding log() keeps room; the
                # bounded backlog (and spool) decide what is kept.
                self._encode_outbox()
            else:
                try:
                    if self.epoch is None and not self._handshake_later():
                        continue  # refused: the loop stops shipping at its next turn
                    if renew_claims:
                        self._renew_claims(self._connection())
                    self._encode_held_start()
                    if not self._orphans_checked:
                        self._ship_orphans()
                    busy = self._pump()
                except (redis.RedisError, OSError) as exc:
                    # Unreachable, or a refused command (OOM, READONLY replica, a wrong
                    # password): retried as an outage, logged once.
                    next_try = time.monotonic() + self.note_outage(exc)
                    self._encode_outbox()
                else:
                    self._note_recovery()
            if self._stopping.is_set():
                if not self.unshipped:
                    self._close_spool(remove=True)
                    return
                if self._time_left() <= 0:
                    self._give_up()
                    return

    def _rest(self) -> None:
        """Wait a flush interval, or less: until a put finds the outbox full, or stop()."""
        wake = self.outbox.demand
        wake.wait(max(0.0, min(self.options.flush_interval, self._time_left())))
        wake.clear()

    def _note_recovery(self) -> None:
        if self._outage_since is not None:
            log.warning(
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
        """Out of time at finish: keep what is left in the spool (if any) for the next init()."""
        self._encode_outbox()
        self._encode_held_start(force=True)
        spooled = self.backlog.persist()
        left = self.unshipped
        if self.backlog.spool is not None:
            log.warning(
                "runbus: %d events could not reach Redis in time and wait in %s for the next "
                "init() of this run and label",
                spooled,
                self.backlog.spool.path,
            )
            self._close_spool(remove=False)
        else:
            log.warning("runbus: finish() gave up with %d events not shipped to Redis", left)

    def _close_spool(self, remove: bool) -> None:
        if self.backlog.spool is not None:
            self.backlog.spool.close(remove=remove and not self.backlog.spool.unread())

    def note_outage(self, exc: Exception) -> float:
        """Log an outage once (a refusal of access once too, as an error), drop the connection;
        the delay before the next try."""
        from runbus.redis import access_denied

        denied = access_denied(exc, self.identity.redis_url)
        # First, before anything is logged: a put waiting for room stops waiting (and drops),
        # and so lets go of any logging lock it holds that the lines below may need.
        outage_began = self._outage_since is None
        if outage_began:
            self._outage_since = time.monotonic()
        self.outbox.wake_waiters()
        buffering = f"buffering up to {self.options.max_buffer_bytes >> 20} MiB in memory" + (
            f", then in {self.options.spool_dir}" if self.options.spool_dir else ""
        )
        if denied is not None and not self._denied_logged:
            self._denied_logged = True
            log.error("runbus: %s; nothing is shipped until it is fixed, %s", denied, buffering)
        elif outage_began and denied is None:
            log.warning(
                "runbus: cannot ship to Redis at %s (%s); %s",
                safe_url(self.identity.redis_url),
                exc,
                buffering,
            )
        self._drop_connection()
        delay = self._retry.compute(self._outage_failures)
        self._outage_failures += 1
        return delay

    def _drop_connection(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception as exc:  # a broken socket may fail to close; it is gone either way
                log.debug("runbus: closing a broken connection: %s", exc)

    def _maybe_heartbeat(self) -> bool:
        """Put a heartbeat when one is due (none once the finish is put: nothing follows it);
        whether the label's lease (and the primary claim) are due a renewal too."""
        now = time.monotonic()
        if now < self._next_heartbeat or self.outbox.closed:
            return False
        self._next_heartbeat = now + self.options.heartbeat_interval
        self.outbox.put(
            "heartbeat",
            None,
            {**self.outbox.drops.report(), "buffered": self.unshipped, "shipped": self.shipped},
        )
        return self._client is not None and self._outage_since is None

    def _encode_outbox(self, one_batch: bool = False) -> None:
        """Queued events → encoded records in the backlog (no network: also while Redis is away).

        `one_batch` is for when Redis answers: a batch at a time, each added whatever the bound
        (the caller takes one only when the backlog has room), so nothing is dropped.
        """
        while True:
            taken = self.outbox.take(self.options.batch_size)
            for pending in taken:
                if pending[0] == "start" and self.epoch is None:
                    # Its primary flag is only settled by the handshake.
                    self._held_start = pending
                    continue
                record = self._record(pending)
                if record is not None:
                    self.backlog.add(record, keep=one_batch)
            if one_batch or not taken:
                return

    def _encode_held_start(self, force: bool = False) -> None:
        if self._held_start is not None and (self.epoch is not None or force):
            record = self._record(self._held_start)
            self._held_start = None
            if record is not None:
                self.backlog.add_first(record)

    def _record(self, pending: Pending) -> Record | None:
        kind, seq, ts, step, data = pending
        if kind == "start":
            data = {**data, "primary": self.primary}
            if self.describe_hardware:
                try:
                    data["hardware"] = self._hardware()
                except Exception as exc:  # the start is never lost for want of a description
                    log.warning("runbus: cannot describe the hardware: %s", exc)
        elif kind == "finish":
            data = {**data, **self.outbox.drops.report()}
        elif kind == "log":
            data = self._redacted_log(data)
        try:
            blob = encode_data(kind, data)
        except Exception as exc:
            # Values were checked by log(); a device tensor whose read fails (its device died)
            # lands here. It counts as dropped, so its gap is explained and finish() says so.
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

    def _hardware(self) -> dict:
        # Here, not in init(): NVML can take a second to start on a big host.
        from runbus.producer.hardware import describe
        from runbus.producer.system import sampled_devices

        return describe(sampled_devices(self.gpu_device_ids)[1])

    def _send(self, client: SyncClient, records: list[Record], epoch: int) -> None:
        xadd_many = self._xadd_many
        if xadd_many is None or xadd_many.registered_client is not client:
            xadd_many = self._xadd_many = client.register_script(wire.XADD_MANY_SCRIPT)
        entries = ((r.kind, r.epoch or epoch, r.seq, r.ts, r.step, r.data) for r in records)
        ident = self.identity
        xadd_many(
            keys=[self.key], args=wire.xadd_many_args(ident.run_id, ident.label, entries, self._secrets)
        )

    def _pump(self) -> bool:
        """Encode and ship, a batch at a time, while Redis answers: events are taken from the
        outbox only while the backlog has room, so none is dropped (a full outbox makes the
        caller of log() wait instead). True when work is left after a time slice."""
        epoch = self.epoch
        assert epoch is not None, "the handshake comes before any flush"
        client = self._connection()
        backlog, batch_size = self.backlog, self.options.batch_size
        until = time.monotonic() + PUMP_SLICE
        while True:
            if backlog.has_room():
                self._encode_outbox(one_batch=True)
            records = backlog.peek(batch_size)
            if not records:
                return False
            self._send(client, records, epoch)
            backlog.shipped(records)
            self.shipped += len(records)
            if self._outage_since is not None:
                self._note_recovery()  # at once: a full outbox makes log() wait again, not drop
            now = self._progress_at = time.monotonic()
            if now > until or (self._stopping.is_set() and self._time_left() <= 0):
                return True

    def _ship_orphans(self) -> None:
        """Ship spools that earlier processes of this run and label left behind when they died."""
        self._orphans_checked = True
        if not self.options.spool_dir:
            return
        client = self._connection()
        for spool in orphan_spools(
            self.options.spool_dir, self.identity.run_id, self.identity.label, os.getpid()
        ):
            epoch, secret = spool.recorded_seal()
            if epoch is not None and secret:
                self._secrets.setdefault(epoch, secret)
            shipped = 0
            while True:
                records, offset, _ = spool.read(self.options.batch_size)
                if not records:
                    break
                if epoch is None and any(r.epoch == 0 for r in records):
                    # That process never reached Redis: its events get an epoch of their own.
                    epoch = self.lease.earlier_epoch(client)
                    self._secrets[epoch] = self.lease.secret
                self._send(client, records, epoch or 0)
                spool.read_offset = offset
                shipped += len(records)
                self._progress_at = time.monotonic()
            log.warning("runbus: shipped %d events left in %s by an earlier process", shipped, spool.path)
            spool.close(remove=True)
