"""The stuck-creating collector (rule 10): a row left in `creating` past the creating-timeout
becomes `failed`, and a failed row goes to `destroying` so that its worker removes it."""

from __future__ import annotations

from gcworker.db.audit import AuditEntry
from gcworker.db.inventory import ContainerRepository, VolumeRepository
from gcworker.db.workers import WorkerRepository
from gcworker.gc.context import CollectionContext
from gcworker.settings import format_duration


class StuckCreatingCollector:
    name = "stuck-creating"

    def run(self, ctx: CollectionContext) -> None:
        timeout = ctx.settings.creating_timeout
        workers = WorkerRepository(ctx.db)
        for repo in (ContainerRepository(ctx.db), VolumeRepository(ctx.db)):
            with ctx.step() as step:
                failed = repo.fail_stuck_creating(step.conn, step.now - timeout, step.now)
                destroying = repo.destroy_failed(step.conn, step.now)
                workers.bump_generation(step.conn, {w for _, w in failed + destroying})
                ctx.record(
                    step,
                    (
                        AuditEntry(
                            "fail",
                            repo.kind,
                            handle,
                            f"stuck in creating for longer than {format_duration(timeout)}",
                            worker=worker,
                        )
                        for handle, worker in failed
                    ),
                )
                ctx.record(
                    step,
                    (
                        AuditEntry("destroy", repo.kind, handle, "failed", worker=worker)
                        for handle, worker in destroying
                    ),
                )
