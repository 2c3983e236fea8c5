"""The missing-row collector (rule 4): deletes containers and volumes that stayed missing past
the grace period, on a running worker, confirmed by a report received at or after
`missing_since + grace` that still lacked them. Silence is never evidence.

It works worker by worker, in short batches, each holding that worker's row lock so that no
report of the worker can interleave with the deletion.
"""

from __future__ import annotations

from gcworker.db.audit import AuditEntry
from gcworker.db.inventory import ContainerRepository, VolumeRepository
from gcworker.db.workers import WorkerRepository
from gcworker.gc.context import CollectionContext
from gcworker.rules import deletion_cutoff


class MissingRowCollector:
    name = "missing"

    def run(self, ctx: CollectionContext) -> None:
        grace = ctx.settings.missing_grace_period
        batch_size = ctx.settings.delete_batch_size
        workers = WorkerRepository(ctx.db)
        for repo in (ContainerRepository(ctx.db), VolumeRepository(ctx.db)):
            with ctx.step() as step:
                candidates = repo.workers_with_rows_missing_since(step.conn, step.now - grace)
            for name in candidates:
                while True:
                    with ctx.step() as step:
                        worker = workers.lock(step.conn, name)
                        if worker is None or worker.state != "running":
                            break
                        cutoff = deletion_cutoff(step.now, worker.last_report_at, grace)
                        if cutoff is None:
                            break
                        deleted = repo.delete_missing(step.conn, name, cutoff, batch_size)
                        if deleted:
                            workers.bump_generation(step.conn, [name])
                        ctx.record(
                            step,
                            (
                                AuditEntry(
                                    "delete", repo.kind, handle, _reason(reason, grace), worker=name
                                )
                                for handle, reason in deleted
                            ),
                        )
                    if len(deleted) < batch_size:
                        break


def _reason(reason: str, grace) -> str:
    if reason == "missing":
        return f"missing for at least {grace}, confirmed by a later report"
    return reason
