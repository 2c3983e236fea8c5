"""Task names and queues: which message travels where.

Three queues, each a Redis list under the namespace's key prefix (`GCWORKER_BROKER_NAMESPACE`):

- `heartbeats` — small and frequent. Its own queue, so that a backlog of large reports can never
  delay a heartbeat behind it into a false stall: a reconciler consuming both queues takes the
  next message from the queue it did not just serve (kombu rotates the queues it polls), so a
  waiting heartbeat is next in line as soon as a pool process frees up; a host may also run a
  reconciler for heartbeats alone (`gcworker reconciler --queues heartbeats`).
- `reports` — full (and compact) reports, one task each, applied in any order by any number of
  reconcilers; per-worker order is enforced in the database (rule 6), not by the queue.
- `collect` — the beat schedule's collection triggers.
"""

from __future__ import annotations

from dataclasses import dataclass

HEARTBEAT_TASK = "gcworker.heartbeat"
REPORT_TASK = "gcworker.report"
COLLECT_TASK = "gcworker.collect"

ROLES = ("heartbeats", "reports", "collect")


@dataclass(frozen=True)
class Queues:
    heartbeats: str = "heartbeats"
    reports: str = "reports"
    collect: str = "collect"

    @property
    def all(self) -> tuple[str, ...]:
        return (self.heartbeats, self.reports, self.collect)

    def named(self, roles) -> list[str]:
        """Queue names for roles such as ["heartbeats", "reports"]; unknown roles raise."""
        unknown = sorted(set(roles) - set(ROLES))
        if unknown:
            raise ValueError(f"unknown queue {', '.join(unknown)} (known: {', '.join(ROLES)})")
        return [getattr(self, role) for role in roles]


QUEUES = Queues()

ROUTES = {
    HEARTBEAT_TASK: {"queue": QUEUES.heartbeats},
    REPORT_TASK: {"queue": QUEUES.reports},
    COLLECT_TASK: {"queue": QUEUES.collect},
}


def task_for(message_type: str) -> tuple[str, str]:
    """(task name, queue) for a message's `type` field."""
    if message_type == "heartbeat":
        return HEARTBEAT_TASK, QUEUES.heartbeats
    if message_type in ("report", "unchanged"):
        return REPORT_TASK, QUEUES.reports
    raise ValueError(f"no task for messages of type {message_type!r}")
