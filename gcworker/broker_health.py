"""Whether the control plane keeps up with the heartbeats, as seen in the broker (rule 12).

At the start of every collection the safety brake asks whether the control plane can see that it
is itself behind. In broker mode the collect task hands it a `BrokerSelfCheck`, which answers
from Redis, with the first reason that holds:

- **The broker cannot be read**: whether heartbeats reach the control plane is unknown.
- **No reconciler is alive to process heartbeats.** Every reconciler holds a *lease* in Redis on
  each queue it consumes, renewed from its consumer's event loop (`LeaseKeeper`, a consumer
  bootstep in `tasks.app`) every `renew_every` and lasting three times that. A reconciler that
  dies, hangs, or loses its broker connection stops renewing, and its lease lapses; one that
  stops cleanly gives it back at once.
- **The broker restarted less than a heartbeat TTL ago** (its own uptime): heartbeats published
  while it was down are lost, and those of the last TTL may not have been replaced yet.
- **Heartbeats have waited in the broker longer than the TTL.** See "Observations" below.
- **Heartbeats wait for a retry**: the database refused them (the task retries with backoff, the
  message waiting, reserved, in the broker); a worker's expiry must not be judged before its
  heartbeat is applied. The heartbeat task marks itself retrying and unmarks itself when it ends.
- **The reconcilers processing heartbeats have been up for less than a TTL** (without a break:
  a lease remembers since when it has been held; a lapse or a reconnection to the broker starts
  it afresh). Heartbeats sent before they started, or while they were cut off, may not be
  applied yet, and a backlog cannot have been observed for a whole TTL yet either.

Any of them puts the collector in disruption mode: it stalls no one and deletes nothing, and on
recovery every heartbeat expiry restarts and every mark is cleared (`gcworker.gc.brake`). The
last one is what every deploy shows for a TTL: it is reported as the start-up phase, not as a
disruption (`is_start_up`).

Observations: a Redis queue is a list (kombu pushes on the left and pops on the right), and
messages carry no arrival time the control plane could trust (a worker's clock is never used).
So the control plane looks: each look records the queue's newest message and the instant of
the look. If a message recorded at least a TTL ago is still in the queue, it has waited in the
broker at least that long. Only the newest record at least a TTL old matters (older records'
messages were queued before it, so they left before it); the others are pruned, and a new
record is made only when the newest message changed and the last record is older than an
eighth of the TTL, so that a look costs a handful of list operations. Every live reconciler
looks at each lease renewal and every collection looks too, so the records have no gap longer
than a renewal while any reconciler is alive. A message given back to the queue by a dead
reconciler is rewritten by kombu (marked redelivered) and is no longer recognised: a record can
miss a wait, never invent one.

Clocks: every instant here is read from the broker's own clock (Redis `TIME`, inside the
scripts that record and compare instants), a control-plane server that every reconciler and
collector shares, so every duration is measured on one clock: never a worker's clock, never a
reconciler host's. (The decisions the durations lead to, expiry and deletion, are then made
with the database's clock, as always.)

Keys (N is `GCWORKER_BROKER_NAMESPACE`, Q a queue):

    N:health:lease:Q          ZSET  reconciler -> end of its lease (ms, broker clock)
    N:health:lease:Q:since    HASH  reconciler -> start of its unbroken lease (ms)
    N:health:seen:heartbeats  LIST  "ms|message": the newest message at each look, oldest first
    N:health:retrying:heartbeats  ZSET  task id -> when the mark lapses if never removed (ms)
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

from gcworker.settings import format_duration

log = logging.getLogger(__name__)

HEARTBEATS = "heartbeats"
START_UP = "the reconcilers processing heartbeats have been up for only"
LEASE_PERIODS = 3  # a lease lasts this many renewal periods
MIN_RENEW = 0.2
MAX_RENEW = 5.0
KEY_LIFETIME = timedelta(days=1)  # keys no one touches for this long go away
SOCKET_TIMEOUT = 5.0
RETRY_HOLD_EXTRA = timedelta(seconds=60)  # the task's longest backoff (tasks.reconcile.RETRY)

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: lease zset, since hash. ARGV: member, lease ms, reset (0/1), key lifetime ms.
_RENEW = (
    _NOW
    + """
local deadline = redis.call('ZSCORE', KEYS[1], ARGV[1])
if ARGV[3] == '1' or not deadline or tonumber(deadline) < now
   or not redis.call('HGET', KEYS[2], ARGV[1]) then
  redis.call('HSET', KEYS[2], ARGV[1], now)
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return now
"""
)

# KEYS: lease zset, since hash. Returns {live leases, ms since the oldest unbroken one began}.
_LEASES = (
    _NOW
    + """
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)
for _, member in ipairs(lapsed) do redis.call('HDEL', KEYS[2], member) end
if #lapsed > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. now) end
local live = redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')
local oldest = now
for _, member in ipairs(live) do
  local since = tonumber(redis.call('HGET', KEYS[2], member))
  if since and since < oldest then oldest = since end
end
return {#live, now - oldest}
"""
)

# KEYS: queue list, records list. ARGV: threshold ms, spacing ms, key lifetime ms.
# Returns {ms the oldest recognised message has waited at least (-1: none), queue length}.
_OBSERVE = (
    _NOW
    + """
local threshold = tonumber(ARGV[1])
local records = redis.call('LRANGE', KEYS[2], 0, -1)
local function split(record)
  local bar = string.find(record, '|', 1, true)
  return tonumber(string.sub(record, 1, bar - 1)), string.sub(record, bar + 1)
end
local waited = -1
for i = #records, 1, -1 do
  local at, message = split(records[i])
  if at <= now - threshold then
    if redis.call('LPOS', KEYS[1], message, 'RANK', -1) then waited = now - at end
    if i > 1 then redis.call('LTRIM', KEYS[2], i - 1, -1) end
    break
  end
end
local newest = redis.call('LINDEX', KEYS[1], 0)
if newest then
  local append = true
  if #records > 0 then
    local at, message = split(records[#records])
    append = message ~= newest and now - at >= tonumber(ARGV[2])
  end
  if append then redis.call('RPUSH', KEYS[2], now .. '|' .. newest) end
end
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return {waited, redis.call('LLEN', KEYS[1])}
"""
)

# KEYS: retrying zset. ARGV: task id, hold ms, key lifetime ms.
_MARK_RETRYING = (
    _NOW
    + """
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return now
"""
)

# KEYS: retrying zset. Returns the number of live marks.
_RETRYING = (
    _NOW
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)
return redis.call('ZCARD', KEYS[1])
"""
)


def _ms(value: timedelta | float) -> int:
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    return max(1, int(seconds * 1000))


def renew_period(heartbeat_ttl: timedelta) -> float:
    """Seconds between lease renewals: a quarter of the TTL, within [0.2s, 5s]."""
    return min(MAX_RENEW, max(MIN_RENEW, heartbeat_ttl.total_seconds() / 4))


@dataclass(frozen=True)
class BrokerStatus:
    """What the broker shows of the heartbeats' progress; durations in seconds."""

    heartbeat_ttl: float
    reconcilers: int  # live leases on the heartbeats queue
    reconcilers_up_for: float  # since the oldest of them began, unbroken
    waiting: int  # heartbeats in the queue
    waited: float | None  # a queued heartbeat has waited at least this long (None: none seen)
    retrying: int  # heartbeats waiting for a retry
    broker_uptime: float | None  # None: the broker would not say

    def reason(self) -> str | None:
        """Why the control plane is behind, or None."""
        ttl = self.heartbeat_ttl
        if self.reconcilers == 0:
            return (
                "no reconciler is alive to process heartbeats "
                f"(no live lease on the {HEARTBEATS} queue)"
            )
        if self.broker_uptime is not None and self.broker_uptime < ttl:
            return (
                f"the broker restarted {_seconds(self.broker_uptime)} ago, less than the "
                f"heartbeat TTL ({_seconds(ttl)}): heartbeats published while it was down are lost"
            )
        if self.waited is not None and self.waited >= ttl:
            return (
                f"heartbeats have waited in the broker for at least {_seconds(self.waited)}, "
                f"longer than the heartbeat TTL ({_seconds(ttl)}); {self.waiting} waiting: "
                "the reconcilers are behind"
            )
        if self.retrying:
            return (
                f"{self.retrying} heartbeat{'s' if self.retrying != 1 else ''} wait for a retry "
                "(the database refused them): the reconcilers are behind"
            )
        if self.reconcilers_up_for < ttl:
            return (
                f"{START_UP} "
                f"{_seconds(self.reconcilers_up_for)}, less than the heartbeat TTL "
                f"({_seconds(ttl)}): heartbeats sent before may not be applied yet"
            )
        return None


def is_start_up(reason: str | None) -> bool:
    """Whether `reason` is the control plane's own start-up: the reconcilers have been up for
    less than a TTL (after a deploy, or a reconnection to the broker). The brake holds as in
    disruption mode, but it is reported as its own phase (an INFO line, `gcworker_starting_up`),
    so that an alert on `gcworker_disruption` does not fire on every deploy."""
    return reason is not None and reason.startswith(START_UP)


def _seconds(value: float) -> str:
    return format_duration(timedelta(seconds=round(value, 1)))


class BrokerHealth:
    """The Redis side: leases, observations of the heartbeats queue, retry marks."""

    def __init__(
        self,
        redis_client,
        namespace: str,
        heartbeat_ttl: timedelta,
        *,
        retry_hold: timedelta = timedelta(minutes=6),
    ):
        self.redis = redis_client
        self.namespace = namespace
        self.heartbeat_ttl = heartbeat_ttl
        self.renew_every = renew_period(heartbeat_ttl)
        self.lease = LEASE_PERIODS * self.renew_every
        self.retry_hold = retry_hold
        self._renew = redis_client.register_script(_RENEW)
        self._leases = redis_client.register_script(_LEASES)
        self._observe = redis_client.register_script(_OBSERVE)
        self._mark_retrying = redis_client.register_script(_MARK_RETRYING)
        self._retrying = redis_client.register_script(_RETRYING)

    @classmethod
    def from_settings(cls, settings, redis_client=None) -> BrokerHealth:
        import redis

        client = redis_client or redis.Redis.from_url(
            settings.broker_url,
            decode_responses=True,
            socket_timeout=SOCKET_TIMEOUT,
            socket_connect_timeout=SOCKET_TIMEOUT,
        )
        return cls(
            client,
            settings.broker_namespace,
            settings.heartbeat_ttl,
            retry_hold=settings.broker_visibility_timeout + RETRY_HOLD_EXTRA,
        )

    # Keys ------------------------------------------------------------------------------------

    def key(self, *parts: str) -> str:
        return ":".join((self.namespace, *parts))

    def lease_keys(self, queue: str) -> list[str]:
        return [self.key("health", "lease", queue), self.key("health", "lease", queue, "since")]

    @property
    def queue_key(self) -> str:
        return self.key(HEARTBEATS)  # kombu's list, under the broker's key prefix

    @property
    def records_key(self) -> str:
        return self.key("health", "seen", HEARTBEATS)

    @property
    def retrying_key(self) -> str:
        return self.key("health", "retrying", HEARTBEATS)

    # Reconcilers -----------------------------------------------------------------------------

    def renew(self, member: str, queues, *, reset: bool = False, pipe=None) -> None:
        """Renew `member`'s leases on `queues` (`reset`: its unbroken hold starts now)."""
        target = pipe if pipe is not None else self.redis.pipeline(transaction=False)
        for queue in queues:
            self._renew(
                keys=self.lease_keys(queue),
                args=[member, _ms(self.lease), int(reset), _ms(KEY_LIFETIME)],
                client=target,
            )
        if pipe is None:
            target.execute()

    def release(self, member: str, queues) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for queue in queues:
            zset, since = self.lease_keys(queue)
            pipe.zrem(zset, member)
            pipe.hdel(since, member)
        pipe.execute()

    def observe(self, *, pipe=None):
        """Record a look at the heartbeats queue; returns {ms waited or -1, queue length}."""
        return self._observe(
            keys=[self.queue_key, self.records_key],
            args=[
                _ms(self.heartbeat_ttl),
                _ms(self.heartbeat_ttl / 8),
                _ms(max(KEY_LIFETIME, 10 * self.heartbeat_ttl)),
            ],
            client=pipe if pipe is not None else self.redis,
        )

    # Heartbeat tasks -------------------------------------------------------------------------

    def mark_retrying(self, task_id: str) -> None:
        self._mark_retrying(
            keys=[self.retrying_key],
            args=[task_id, _ms(self.retry_hold), _ms(KEY_LIFETIME)],
        )

    def unmark_retrying(self, task_id: str) -> None:
        self.redis.zrem(self.retrying_key, task_id)

    # The collector's question ------------------------------------------------------------------

    def status(self) -> BrokerStatus:
        """One look at everything (raises redis errors: the caller decides what they mean)."""
        pipe = self.redis.pipeline(transaction=False)
        self._leases(keys=self.lease_keys(HEARTBEATS), client=pipe)
        self.observe(pipe=pipe)
        self._retrying(keys=[self.retrying_key], client=pipe)
        pipe.info("server")
        leases, observed, retrying, info = pipe.execute(raise_on_error=False)
        for reply in (leases, observed, retrying):
            if isinstance(reply, Exception):
                raise reply
        uptime = None
        if isinstance(info, dict) and "uptime_in_seconds" in info:
            uptime = float(info["uptime_in_seconds"])
        waited_ms, waiting = observed
        return BrokerStatus(
            heartbeat_ttl=self.heartbeat_ttl.total_seconds(),
            reconcilers=int(leases[0]),
            reconcilers_up_for=int(leases[1]) / 1000,
            waiting=int(waiting),
            waited=None if int(waited_ms) < 0 else int(waited_ms) / 1000,
            retrying=int(retrying),
            broker_uptime=uptime,
        )

    def close(self) -> None:
        self.redis.close()


class BrokerSelfCheck:
    """The brake's `self_check` in broker mode: a reason when the control plane is behind.

    Also sets the broker gauges of `/metrics`. A broker that cannot be read is a reason too.
    """

    def __init__(self, health: BrokerHealth):
        self.health = health

    @classmethod
    def from_settings(cls, settings) -> BrokerSelfCheck:
        return cls(BrokerHealth.from_settings(settings))

    def __call__(self) -> str | None:
        from gcworker import metrics

        try:
            status = self.health.status()
        except Exception as error:  # noqa: BLE001 - any failure to look means: cannot tell
            return (
                f"the broker cannot be read ({type(error).__name__}: {error}): whether "
                "heartbeats reach the control plane is unknown"
            )
        metrics.HEARTBEAT_RECONCILERS.set(status.reconcilers)
        metrics.HEARTBEATS_WAITING.set(status.waiting)
        metrics.HEARTBEAT_WAIT_SECONDS.set(status.waited or 0.0)
        metrics.HEARTBEATS_RETRYING.set(status.retrying)
        return status.reason()


class LeaseKeeper:
    """A reconciler's leases: renewed on a timer by its consumer (see `tasks.app`), given back
    when it stops. A renewal that fails is logged; the next one that succeeds starts the lease
    afresh (the reconciler was cut off from the broker in between). Each renewal also looks at
    the heartbeats queue, so that its records have no gaps while any reconciler is alive."""

    def __init__(self, health: BrokerHealth, member: str, queues):
        self.health = health
        self.member = member
        self.queues = sorted(set(queues))
        self._broken = True

    @classmethod
    def for_node(cls, settings, node: str, queues) -> LeaseKeeper:
        return cls(BrokerHealth.from_settings(settings), f"{node}:{os.getpid()}", queues)

    @property
    def every(self) -> float:
        return self.health.renew_every

    def renew(self, *, reset: bool = False) -> bool:
        try:
            pipe = self.health.redis.pipeline(transaction=False)
            self.health.renew(self.member, self.queues, reset=reset or self._broken, pipe=pipe)
            self.health.observe(pipe=pipe)
            pipe.execute()
        except Exception as error:  # noqa: BLE001 - the lease lapses, which is the safe side
            if not self._broken:
                log.warning(
                    "lease not renewed: it lapses unless the next renewal succeeds",
                    extra={"member": self.member, "error": f"{type(error).__name__}: {error}"},
                )
            self._broken = True
            return False
        self._broken = False
        return True

    def release(self) -> None:
        try:
            self.health.release(self.member, self.queues)
        except Exception as error:  # noqa: BLE001 - it lapses on its own
            log.warning("lease not given back", extra={"member": self.member, "error": str(error)})
        self._broken = True

    def close(self) -> None:
        self.health.close()
