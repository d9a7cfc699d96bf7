"""One live writer per run and label: the lease a process holds in Redis, and the label's epochs.

A process that logs as a label holds `runbus:{RUN}:lease:LABEL` (its host, pid, a random token)
with a TTL its heartbeats renew, and gives it back at finish. Another live process claiming the
label gets LabelInUse naming the holder, never a new epoch. A new incarnation (a restarted rank)
takes the label once the holder has finished, or its lease has lapsed, or the holder is a
process of this machine that no longer runs (a SIGKILLed rank restarted at once).

One Lua script settles a claim atomically: the lease, the run's resume rule (a new job does not
continue a finished run), the primary claim and the epoch. An epoch is never below the Redis
server's clock in milliseconds, so a label's epochs keep growing even after Redis lost its data.
Each epoch a process writes is sealed with its secret (runbus.wire.seal_key): ingesters store an
epoch's entries only with that epoch's seal (docs/wire.md, Fencing).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from runbus import wire
from runbus.errors import LabelInUse, PrimaryConflict, RunExists, RunNotFound
from runbus.redis import reply_text

if TYPE_CHECKING:
    from redis.commands.core import Script

    from runbus.redis import SyncClient

log = logging.getLogger("runbus.producer")

# The next epoch of the label whose counter is KEYS[2]: one above the last, and never below the
# Redis clock in milliseconds (the counter is gone when Redis lost its data; the clock is not).
# A counter that holds no usable epoch (written by hand) is reported and replaced.
_NEXT_EPOCH = """
if redis.replicate_commands then redis.replicate_commands() end
local function next_epoch(key)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local last, odd = 0, ''
  local kind = redis.call('TYPE', key).ok
  if kind ~= 'none' then
    local text = kind == 'string' and redis.call('GET', key) or ('a ' .. kind)
    last = tonumber(text)
    if not last or last < 0 or last >= 2^52 or last ~= math.floor(last) then
      odd, last = text, 0
    end
  end
  local epoch = math.max(last + 1, now)
  redis.call('SET', key, string.format('%.0f', epoch))
  return epoch, now, odd, last
end
local function text_at(key)
  if redis.call('TYPE', key).ok == 'string' then return redis.call('GET', key) end
  return false
end
local function token_at(key)
  if redis.call('TYPE', key).ok == 'hash' then return redis.call('HGET', key, 'token') end
  return false
end
"""

# KEYS: lease, epoch counter, primary, finished marker, created marker.
# ARGV: token, token of a holder known to be gone (or ''), lease TTL ms, resume mode, restart
# count, '1' to claim the primary role, label, primary TTL s, then the holder's field/value pairs.
# Checks everything before it writes anything: a refused claim leaves no trace. "never" refuses a
# label that has logged into the run before (its epoch counter exists) once the run finished: a
# rank of the same job starting late, or a child's new label, still joins.
CLAIM_SCRIPT = (
    _NEXT_EPOCH
    + """
local held = token_at(KEYS[1])
if held and held ~= ARGV[1] and held ~= ARGV[2] then
  return {'held', redis.call('HGETALL', KEYS[1]), redis.call('PTTL', KEYS[1])}
end
if ARGV[4] == 'never' and tonumber(ARGV[5]) == 0 and redis.call('EXISTS', KEYS[4]) == 1
    and redis.call('EXISTS', KEYS[2]) == 1 then
  return {'finished', text_at(KEYS[4]) or '{}'}
end
if ARGV[4] == 'must' and redis.call('EXISTS', KEYS[4], KEYS[5]) == 0 then
  return {'missing'}
end
if ARGV[6] == '1' then
  local primary = text_at(KEYS[3])
  if primary and primary ~= ARGV[7] then return {'primary', primary} end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 9))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if ARGV[6] == '1' then redis.call('SET', KEYS[3], ARGV[7], 'EX', ARGV[8]) end
local epoch, now, odd, last = next_epoch(KEYS[2])
redis.call('SET', KEYS[5], string.format('%.0f', now), 'NX')
return {'ok', epoch, odd, last}
"""
)

# KEYS: lease, primary. ARGV: token, lease TTL ms, '1' if primary, label, primary TTL s, then
# the holder's field/value pairs (to take a lapsed lease again). Replies {lease, primary}: lease
# 'renewed', 'retaken' (it had lapsed and nobody took it) or 'lost' (then the holder's fields);
# primary '' or the label holding the primary role instead.
RENEW_SCRIPT = (
    _NEXT_EPOCH
    + """
local held = token_at(KEYS[1])
local status = 'renewed'
if held == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
elseif held then
  return {'lost', redis.call('HGETALL', KEYS[1])}
else
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], unpack(ARGV, 6))
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  status = 'retaken'
end
local other = ''
if ARGV[3] == '1' then
  local primary = text_at(KEYS[2])
  if primary and primary ~= ARGV[4] then
    other = primary
  else
    redis.call('SET', KEYS[2], ARGV[4], 'EX', ARGV[5])
  end
end
return {status, other}
"""
)

# KEYS: lease, primary, finished marker. ARGV: token, label, '1' if primary, the marker, its TTL s.
# Gives the lease up if it is ours (or lapsed); the primary also gives up its claim and marks
# the run finished. Replies 1, or 0 when another process holds the lease.
RELEASE_SCRIPT = (
    _NEXT_EPOCH
    + """
local held = token_at(KEYS[1])
if held and held ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
if ARGV[3] == '1' then
  if text_at(KEYS[2]) == ARGV[2] then redis.call('DEL', KEYS[2]) end
  redis.call('SET', KEYS[3], ARGV[4], 'EX', ARGV[5])
end
return 1
"""
)

# KEYS: epoch counter. An epoch for events of an earlier process that never reached Redis.
EPOCH_SCRIPT = (
    _NEXT_EPOCH
    + """
local epoch, now, odd = next_epoch(KEYS[1])
return {epoch, odd}
"""
)


# KEYS: lease, epoch counter, primary, finished marker. ARGV: token, label, the finished marker
# ('' for none), its TTL s. A console keeper's notice that its rank, the lease holder under
# `token`, ended without finishing: only while the lease is still that holder's (a finish gives it
# back, a restarted process takes it over). Gives the lease up, and the primary claim where it
# holds this label (leaving the marker, if any, as a finish does); replies a new epoch of the
# label for the notice alone, above every epoch of the rank, or 0 when the lease is not the rank's.
END_SCRIPT = (
    _NEXT_EPOCH
    + """
if token_at(KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
if text_at(KEYS[3]) == ARGV[2] then
  redis.call('DEL', KEYS[3])
  if ARGV[3] ~= '' then redis.call('SET', KEYS[4], ARGV[3], 'EX', ARGV[4]) end
end
local epoch = next_epoch(KEYS[2])
return epoch
"""
)


def _read(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return ""


def _stat(pid: int) -> list[str]:
    """Fields of /proc/PID/stat after the command name: [state, ppid, …]; [] where there is none."""
    text = _read(f"/proc/{pid}/stat")
    return text.rpartition(")")[2].split() if text else []


def _start_ticks(pid: int) -> str:
    fields = _stat(pid)
    return fields[19] if len(fields) > 19 else ""  # field 22 of stat: start time since boot


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


@dataclass(frozen=True, slots=True)
class Holder:
    """The process that holds a label's lease. `boot`, `pidns` and `ticks` (Linux's boot id,
    pid namespace and the process's start time) tell whether its pid can be checked from here."""

    token: str
    host: str
    pid: int
    started: float
    restart: int = 0
    boot: str = ""
    pidns: str = ""
    ticks: str = ""

    @classmethod
    def this_process(cls, restart: int) -> Holder:
        pid = os.getpid()
        return cls(
            token=secrets.token_hex(16),
            host=socket.gethostname(),
            pid=pid,
            started=time.time(),
            restart=restart,
            boot=_read("/proc/sys/kernel/random/boot_id"),
            pidns=_pid_namespace(),
            ticks=_start_ticks(pid),
        )

    @classmethod
    def from_reply(cls, flat: list[Any]) -> Holder:
        """The holder from a lease's HGETALL (a hand-written one may lack fields or hold junk)."""
        fields = {reply_text(k): reply_text(v) for k, v in zip(flat[0::2], flat[1::2], strict=False)}

        def number(name: str) -> float:
            try:
                return float(fields.get(name, ""))
            except ValueError:
                return 0.0

        return cls(
            token=fields.get("token", ""),
            host=fields.get("host", "?"),
            pid=int(number("pid")),
            started=number("started"),
            restart=int(number("restart")),
            boot=fields.get("boot", ""),
            pidns=fields.get("pidns", ""),
            ticks=fields.get("ticks", ""),
        )

    def fields(self) -> list[str | int | float]:
        """HSET's field/value pairs."""
        return [
            *("token", self.token, "host", self.host, "pid", self.pid, "started", repr(self.started)),
            *("restart", self.restart, "boot", self.boot, "pidns", self.pidns, "ticks", self.ticks),
        ]

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started)) if self.started else "?"
        return f"pid {self.pid} on {self.host} (since {since}, restart {self.restart})"

    def checkable_from(self, me: Holder) -> bool:
        """Whether this holder's pid means the same process here: same machine, same boot and
        the same pid namespace (another container's pid 7 is not ours)."""
        return (self.host, self.boot, self.pidns) == (me.host, me.boot, me.pidns)

    def gone(self, me: Holder) -> bool:
        """Whether the holder verifiably no longer runs: its pid is free, a zombie, or now
        another process. False when that cannot be told from here (another machine)."""
        if not self.checkable_from(me) or self.pid <= 0:
            return False
        if self.pid == me.pid:
            return self.ticks != me.ticks  # our pid, an earlier process's lease
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # it runs, as another user
        except OSError:
            return False
        stat = _stat(self.pid)
        if stat and stat[0] in ("Z", "X"):  # killed, not yet reaped by its parent
            return True
        return bool(self.ticks and stat and len(stat) > 19 and stat[19] != self.ticks)


def default_ttl(heartbeat_interval: float) -> float:
    """The lease TTL when none is given: three heartbeats, at least 30 s."""
    return max(30.0, 3 * heartbeat_interval)


@dataclass
class LabelLease:
    """This process's claim on one run and label: taken by the handshake, renewed with the
    heartbeats, given back at finish. Only the shipper thread uses it (and finish(), after it)."""

    run_id: str
    label: str
    restart: int
    resume: str
    ttl: float
    primary_ttl: float
    redis_url: str = field(default="", repr=False)
    holder: Holder | None = None
    # This process's seal secret: it seals (wire.seal) the entries of every epoch it writes.
    # Only its hex, per epoch, goes to Redis (wire.seal_key), for ingesters to check seals with.
    secret: bytes = field(default_factory=wire.new_seal_secret, repr=False)
    epoch: int = 0  # this process's own epoch, once claimed
    # Epochs between the label's last one and ours, never given out: for events of earlier
    # processes that never reached Redis, so they order before this process's (highest first).
    _spare: tuple[int, int] = (0, 0)
    _scripts: dict[str, Script] = field(default_factory=dict, repr=False)

    def _script(self, client: SyncClient, text: str) -> Script:
        script = self._scripts.get(text)
        if script is None:
            script = self._scripts[text] = client.register_script(text)
        return script

    def _call(self, client: SyncClient, text: str, keys: list[str], args: list[Any]) -> Any:
        return self._script(client, text)(keys=keys, args=args, client=client)

    # -- claiming --------------------------------------------------------------------------------

    def claim(self, client: SyncClient, primary: bool) -> int:
        """Take the label (and the primary role if `primary`) and a new epoch; the epoch.

        A holder verifiably gone is replaced at once. One that cannot be checked from here
        (another machine) is waited for, up to its lease's TTL, by an elastic restart of a later
        round than its own (torchrun has stopped that round's workers); anyone else gets
        LabelInUse. Raises RunExists / RunNotFound as `resume` says, PrimaryConflict when another
        label is the run's live primary, and redis-py's errors when Redis fails.
        """
        me = Holder.this_process(self.restart)
        gone_token = ""
        wait_until: float | None = None
        while True:
            args = self._claim_args(me, gone_token, primary)
            reply = self._call(client, CLAIM_SCRIPT, self._claim_keys(), args)
            status = reply_text(reply[0])
            if status == "ok":
                self.holder = me
                epoch, odd = int(reply[1]), reply_text(reply[2])
                self._spare = (int(reply[3]), epoch)
                self.epoch = epoch
                self._seal(client, epoch)
                if odd:
                    log.warning(
                        "runbus: %s held %r, not an epoch; replaced",
                        wire.epoch_key(self.run_id, self.label),
                        odd[:40],
                    )
                return epoch
            if status == "held":
                holder, left_ms = Holder.from_reply(reply[1]), int(reply[2])
                if holder.token != gone_token and (holder.gone(me) or self._stale_own(holder, me)):
                    gone_token = holder.token  # take over, only if it still holds it
                    continue
                if wait_until is None and self.restart > holder.restart and left_ms > 0:
                    wait_until = time.monotonic() + left_ms / 1000 + 0.5
                    log.warning(
                        "runbus: %s/%s is held by %s; restart %d waits up to %.0fs for its lease to lapse",
                        self.run_id,
                        self.label,
                        holder.describe(),
                        self.restart,
                        left_ms / 1000,
                    )
                if wait_until is not None and time.monotonic() < wait_until:
                    time.sleep(min(0.25, max(0.0, wait_until - time.monotonic())))
                    continue
                raise self.in_use(holder, left_ms)
            if status == "finished":
                raise self._finished(reply_text(reply[1]))
            if status == "missing":
                from runbus.config import safe_url

                raise RunNotFound(
                    f"run {self.run_id!r} does not exist in Redis at {safe_url(self.redis_url)}: "
                    'resume="must" only continues a run that exists (check the run id and the '
                    'Redis URL, or pass resume="allow")'
                )
            if status == "primary":
                raise PrimaryConflict(
                    f"run {self.run_id!r} already has a live primary, label {reply_text(reply[1])!r}; "
                    f"label {self.label!r} cannot also be primary (pass primary=False, or wait "
                    f"{self.primary_ttl:.0f}s for the other claim to lapse)"
                )
            raise RuntimeError(f"unexpected reply from the claim script: {reply!r}")

    @staticmethod
    def _stale_own(holder: Holder, me: Holder) -> bool:
        # This very process, under another token: a Run of it that finished without giving the
        # lease back (Redis was away). init() returns a live Run of the label before claiming.
        return holder.pid == me.pid and holder.ticks == me.ticks and holder.checkable_from(me)

    def _claim_keys(self) -> list[str]:
        run, label = self.run_id, self.label
        return [
            wire.lease_key(run, label),
            wire.epoch_key(run, label),
            wire.primary_key(run),
            wire.finished_key(run),
            wire.created_key(run),
        ]

    def _claim_args(self, me: Holder, gone_token: str, primary: bool) -> list[Any]:
        return [
            me.token,
            gone_token,
            self._ttl_ms(),
            self.resume,
            self.restart,
            "1" if primary else "0",
            self.label,
            max(1, round(self.primary_ttl)),
            *me.fields(),
        ]

    def _ttl_ms(self) -> int:
        return max(1, round(self.ttl * 1000))

    def in_use(self, holder: Holder, left_ms: int | None = None) -> LabelInUse:
        lapse = f"within {left_ms / 1000:.0f}s" if left_ms and left_ms > 0 else "when its TTL runs out"
        return LabelInUse(
            f"run {self.run_id!r}, label {self.label!r} is in use by {holder.describe()}: a label has "
            f"one live writer. A child process logs under a label of its own "
            f'(runbus.init(label="{self.label}-worker"), or run.child(...)); a separate job needs '
            f"another run id. If that process is gone, its lease lapses {lapse}"
        )

    def _finished(self, marker: str) -> RunExists:
        try:
            done = orjson.loads(marker)
        except orjson.JSONDecodeError:
            done = {}
        if not isinstance(done, dict):
            done = {}
        when = done.get("ts")
        at = ""
        if isinstance(when, float | int):
            at = time.strftime(" at %Y-%m-%d %H:%M:%S", time.localtime(when))
        return RunExists(
            f"run {self.run_id!r} has already finished (primary {done.get('label', '?')!r}, exit code "
            f"{done.get('exit_code', '?')}{at}); a new job does not continue a finished run: pass "
            'resume="allow" (or set RUNBUS_RESUME=allow) to log into it again, or choose another run id'
        )

    # -- keeping and giving back -------------------------------------------------------------------

    def renew(self, client: SyncClient, primary: bool) -> str | None:
        """Extend the lease (and the primary claim) if still ours; the label holding the primary
        role instead of us, if another does. Raises LabelInUse when another process took the
        label (this one was away longer than the lease)."""
        holder = self.holder
        assert holder is not None, "renew() after a claim"
        keys = [wire.lease_key(self.run_id, self.label), wire.primary_key(self.run_id)]
        args = [
            holder.token,
            self._ttl_ms(),
            "1" if primary else "0",
            self.label,
            max(1, round(self.primary_ttl)),
            *holder.fields(),
        ]
        status, other = self._call(client, RENEW_SCRIPT, keys, args)
        status = reply_text(status)
        if status == "lost":
            raise self.in_use(Holder.from_reply(other))
        if status == "retaken":
            self._seal(client, self.epoch)  # a Redis that lost its data lost the seal too
            log.warning(
                "runbus: the lease of %s/%s had lapsed (Redis away longer than %.0fs, or it lost "
                "its data); taken again",
                self.run_id,
                self.label,
                self.ttl,
            )
        return reply_text(other) or None

    def release(self, client: SyncClient, primary: bool, exit_code: int) -> bool:
        """Give the lease up (and, as the primary, the primary claim, leaving the run's finished
        marker); False if another process holds it by now."""
        holder = self.holder
        if holder is None:
            return False
        run = self.run_id
        keys = [wire.lease_key(run, self.label), wire.primary_key(run), wire.finished_key(run)]
        done = {"label": self.label, "exit_code": exit_code, "ts": time.time()}
        marker = orjson.dumps({**done, "host": holder.host, "pid": holder.pid})
        args = [holder.token, self.label, "1" if primary else "0", marker, wire.FINISHED_TTL]
        released = bool(self._call(client, RELEASE_SCRIPT, keys, args))
        self.holder = None
        return released

    def earlier_epoch(self, client: SyncClient) -> int:
        """An epoch of this label for events of an earlier process that never reached Redis:
        below this process's own and above every other given out (one after it if none is left)."""
        last, mine = self._spare
        if mine - 1 > last:
            self._spare = (last, mine - 1)
            epoch = mine - 1
        else:
            epoch = int(self._call(client, EPOCH_SCRIPT, [wire.epoch_key(self.run_id, self.label)], [])[0])
        self._seal(client, epoch)
        return epoch

    def _seal(self, client: SyncClient, epoch: int) -> None:
        """Store this process's secret as `epoch`'s seal, for ingesters (wire.seal_key).

        Not in the claim script: a script must be granted read access to every key it names,
        and under the README's ACLs producers may only write seals. The epoch is this process's
        alone, so a value found there was written by hand: it is replaced. Nothing of the epoch
        is shipped before this returns."""
        key = wire.seal_key(self.run_id, self.label)
        pipe = client.pipeline(transaction=False)
        pipe.hset(key, str(epoch), self.secret.hex())
        pipe.expire(key, wire.FINISHED_TTL)
        pipe.execute()


def store_end(client: SyncClient, claim: dict[str, Any], exit_code: int | None, signal: int | None) -> bool:
    """A console keeper's notice that the process holding `claim`'s lease (run, label, token,
    secret, host, pid: what its rank told it) ended without finishing, with `exit_code` (None:
    unknown), as a `finish` of a new epoch of the label: ordered after every event of the
    process, sealed with the process's secret. False when the lease is no longer the process's
    (it finished, or a restarted process took the label): then nothing is written."""
    run, label = claim["run"], claim["label"]
    marker = ""
    if exit_code is not None:
        done = {"label": label, "exit_code": exit_code, "ts": time.time()}
        marker = orjson.dumps({**done, "host": claim["host"], "pid": claim["pid"]}).decode()
    keys = [
        wire.lease_key(run, label),
        wire.epoch_key(run, label),
        wire.primary_key(run),
        wire.finished_key(run),
    ]
    epoch = int(
        client.register_script(END_SCRIPT)(keys=keys, args=[claim["token"], label, marker, wire.FINISHED_TTL])
    )
    if not epoch:
        return False
    secret = bytes.fromhex(claim["secret"])
    key = wire.seal_key(run, label)
    pipe = client.pipeline(transaction=False)
    pipe.hset(key, str(epoch), secret.hex())  # before the entry: an ingester checks it by this
    pipe.expire(key, wire.FINISHED_TTL)
    pipe.execute()
    data: dict[str, Any] = {"exit_code": exit_code, "noticed_by": "keeper"}
    if signal is not None:
        data["signal"] = signal
    entry = ("finish", epoch, 1, time.time(), None, orjson.dumps(data))
    args = wire.xadd_many_args(run, label, [entry], {epoch: secret})
    client.register_script(wire.XADD_MANY_SCRIPT)(keys=[wire.stream_key(run, label)], args=args)
    return True
