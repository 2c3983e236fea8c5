"""One collection: the collectors in their fixed order, inside the fence (rule 11)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gcworker.db.audit import AuditRepository
from gcworker.db.database import Database
from gcworker.db.fence import collection_fence
from gcworker.gc.brake import SafetyBrake
from gcworker.gc.context import CollectionContext
from gcworker.gc.missing import MissingRowCollector
from gcworker.gc.orphaned_volumes import OrphanedVolumeCollector
from gcworker.gc.stuck_creating import StuckCreatingCollector
from gcworker.gc.workers import WorkerCollector
from gcworker.settings import Settings

log = logging.getLogger(__name__)

COLLECTORS = (
    SafetyBrake(),
    WorkerCollector(),
    StuckCreatingCollector(),
    OrphanedVolumeCollector(),
    MissingRowCollector(),
)


@dataclass
class CollectionSummary:
    outcome: str  # "completed" or "skipped"
    dry_run: bool = False
    counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    # Wall-clock instants (time.time()) at which the fence was taken and about to be released.
    fenced_from: float | None = None
    fenced_until: float | None = None
    # Disruption mode (rule 12) during this collection, and why.
    disrupted: bool = False
    disruption_reason: str | None = None

    def line(self) -> str:
        if self.outcome == "skipped":
            return "collection skipped: another collection holds the lock"
        changes = (
            ", ".join(f"{n} {what}" for what, n in sorted(self.counts.items())) or "no changes"
        )
        prefix = "dry run (nothing changed), would have made" if self.dry_run else "collection"
        return f"{prefix}: {changes} in {self.seconds:.2f}s"


def collect(
    db: Database,
    settings: Settings,
    *,
    dry_run: bool = False,
    self_check: Callable[[], str | None] | None = None,
) -> CollectionSummary:
    """Run one collection; `dry_run` (or the setting) logs and audits, and changes nothing."""
    dry_run = dry_run or settings.dry_run
    started = time.perf_counter()
    with db.engine.connect() as conn, collection_fence(conn, settings.gc_interval) as held:
        if not held:
            log.warning("collection skipped: another collection holds the lock")
            return CollectionSummary("skipped", dry_run)
        fenced_from = time.time()
        ctx = CollectionContext(db, settings, conn, dry_run=dry_run, self_check=self_check)
        if dry_run:
            with conn.begin() as outer:
                _run_collectors(ctx)
                outer.rollback()
            with conn.begin():
                AuditRepository().record(
                    conn, ctx.pending_audit, actor="collector", now=db.now(conn), dry_run=True
                )
        else:
            _run_collectors(ctx)
        fenced_until = time.time()
    summary = CollectionSummary(
        "completed",
        dry_run,
        counts={_describe(action, kind): n for (action, kind), n in ctx.counts.items()},
        seconds=time.perf_counter() - started,
        fenced_from=fenced_from,
        fenced_until=fenced_until,
        disrupted=ctx.disrupted,
        disruption_reason=ctx.disruption_reason,
    )
    log.info(summary.line())
    return summary


def _run_collectors(ctx: CollectionContext) -> None:
    for collector in COLLECTORS:
        collector.run(ctx)


def _describe(action: str, kind: str) -> str:
    if kind == "control_plane":
        return {
            "enter_disruption": "disruption mode entered",
            "leave_disruption": "disruption mode left",
        }[action]
    past = {
        "stall": "stalled",
        "delete": "deleted",
        "land": "landed",
        "fail": "failed",
        "destroy": "moved to destroying",
    }[action]
    return f"{kind}s {past}"
