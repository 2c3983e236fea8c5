"""The missing-row collector (rule 4): deletes containers and volumes that stayed missing past
the grace period, on a running worker, confirmed by a report received at or after
`missing_since + grace` that still lacked them. Silence is never evidence.

It plans first, then deletes in short batches of one kind (of one or several workers), each
holding its workers' row locks and checking the conditions again, so that a report of those
workers can never interleave with a deletion. Within the per-collection cap (the usual case)
the plan is a count per (kind, worker) with the cutoff it was counted with, and a batch deletes
whole workers' candidates by (worker, cutoff), in the shape of the unbatched DELETE (a worker
with more candidates than a batch holds is split: the oldest marks first); beyond the cap, the
oldest marks across both kinds and all workers, by id. Each batch is audited in the same
statement as it deletes (PostgreSQL): one audit row per worker and reason, holding every
deleted handle (rule 13). Nothing is deleted in disruption mode (rule 12).
"""

from __future__ import annotations

import logging
from collections import defaultdict

from gcworker.db.audit import AuditEntry, AuditRepository
from gcworker.db.inventory import (
    Candidates,
    ContainerRepository,
    Deletion,
    InventoryRepository,
    VolumeRepository,
    deletion_plan,
    lock_workers,
)
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
            plan, more = deletion_plan(step.conn, repos, step.now, grace, cap)
        if more:
            log.warning(
                "deletion cap reached: the rest wait for the next collection",
                extra={"cap": cap},
            )
        for repo in repos:
            mine = [c for c in plan if c.kind == repo.kind]
            for batch in deletion_batches(mine, ctx.settings.delete_batch_size):
                self._delete_batch(ctx, repo, batch)

    @staticmethod
    def _delete_batch(
        ctx: CollectionContext, repo: InventoryRepository, batch: list[Deletion]
    ) -> None:
        """Delete one batch of one kind: the rows of each of its workers that still qualify,
        under the workers' row locks, by the cutoff read under them (never later than the
        plan's). The statement that locks the workers also bumps their generation (any of
        their rows may go)."""
        grace = ctx.settings.missing_grace_period
        with ctx.transaction() as conn:
            found, now = lock_workers(
                conn,
                ctx.db,
                [deletion.worker for deletion in batch],
                commit_without_waiting=not ctx.dry_run,
            )
            cutoffs = {}
            for deletion in batch:
                state, last_report_at = found.get(deletion.worker, (None, None))
                cutoff = deletion_cutoff(now, last_report_at, grace)
                if state == "running" and cutoff is not None:
                    if deletion.cutoff is not None:
                        cutoff = min(cutoff, deletion.cutoff)
                    cutoffs[deletion.worker] = cutoff
            batch = [deletion for deletion in batch if deletion.worker in cutoffs]
            if not batch:
                return
            if ctx.dry_run or not ctx.db.is_postgresql:
                entries = []
                for deletion in batch:
                    by_reason = defaultdict(list)
                    deleted = repo.delete_missing(conn, deletion, cutoffs[deletion.worker])
                    for handle, reason in deleted:
                        by_reason[reason].append(handle)
                    entries += [
                        AuditEntry.batch(
                            "delete", repo.kind, handles, _reason(reason, grace), deletion.worker
                        )
                        for reason, handles in sorted(by_reason.items())
                    ]
                ctx.record(Step(conn, now), entries)
            else:
                # One statement deletes the batch and writes its audit rows (rule 13).
                changes, params = repo.delete_missing_statement(batch, cutoffs)
                audited = AuditRepository().record_returned(
                    conn,
                    changes,
                    params,
                    action="delete",
                    kind=repo.kind,
                    reasons={"missing": _reason("missing", grace)},
                    actor="collector",
                    now=now,
                )
                ctx.counts[("delete", repo.kind)] += sum(count for _, count in audited)


def deletion_batches(plan: list[Candidates], size: int) -> list[list[Deletion]]:
    """The batches of one kind's plan, in worker name order, each of at most `size` rows."""
    if any(c.ids is not None for c in plan):
        return [
            [Deletion(worker, ids=tuple(ids)) for worker, ids in batch]
            for batch in batches([(c.worker, list(c.ids or ())) for c in plan], size)
        ]
    cutoffs = {c.worker: c.cutoff for c in plan}
    return [
        [Deletion(worker, cutoffs[worker], limit=limit) for worker, limit in batch]
        for batch in worker_batches([(c.worker, c.count) for c in plan], size)
    ]


def worker_batches(counts: list[tuple[str, int]], size: int) -> list[list[tuple[str, int | None]]]:
    """Batches of whole workers' candidates, `(worker, None)`, packed in order while their
    counts fit within `size`; a worker with more than `size` candidates is split into batches
    of its own, `(worker, size)`: each deletes its oldest `size` marks still there."""
    out: list[list[tuple[str, int | None]]] = []
    current: list[tuple[str, int | None]] = []
    room = size
    for worker, count in counts:
        if count > size:
            if current:
                out.append(current)
                current, room = [], size
            out += [[(worker, size)] for _ in range(-(-count // size))]
            continue
        if count > room:
            out.append(current)
            current, room = [], size
        current.append((worker, None))
        room -= count
    if current:
        out.append(current)
    return out


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
