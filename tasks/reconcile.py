"""The reconciler's tasks: record a heartbeat, reconcile a report, run a collection.

Each task gets one JSON envelope (`gcworker.codec`: the message as JSON text, and its
signature), has it decoded, validated and checked by the control plane, and applies it through
the same code embedded mode runs (`gcworker.pipeline`). A rejected message is logged, counted and
kept in the dead-letter list, and the task returns normally, so the broker's message is
acknowledged. After a heartbeat or a report, the task answers the worker through Redis with
answers signed by the control plane (`gcworker.handoff`, `gcworker.answers`): a stamp that dates
its next reports, and after a report its destroying handles.

A database that cannot be reached (OperationalError) makes the task retry with backoff; the
redelivered message is harmless (rule 6). A heartbeat waiting for its retry is marked in Redis
until it ends, and the collect task hands the brake a check of the broker
(`gcworker.broker_health`): while heartbeats wait (for a retry, or in the queue for longer than
the TTL) or no reconciler is alive to process them, the collector stalls no one (rule 12).
"""

from __future__ import annotations

import logging

from sqlalchemy.exc import OperationalError

from gcworker import pipeline
from gcworker.reconcile import HeartbeatResult, ReportResult
from gcworker.rules import HeartbeatOutcome, ReportOutcome
from tasks.app import app, settings
from tasks.routing import COLLECT_TASK, HEARTBEAT_TASK, REPORT_TASK

log = logging.getLogger(__name__)

RETRY = {
    "autoretry_for": (OperationalError,),
    "retry_backoff": True,
    "retry_backoff_max": 60,
    "retry_jitter": True,
    "max_retries": 12,
}

_plane = None
_board = None
_key_reader = None
_health = None
_self_check = None


def control_plane():
    """One control plane per process, opened in the pool process that runs the task."""
    global _plane
    if _plane is None:
        from gcworker.control_plane import ControlPlane

        _plane = ControlPlane(settings, check_schema=False)  # checked once at worker start
    return _plane


def board():
    global _board
    if _board is None:
        from gcworker.handoff import DestroyingBoard

        _board = DestroyingBoard.from_settings(settings)
    return _board


def key_reader():
    """The process's asynchronous connection for reading a report's key (PostgreSQL only)."""
    global _key_reader
    if _key_reader is None and control_plane().db.is_postgresql:
        from gcworker.handoff import KeyReader

        _key_reader = KeyReader(control_plane().db)
    return _key_reader


def health():
    global _health
    if _health is None:
        from gcworker.broker_health import BrokerHealth

        _health = BrokerHealth.from_settings(settings)
    return _health


def self_check():
    global _self_check
    if _self_check is None:
        from gcworker.broker_health import BrokerSelfCheck

        _self_check = BrokerSelfCheck(health())
    return _self_check


class HeartbeatTask(app.Task):
    """A heartbeat waiting for a retry is marked in Redis until it ends, however it ends."""

    def on_retry(self, exc, task_id, args, kwargs, einfo):
        _quietly(health().mark_retrying, task_id)

    def on_success(self, retval, task_id, args, kwargs):
        if self.request.retries:
            _quietly(health().unmark_retrying, task_id)

    def on_failure(self, exc, task_id, args, kwargs, einfo):
        _quietly(health().unmark_retrying, task_id)


def _quietly(action, task_id) -> None:
    try:
        action(task_id)
    except Exception as error:  # noqa: BLE001 - a lost mark lapses, a stale one too
        log.warning(
            "heartbeat retry mark not updated", extra={"task": task_id, "error": str(error)}
        )


# A task takes exactly its arguments: a call with any others is dead-lettered, not a TypeError.
@app.task(name=HEARTBEAT_TASK, base=HeartbeatTask, **RETRY)
def record_heartbeat(*args, **kwargs):
    from gcworker.handoff import publish_snapshot

    plane = control_plane()
    if pipeline.rejected_call(plane, "heartbeat", args, kwargs, takes=1):
        return
    result = pipeline.receive(plane, args[0], task="heartbeat")
    if isinstance(result, HeartbeatResult) and result.outcome is not HeartbeatOutcome.REJECTED:
        # Answered like a report: the worker's next reports carry a date (rule 4) at once.
        publish_snapshot(plane.db, board(), result.worker, result.seq)


@app.task(name=REPORT_TASK, **RETRY)
def reconcile_report(*args, **kwargs):
    from gcworker.handoff import ReportHandoff

    plane = control_plane()
    if pipeline.rejected_call(plane, "report", args, kwargs, takes=1):
        return
    # The key is read with the worker's head while the message is validated; the stored
    # snapshot is refreshed from that head while the report is applied; only a report that
    # changed something costs more (`gcworker.handoff.ReportHandoff`).
    handoff = ReportHandoff(plane.db, board(), key_reader())
    result = pipeline.receive(plane, args[0], task="report", hooks=handoff)
    if isinstance(result, ReportResult):
        if result.outcome is ReportOutcome.FULL_REPORT_NEEDED:
            board().want_full_report(result.worker)
        handoff.finish(result)


# A collection needs no redelivery: beat sends the next trigger one interval later.
@app.task(name=COLLECT_TASK, acks_late=False)
def run_collection(*args, **kwargs):
    plane = control_plane()
    if not pipeline.rejected_call(plane, "collect", args, kwargs, takes=0):
        pipeline.run_collection(plane, self_check=self_check())
