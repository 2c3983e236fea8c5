"""The missing-row collector (rule 4): deletes containers and volumes that stayed missing past
the grace period, on a running worker, confirmed by a report received at or after
`missing_since + grace` that still lacked them. Silence is never evidence.

It plans first (the oldest marks first, across both kinds and all workers, up to the per-
collection cap), then deletes in short batches, each holding the worker's row lock and checking
the conditions again, so that a report of that worker can never interleave with a deletion.
Nothing is deleted in disruption mode (rule 12).
"""

from __future__ import annotations

import logging

from gcworker.db.audit import AuditEntry, AuditRepository
from gcworker.db.inventory import (
    ContainerRepository,
    InventoryRepository,
    VolumeRepository,
    oldest_deletable,
)
from gcworker.db.workers import WorkerRepository
from gcworker.gc.context import CollectionContext
from gcworker.rules import deletion_cutoff
from gcworker.settings import format_duration

log = logging.getLogger(__name__)


class MissingRowCollector:
    name = "missing"

    def run(self, ctx: CollectionContext) -> None:
        if ctx.disrupted:
            return
        grace = ctx.settings.missing_grace_period
        cap = ctx.settings.max_deletes_per_collection
        repos = (ContainerRepository(ctx.db), VolumeRepository(ctx.db))
        with ctx.step() as step:
            plan, more = oldest_deletable(step.conn, repos, step.now, grace, cap)
        if more:
            log.warning(
                "deletion cap reached: the rest wait for the next collection",
                extra={"cap": cap},
            )
        by_kind = {repo.kind: repo for repo in repos}
        for kind, worker, ids in plan:
            for start in range(0, len(ids), ctx.settings.delete_batch_size):
                chunk = ids[start : start + ctx.settings.delete_batch_size]
                if not self._delete_batch(ctx, by_kind[kind], worker, chunk):
                    break

    @staticmethod
    def _delete_batch(
        ctx: CollectionContext, repo: InventoryRepository, worker: str, ids: list[int]
    ) -> bool:
        """Delete one batch of one worker's rows; False when the worker no longer qualifies."""
        workers = WorkerRepository(ctx.db)
        grace = ctx.settings.missing_grace_period
        with ctx.step() as step:
            # A batch lost in a server crash is a deletion not made yet: the next collection
            # makes it. Not waiting for the disk at each of many short commits keeps the whole
            # collection close to one unbatched DELETE.
            current, _ = workers.lock_with_clock(
                step.conn, worker, commit_without_waiting=not ctx.dry_run
            )
            if current is None or current.state != "running":
                return False
            cutoff = deletion_cutoff(step.now, current.last_report_at, grace)
            if cutoff is None:
                return False
            if ctx.dry_run or not ctx.db.is_postgresql:
                deleted = repo.delete_missing(step.conn, worker, ids, cutoff)
                ctx.record(
                    step,
                    [
                        AuditEntry(
                            "delete", repo.kind, handle, _reason(reason, grace), worker=worker
                        )
                        for handle, reason in deleted
                    ],
                )
                count = len(deleted)
            else:
                # One statement deletes the batch and writes its audit rows (rule 13).
                count = AuditRepository().record_returned(
                    step.conn,
                    repo.delete_missing_statement(worker, ids, cutoff),
                    action="delete",
                    kind=repo.kind,
                    worker=worker,
                    reasons={"missing": _reason("missing", grace)},
                    actor="collector",
                    now=step.now,
                )
                ctx.counts[("delete", repo.kind)] += count
            if count:
                workers.bump_generation(step.conn, [worker])
        return True


def _reason(reason: str, grace) -> str:
    if reason == "missing":
        return f"missing for at least {format_duration(grace)}, confirmed by a later report"
    return reason
