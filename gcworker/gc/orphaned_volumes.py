"""The orphaned-volume collector: a volume made for a container whose row is gone goes to
`destroying` (unless it still has child volumes)."""

from __future__ import annotations

from gcworker.db.audit import AuditEntry
from gcworker.db.inventory import VolumeRepository
from gcworker.db.workers import WorkerRepository
from gcworker.gc.context import CollectionContext


class OrphanedVolumeCollector:
    name = "orphaned-volumes"

    def run(self, ctx: CollectionContext) -> None:
        with ctx.step() as step:
            orphaned = VolumeRepository(ctx.db).destroy_orphaned(step.conn, step.now)
            WorkerRepository(ctx.db).bump_generation(step.conn, {w for _, w in orphaned})
            ctx.record(
                step,
                (
                    AuditEntry(
                        "destroy",
                        "volume",
                        handle,
                        "orphaned: its container's row is gone",
                        worker=worker,
                    )
                    for handle, worker in orphaned
                ),
            )
