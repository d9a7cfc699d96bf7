"""The background thread that turns queued events into stream entries and ships them to Redis.

It owns the Redis connection: the handshake (epoch, primary claim, announcing the stream),
batched pipelined XADDs, heartbeats, and reconnecting with capped backoff. Nothing here runs on
the training thread.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import orjson

from producer import wire
from producer.environment import Identity
from producer.outbox import Outbox, Pending
from producer.urls import safe_url

log = logging.getLogger("runbus.producer")


class PrimaryConflict(RuntimeError):
    """Another label already holds the run's live primary role."""


@dataclass(frozen=True, slots=True)
class ShipperOptions:
    """Tunables of the shipping thread (see producer.init for their meaning)."""

    flush_interval: float = 0.05
    batch_size: int = 2000
    heartbeat_interval: float = 10.0
    primary_ttl: float = 30.0
    connect_timeout: float = 2.0
    socket_timeout: float = 10.0
    max_backoff: float = 5.0


def connect(url: str, options: ShipperOptions):
    """A redis-py client for `url`; imported lazily so `import producer` stays cheap."""
    import redis

    return redis.Redis.from_url(
        url,
        socket_connect_timeout=options.connect_timeout,
        socket_timeout=options.socket_timeout,
        retry_on_timeout=False,
    )


def _wire_number(value: Any) -> float | int | str:
    if type(value) is float:
        return value if math.isfinite(value) else wire.finite_to_wire(value)
    if type(value) is int:
        # JSON has no integer limit but orjson stops at 64 bits; larger ones travel as floats.
        return value if -(2**63) <= value < 2**63 else float(value)
    # A 0-d tensor or numpy scalar: `.item()` happens here, off the training thread, so a CUDA
    # tensor synchronises the shipper, never the caller.
    return _wire_number(value.item())


def encode_data(kind: str, data: Any) -> bytes:
    """The `data` field of one event, as JSON bytes."""
    if kind in ("metric", "system"):
        data = {key: _wire_number(value) for key, value in data.items()}
    return orjson.dumps(data)


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
        self.shipped = 0
        self.failed_encodes = 0
        self._client = None
        self._inflight: list[dict] = []
        self._stopping = threading.Event()
        self._next_heartbeat = time.monotonic() + options.heartbeat_interval
        self._outage_since: float | None = None
        self.describe_hardware = True
        self.gpu_device_ids: tuple[int, ...] | None = None

    # -- the handshake -------------------------------------------------------------------------

    def handshake(self) -> None:
        """Take an epoch, announce the stream and claim the primary role.

        Raises PrimaryConflict when another label holds a live primary claim, and redis-py's
        ConnectionError / TimeoutError when Redis cannot be reached.
        """
        client = self._connection()
        ident = self.identity
        if self.primary:
            self._claim_primary(client)
        pipe = client.pipeline(transaction=False)
        pipe.incr(wire.epoch_key(ident.run_id, ident.label))
        pipe.sadd(wire.REGISTRY_KEY, self.key)
        self.epoch = int(pipe.execute()[0])

    def _claim_primary(self, client) -> None:
        key, label = wire.primary_key(self.identity.run_id), self.identity.label
        ttl = max(1, math.ceil(self.options.primary_ttl))
        if client.set(key, label, nx=True, ex=ttl):
            return
        holder = client.get(key)
        if holder is None or holder.decode() == label:
            # Our own earlier claim (a restarted rank), or it expired in between.
            client.set(key, label, ex=ttl)
            return
        raise PrimaryConflict(
            f"run {self.identity.run_id!r} already has a live primary, label {holder.decode()!r}; "
            f"label {label!r} cannot also be primary (pass primary=False, or wait "
            f"{ttl}s for the other claim to lapse)"
        )

    def _refresh_primary(self, client) -> None:
        try:
            self._claim_primary(client)
        except PrimaryConflict as exc:
            self._demote(exc)

    def _demote(self, exc: PrimaryConflict) -> None:
        log.error("runbus: %s; this label goes on as a non-primary", exc)
        self.primary = False

    def release_primary(self) -> None:
        """Give the primary claim up (at finish), if it is still ours."""
        if not self.primary or self._client is None or self._outage_since is not None:
            return
        key = wire.primary_key(self.identity.run_id)
        try:
            holder = self._client.get(key)
            if holder is not None and holder.decode() == self.identity.label:
                self._client.delete(key)
        except Exception as exc:  # the claim then lapses by its TTL
            log.debug("runbus: could not release the primary claim: %s", exc)

    def _connection(self):
        if self._client is None:
            self._client = connect(self.identity.redis_url, self.options)
        return self._client

    # -- the loop --------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ship what is queued, then end."""
        self._stopping.set()

    def run(self) -> None:
        import redis

        delay = 0.0
        while True:
            if delay:
                time.sleep(delay)  # also while stopping: finish() bounds its own wait
            else:
                self._stopping.wait(self.options.flush_interval)
            self._maybe_heartbeat()
            try:
                if self.epoch is None:
                    try:
                        self.handshake()
                    except PrimaryConflict as exc:
                        self._demote(exc)
                        self.handshake()
                self._flush()
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                delay = self._note_outage(exc, delay)
                continue
            except redis.RedisError as exc:
                # A refused command (OOM, READONLY replica): retried like an outage, loudly.
                delay = self._note_outage(exc, delay)
                continue
            if self._outage_since is not None:
                log.warning(
                    "runbus: Redis at %s is back after %.1fs; %d events shipped so far",
                    safe_url(self.identity.redis_url),
                    time.monotonic() - self._outage_since,
                    self.shipped,
                )
                self._outage_since = None
            delay = 0.0
            if self._stopping.is_set() and not self._inflight and not len(self.outbox):
                return

    def _note_outage(self, exc: Exception, delay: float) -> float:
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            log.warning(
                "runbus: cannot ship to Redis at %s (%s); buffering up to %d events",
                safe_url(self.identity.redis_url),
                exc,
                self.outbox.max_events,
            )
        self._drop_connection()
        return min(self.options.max_backoff, max(0.1, delay * 2))

    def _drop_connection(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception as exc:  # a broken socket may fail to close; it is gone either way
                log.debug("runbus: closing a broken connection: %s", exc)

    def _maybe_heartbeat(self) -> None:
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.options.heartbeat_interval
        self.outbox.put(
            "heartbeat",
            None,
            {"dropped": self.outbox.dropped, "buffered": len(self.outbox), "shipped": self.shipped},
        )
        if self.primary and self._client is not None and self._outage_since is None:
            self._refresh_primary(self._client)

    def _flush(self) -> None:
        client = self._connection()
        while True:
            if not self._inflight:
                taken = self.outbox.take(self.options.batch_size)
                if not taken:
                    return
                self._inflight = [fields for p in taken if (fields := self._fields(p))]
            pipe = client.pipeline(transaction=False)
            key = self.key
            for fields in self._inflight:
                pipe.xadd(key, fields)
            pipe.execute()
            self.shipped += len(self._inflight)
            self._inflight = []

    def _hardware(self) -> dict:
        # Here, not in init(): NVML can take a second to start on a big host.
        from producer.hardware import describe
        from producer.system import sampled_devices

        return describe(sampled_devices(self.gpu_device_ids)[1])

    def _fields(self, pending: Pending) -> dict | None:
        kind, seq, ts, step, data = pending
        if kind == "start":
            data = {**data, "primary": self.primary}
            if self.describe_hardware:
                data["hardware"] = self._hardware()
        try:
            blob = encode_data(kind, data)
        except Exception as exc:
            # Values were checked by log(); a tensor whose .item() fails (its device died) lands
            # here. The seq stays unshipped, so storage shows it as missing.
            self.failed_encodes += 1
            log.error("runbus: event seq %d (%s) could not be encoded: %s", seq, kind, exc)
            return None
        ident = self.identity
        return wire.encode_fields(kind, ident.run_id, ident.label, self.epoch, seq, ts, blob, step)
