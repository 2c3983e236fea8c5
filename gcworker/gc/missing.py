"""The missing-row collector (rule 4): deletes containers and volumes that stayed missing past
the grace period, on a running worker, confirmed by a report received at or after
`missing_since + grace` that still lacked them. Silence is never evidence.

It plans first (every candidate up to the per-collection cap; beyond it, the oldest marks
first across both kinds and all workers), then deletes in short batches of one kind (of one or
several workers), each holding its workers' row locks and checking the conditions again, so
that a report of those workers can never interleave with a deletion. Each batch is audited in
the same statement as it deletes (PostgreSQL): one audit row per worker and reason, holding
every deleted handle (rule 13). Nothing is deleted in disruption mode (rule 12).
"""

from __future__ import annotations

import logging
from collections import defaultdict

from gcworker.db.audit import AuditEntry, AuditRepository
from gcworker.db.inventory import (
    ContainerRepository,
    InventoryRepository,
    VolumeRepository,
    lock_deleting_workers,
    oldest_deletable,
)
from gcworker.db.workers import WorkerRepository
from gcworker.gc.context import CollectionContext, Step
from gcworker.rules import deletion_cutoff
from gcworker.settings import format_duration

log = logging.getLogger(__name__)

Batch = list[tuple[str, list[int]]]  # (worker, ids) of one kind


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
        for repo in repos:
            groups = [(worker, ids) for kind, worker, ids in plan if kind == repo.kind]
            for batch in batches(groups, ctx.settings.delete_batch_size):
                self._delete_batch(ctx, repo, batch)

    @staticmethod
    def _delete_batch(ctx: CollectionContext, repo: InventoryRepository, batch: Batch) -> None:
        """Delete one batch of one kind: the rows of each of its workers that still qualify."""
        grace = ctx.settings.missing_grace_period
        with ctx.transaction() as conn:
            found, now = lock_deleting_workers(
                conn,
                ctx.db,
                [worker for worker, _ in batch],
                commit_without_waiting=not ctx.dry_run,
            )
            cutoffs = {}
            for worker, _ in batch:
                state, last_report_at = found.get(worker, (None, None))
                cutoff = deletion_cutoff(now, last_report_at, grace)
                if state == "running" and cutoff is not None:
                    cutoffs[worker] = cutoff
            if not cutoffs:
                return
            if ctx.dry_run or not ctx.db.is_postgresql:
                entries = []
                for worker, ids in batch:
                    if worker not in cutoffs:
                        continue
                    by_reason = defaultdict(list)
                    for handle, reason in repo.delete_missing(conn, worker, ids, cutoffs[worker]):
                        by_reason[reason].append(handle)
                    entries += [
                        AuditEntry.batch(
                            "delete", repo.kind, handles, _reason(reason, grace), worker
                        )
                        for reason, handles in sorted(by_reason.items())
                    ]
                ctx.record(Step(conn, now), entries)
                changed = {entry.worker for entry in entries}
            else:
                # One statement deletes the batch and writes its audit rows (rule 13).
                ids = [id_ for worker, ids in batch if worker in cutoffs for id_ in ids]
                audited = AuditRepository().record_returned(
                    conn,
                    repo.delete_missing_statement(cutoffs, ids),
                    action="delete",
                    kind=repo.kind,
                    reasons={"missing": _reason("missing", grace)},
                    actor="collector",
                    now=now,
                )
                ctx.counts[("delete", repo.kind)] += sum(count for _, count in audited)
                changed = {worker for worker, _ in audited}
            WorkerRepository(ctx.db).bump_generation(conn, changed)


def batches(groups: Batch, size: int) -> list[Batch]:
    """Consecutive batches of at most `size` ids in all, a worker's ids split where needed."""
    out: list[Batch] = []
    current: Batch = []
    room = size
    for worker, ids in groups:
        while ids:
            taken, ids = ids[:room], ids[room:]
            current.append((worker, taken))
            room -= len(taken)
            if room == 0:
                out.append(current)
                current, room = [], size
    if current:
        out.append(current)
    return out


def _reason(reason: str, grace) -> str:
    if reason == "missing":
        return f"missing for at least {format_duration(grace)}, confirmed by a later report"
    return reason
