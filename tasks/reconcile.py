"""The reconciler's tasks: record a heartbeat, reconcile a report, run a collection.

Each task gets one JSON envelope (`gcworker.codec`: the message as JSON text, and its
signature), has it decoded, validated and checked by the control plane, and applies it through
the same code embedded mode runs (`gcworker.pipeline`). A rejected message is logged, counted and
kept in the dead-letter list, and the task returns normally, so the broker's message is
acknowledged. After a report, the task hands the worker's destroying handles to its reporter
through Redis (`gcworker.handoff`).

A database that cannot be reached (OperationalError) makes the task retry with backoff; the
redelivered message is harmless (rule 6).
"""

from __future__ import annotations

from sqlalchemy.exc import OperationalError

from gcworker import pipeline
from gcworker.reconcile import ReportResult
from gcworker.rules import ReportOutcome
from tasks.app import app, settings
from tasks.routing import COLLECT_TASK, HEARTBEAT_TASK, REPORT_TASK

RETRY = {
    "autoretry_for": (OperationalError,),
    "retry_backoff": True,
    "retry_backoff_max": 60,
    "retry_jitter": True,
    "max_retries": 12,
}

_plane = None
_board = None


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


# Any other arguments than one envelope make a malformed envelope: rejected and dead-lettered.
@app.task(name=HEARTBEAT_TASK, **RETRY)
def record_heartbeat(envelope=None, *_args, **_kwargs):
    pipeline.receive(control_plane(), envelope, task="heartbeat")


@app.task(name=REPORT_TASK, **RETRY)
def reconcile_report(envelope=None, *_args, **_kwargs):
    plane = control_plane()
    result = pipeline.receive(plane, envelope, task="report")
    if isinstance(result, ReportResult):
        from gcworker.handoff import publish_snapshot

        if result.outcome is ReportOutcome.FULL_REPORT_NEEDED:
            board().want_full_report(result.worker)
        publish_snapshot(plane.db, board(), result.worker)


# A collection needs no redelivery: beat sends the next trigger one interval later.
@app.task(name=COLLECT_TASK, acks_late=False)
def run_collection():
    pipeline.run_collection(control_plane())
