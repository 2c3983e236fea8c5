"""The stuck-creating collector (rule 10): a row left in `creating` past the creating-timeout
becomes `failed`, and a failed row goes to `destroying` so that its worker removes it. It locks
the rows' workers before their rows, as reports and the scheduler do."""

from __future__ import annotations

from gcworker.db.audit import AuditEntry
from gcworker.db.inventory import ContainerRepository, VolumeRepository, lock_workers
from gcworker.gc.context import CollectionContext
from gcworker.settings import format_duration


class StuckCreatingCollector:
    name = "stuck-creating"

    def run(self, ctx: CollectionContext) -> None:
        timeout = ctx.settings.creating_timeout
        for repo in (ContainerRepository(ctx.db), VolumeRepository(ctx.db)):
            with ctx.step() as step:
                cutoff = step.now - timeout
                names = repo.stuck_workers(step.conn, cutoff)
                if not names:
                    continue
                lock_workers(step.conn, ctx.db, names, commit_without_waiting=False)
                failed = repo.fail_stuck_creating(step.conn, names, cutoff, step.now)
                destroying = repo.destroy_failed(step.conn, names, step.now)
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
