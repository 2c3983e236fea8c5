"""The beat schedule: `collect` every `GCWORKER_GC_INTERVAL`, kept in Redis by celery-redbeat.

Beat may run on several hosts: redbeat lets one of them hold a lock in Redis and send the
triggers; the others wait for the lock (and take over within `lock_timeout` if the holder
dies). Even two triggers at once are harmless: the collection itself is fenced in the database
(rule 11), and a collection that finds the fence taken skips.
"""

from __future__ import annotations

from datetime import timedelta

from tasks.routing import COLLECT_TASK, QUEUES

LOOP_INTERVAL_CAP = timedelta(seconds=5)
# redbeat, made to outlive a broker outage or restart (see tasks/beat.py).
BEAT_SCHEDULER = "tasks.beat:Scheduler"


def beat_schedule(settings) -> dict:
    interval = settings.gc_interval.total_seconds()
    return {
        "gcworker-collect": {
            "task": COLLECT_TASK,
            "schedule": interval,
            # A trigger nobody picked up within one interval is replaced by the next one.
            "options": {"queue": QUEUES.collect, "expires": max(interval, 1.0)},
        }
    }


def beat_lock_key(settings) -> str:
    """The Redis key some beat holds while it runs the schedule (redbeat's prefix + ":lock")."""
    return beat_config(settings)["redbeat_key_prefix"] + ":lock"


def beat_config(settings) -> dict:
    """Celery settings of beat and redbeat."""
    loop = min(settings.gc_interval, LOOP_INTERVAL_CAP).total_seconds()
    return {
        "beat_scheduler": BEAT_SCHEDULER,
        "beat_schedule": beat_schedule(settings),
        "beat_max_loop_interval": loop,
        "redbeat_redis_url": settings.broker_url or None,
        "redbeat_key_prefix": f"{settings.broker_namespace}:redbeat:",
        "redbeat_lock_timeout": max(int(5 * loop), 5),
    }
