"""Beat's scheduler: celery-redbeat, made to outlive a broker outage or restart.

Stock redbeat lets an error of Redis escape from its tick, and beat exits: a Redis restart of a
second would stop every collection (and `gcworker up`, which stops everything when a child
exits). This scheduler instead:

- waits out a broker it cannot reach, trying again every `RETRY_SECONDS`, sending nothing;
- takes its lock again when the lock is gone (Redis restarted and lost it, or the lock expired
  during the outage): only if no other beat took it meanwhile, and it sends nothing until it
  holds the lock, so that one beat of many still sends the triggers;
- puts the schedule back when Redis lost it (the entries live in Redis), so that collections
  resume after a restart that lost every key.

A trigger missed during the outage is simply late: the next one comes at most one interval
after the broker is back, and a collection is fenced in the database anyway (rule 11).
"""

from __future__ import annotations

import logging

import redis
from redbeat.schedulers import LUA_EXTEND_TO_SCRIPT, RedBeatScheduler, get_redis
from redis.exceptions import LockError

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0
_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError)


class Scheduler(RedBeatScheduler):
    def tick(self, min=min, **kwargs):  # noqa: A002 - the signature of celery's Scheduler
        try:
            if self.lock_key and not self._hold_lock():
                return self._wait()
            self._restore_schedule()
            return super().tick(min=min, **kwargs)
        except _UNREACHABLE as error:
            log.warning(
                "beat: the broker cannot be reached: sending nothing, trying again",
                extra={"error": f"{type(error).__name__}: {error}", "retry": RETRY_SECONDS},
            )
            return self._wait()
        except LockError as error:  # lost between our check and redbeat's extension
            log.warning("beat: lock lost: taking it again", extra={"error": str(error)})
            self.lock = None
            return self._wait()

    def _wait(self) -> float:
        return min(RETRY_SECONDS, self.max_interval)

    def _hold_lock(self) -> bool:
        """True while this beat holds the lock; takes it if it is free."""
        client = get_redis(self.app)
        if self.lock is not None and self.lock.owned():
            return True
        if self.lock is None:
            self.lock = client.lock(
                self.lock_key, timeout=self.lock_timeout, sleep=self.max_interval
            )
            self.lock.lua_extend = client.register_script(LUA_EXTEND_TO_SCRIPT)
        if self.lock.acquire(blocking=False):
            log.warning("beat: lock taken again: sending the schedule's triggers")
            return True
        return False

    def _restore_schedule(self) -> None:
        if not get_redis(self.app).exists(self.app.redbeat_conf.schedule_key):
            log.warning("beat: the schedule was lost from Redis: putting it back")
            self.setup_schedule()

    def close(self):
        try:
            super().close()
        except (*_UNREACHABLE, LockError) as error:
            log.warning("beat: lock not released (it expires)", extra={"error": str(error)})
