"""What a reconciler does with one event and what a collector run does, counted and logged.

The Celery tasks (`tasks/reconcile.py`) and the in-process paths of embedded mode (the
in-process delivery channel, `gcworker up` without a broker) call these same functions, so an
event or a collection is handled, measured and logged the same way in both modes.
"""

from __future__ import annotations

import logging
import reprlib
import time
from collections.abc import Callable

from gcworker import metrics
from gcworker.broker_health import is_start_up
from gcworker.codec import Rejected
from gcworker.db.stats import state_counts
from gcworker.gc.collection import CollectionSummary, collect
from gcworker.reconcile import HeartbeatResult, ReportResult

log = logging.getLogger(__name__)


def receive(plane, envelope, *, task: str, hooks=None):
    """Decode, check and apply one message envelope as it came off the broker.

    A rejected message (malformed, oversized, unsigned, wrongly signed...) changes nothing but
    the dead-letter list; it is counted and returned, never raised, so that the broker's message
    is acknowledged and never redelivered forever. `hooks`: see `ControlPlane.receive`.
    """
    started = time.perf_counter()
    result = plane.receive(envelope, hooks)
    if isinstance(result, Rejected):
        metrics.MESSAGES_REJECTED.labels(task).inc()
        if task == "report":
            metrics.REPORTS.labels("rejected").inc()
        elif task == "heartbeat":
            metrics.HEARTBEATS.labels("rejected").inc()
        return result
    observe(result, time.perf_counter() - started)
    return result


# What a dead letter shows of a task's wrong arguments: a bounded sketch, whatever their size.
_sketch = reprlib.Repr()
_sketch.maxlevel, _sketch.maxstring, _sketch.maxother = 3, 120, 120


def rejected_call(plane, task: str, args: tuple, kwargs: dict, *, takes: int) -> bool:
    """Whether the Celery task `gcworker.<task>` was called with other arguments than its
    `takes` positional ones (1, the envelope, or none): what a broker message says is anyone's
    to write. Such a call is rejected like a malformed message (dead-lettered, counted, logged)
    and the task returns normally, so that its message is acknowledged once instead of failing
    with a TypeError."""
    if len(args) == takes and not kwargs:
        return False
    wanted = "one envelope" if takes else "no arguments"
    rejected = Rejected(
        f"malformed task call: gcworker.{task} takes {wanted}, got {len(args)} positional "
        f"and {len(kwargs)} keyword arguments",
        payload=_sketch.repr((args, kwargs)),
    )
    plane.dead_letter(rejected)
    metrics.MESSAGES_REJECTED.labels(task).inc()
    return True


def apply(plane, message):
    """Apply one already checked message (embedded mode's in-process delivery)."""
    started = time.perf_counter()
    result = plane.apply(message)
    observe(result, time.perf_counter() - started)
    return result


def observe(result, seconds: float) -> None:
    if isinstance(result, HeartbeatResult):
        metrics.HEARTBEATS.labels(str(result.outcome)).inc()
        return
    if not isinstance(result, ReportResult):
        return
    metrics.REPORTS.labels(str(result.outcome)).inc()
    metrics.REPORT_RECONCILE_SECONDS.observe(seconds)
    if result.lag is not None:
        metrics.REPORT_LAG_SECONDS.observe(max(0.0, result.lag.total_seconds()))
    metrics.count_counts(metrics.ROWS_MARKED_MISSING, result.marked)
    metrics.count_counts(metrics.ROWS_CLEARED, result.cleared)
    metrics.count_counts(metrics.UNKNOWN_HANDLES, result.unknown)
    metrics.count_counts(metrics.ROWS_DELETED, result.destroyed, "confirmed_destroyed")


def run_collection(
    plane, *, self_check: Callable[[], str | None] | None = None
) -> CollectionSummary:
    """One fenced collection (rule 11), counted; a skipped one (fence taken) says so.

    `self_check` is the brake's question "is the control plane itself behind?" (rule 12; in
    broker mode `gcworker.broker_health.BrokerSelfCheck`); `gcworker_disruption` follows the
    brake's answer, `gcworker_starting_up` instead when the answer is the start-up phase.
    """
    try:
        summary = collect(plane.db, plane.settings, self_check=self_check)
    except Exception:
        metrics.COLLECTIONS.labels("failed").inc()
        log.exception("collection failed")
        raise
    metrics.COLLECTIONS.labels(summary.outcome).inc()
    if summary.outcome != "completed":
        log.info(
            "collection finished",
            extra={"outcome": summary.outcome, "reason": "another collection holds the fence"},
        )
        return summary
    metrics.COLLECTION_SECONDS.observe(summary.seconds)
    metrics.LAST_COLLECTION.set(time.time())
    starting_up = is_start_up(summary.disruption_reason)
    metrics.DISRUPTION.set(1 if summary.disrupted and not starting_up else 0)
    metrics.STARTING_UP.set(1 if starting_up else 0)
    if not summary.dry_run:
        for kind in ("container", "volume", "worker"):
            deleted = summary.counts.get(f"{kind}s deleted", 0)
            if deleted:
                reason = "missing" if kind != "worker" else "worker_deleted"
                metrics.ROWS_DELETED.labels(kind, reason).inc(deleted)
    log.info(
        "collection finished",
        extra={
            "outcome": summary.outcome,
            "dry_run": summary.dry_run,
            "disruption": summary.disruption_reason,
            "seconds": round(summary.seconds, 4),
            "changes": summary.counts,
            "fenced_from": summary.fenced_from,
            "fenced_until": summary.fenced_until,
        },
    )
    refresh_state_gauges(plane)
    return summary


def refresh_state_gauges(plane) -> None:
    """The gauges of the database's state: workers by state, missing rows, the backlog."""
    try:
        counts = state_counts(plane.db)
    except Exception as error:  # noqa: BLE001 - gauges are best effort
        log.warning("state gauges not refreshed", extra={"error": str(error)})
        return
    metrics.set_states(metrics.WORKERS, counts.workers, metrics.WORKER_STATES)
    metrics.set_states(metrics.MISSING_ROWS, counts.missing, metrics.KINDS)
    for kind in metrics.KINDS:
        for state in metrics.BACKLOG_STATES:
            metrics.BACKLOG_ROWS.labels(kind, state).set(counts.backlog.get((kind, state), 0))
            oldest = counts.oldest.get((kind, state), 0.0)
            metrics.BACKLOG_OLDEST_SECONDS.labels(kind, state).set(oldest)
