"""The orphaned-volume collector: a volume made for a container whose row is gone goes to
`destroying` (unless it still has child volumes). It locks the volumes' workers before the
volumes, as reports and the scheduler do."""

from __future__ import annotations

from gcworker.db.audit import AuditEntry
from gcworker.db.inventory import VolumeRepository, lock_workers
from gcworker.gc.context import CollectionContext


class OrphanedVolumeCollector:
    name = "orphaned-volumes"

    def run(self, ctx: CollectionContext) -> None:
        repo = VolumeRepository(ctx.db)
        with ctx.step() as step:
            names = repo.orphaned_workers(step.conn)
            if not names:
                return
            lock_workers(step.conn, ctx.db, names, commit_without_waiting=False)
            orphaned = repo.destroy_orphaned(step.conn, names, step.now)
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
