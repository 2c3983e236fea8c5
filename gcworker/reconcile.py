"""Applying one heartbeat or one report to the database, in one transaction each.

This is the code a reconciler task runs, and the code the CLI runs in-process in embedded mode.
The worker's row is locked first, so that events for one worker apply one at a time whatever
the number of reconciler processes; the rules decide (`gcworker.rules`), the repositories write.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import Connection
from sqlalchemy.exc import IntegrityError

from gcworker.db.audit import AuditEntry, AuditRepository
from gcworker.db.database import Database
from gcworker.db.inventory import (
    ContainerRepository,
    InventoryRepository,
    VolumeRepository,
    handles_by_kind,
)
from gcworker.db.workers import WorkerRepository
from gcworker.messages import Heartbeat, Report, UnchangedReport
from gcworker.rows_cache import WorkerRowsCache
from gcworker.rules import (
    HeartbeatOutcome,
    ReportOutcome,
    WorkerRows,
    WorkerView,
    confirmation_time,
    diff_handles,
    judge_heartbeat,
    judge_report,
    report_built_at,
    report_date_problem,
    report_digest,
    report_is_unchanged,
    report_may_mark,
    rows_after_report,
)

log = logging.getLogger(__name__)

# The audit's reasons for the reconciler's changes (rules 8 and 9).
REASONS = {
    "unknown": "unknown handle reported: recorded as destroying, for the worker to remove it",
    "destroyed": "destroyed: the worker no longer reports it",
}


@dataclass
class HeartbeatResult:
    worker: str
    outcome: HeartbeatOutcome
    seq: int = 0
    reason: str = ""
    rows_dropped: int = 0
    marks_cleared: int = 0


@dataclass
class ReportResult:
    worker: str
    outcome: ReportOutcome
    reason: str = ""
    fast_path: bool = False
    marked: dict[str, int] = field(default_factory=dict)
    cleared: dict[str, int] = field(default_factory=dict)
    unknown: dict[str, int] = field(default_factory=dict)
    destroyed: dict[str, int] = field(default_factory=dict)
    lag: timedelta | None = None

    @property
    def rows_written(self) -> int:
        return sum(
            sum(counts.values())
            for counts in (self.marked, self.cleared, self.unknown, self.destroyed)
        )


class Reconciler:
    def __init__(self, db: Database, heartbeat_ttl: timedelta):
        self.db = db
        self.heartbeat_ttl = heartbeat_ttl
        self.workers = WorkerRepository(db)
        self.inventories: tuple[InventoryRepository, ...] = (
            ContainerRepository(db),
            VolumeRepository(db),
        )
        self.audit = AuditRepository()
        self.rows_cache = WorkerRowsCache()

    def heartbeat(self, message: Heartbeat) -> HeartbeatResult:
        try:
            return self._heartbeat(message)
        except IntegrityError:
            # Two first heartbeats of one worker raced to register it; the loser now finds it.
            return self._heartbeat(message)

    def _heartbeat(self, message: Heartbeat) -> HeartbeatResult:
        ttl = timedelta(seconds=message.ttl_seconds) if message.ttl_seconds else self.heartbeat_ttl
        with self.db.transaction() as conn:
            now = self.db.now(conn)
            worker = self.workers.lock(conn, message.worker)
            tombstone = self.workers.tombstone(conn, message.worker) if worker is None else None
            decision = judge_heartbeat(worker, message.incarnation, message.seq, tombstone)
            result = HeartbeatResult(
                message.worker, decision.outcome, message.seq, decision.reason
            )
            if decision.outcome is HeartbeatOutcome.REGISTERED:
                self.workers.register(
                    conn,
                    name=message.worker,
                    ephemeral=message.ephemeral,
                    incarnation=message.incarnation,
                    seq=message.seq,
                    now=now,
                    ttl=ttl,
                    worker_clock=message.clock,
                )
            elif decision.outcome not in (HeartbeatOutcome.STALE, HeartbeatOutcome.REJECTED):
                if decision.drops_rows:
                    result.rows_dropped = self._drop_old_incarnation(
                        conn, message, worker.incarnation, now
                    )
                if decision.clears_marks:
                    result.marks_cleared = sum(
                        repo.clear_all_marks(conn, message.worker) for repo in self.inventories
                    )
                new_incarnation = decision.outcome is HeartbeatOutcome.NEW_INCARNATION
                self.workers.record_heartbeat(
                    conn,
                    message.worker,
                    seq=message.seq,
                    now=now,
                    ttl=ttl,
                    worker_clock=message.clock,
                    ephemeral=message.ephemeral,
                    incarnation=message.incarnation if new_incarnation else None,
                    new_state=decision.new_state,
                    starts_running_period=decision.starts_running_period,
                )
        log.info(
            "heartbeat applied",
            extra={
                "worker": message.worker,
                "outcome": str(result.outcome),
                "reason": result.reason,
                "rows_dropped": result.rows_dropped,
                "marks_cleared": result.marks_cleared,
            },
        )
        return result

    def _drop_old_incarnation(
        self, conn: Connection, message: Heartbeat, old_incarnation: int, now: datetime
    ) -> int:
        """Rule 7: an ephemeral worker's old incarnation took its containers and volumes with it."""
        reason = (
            f"ephemeral worker restarted (incarnation {old_incarnation} -> {message.incarnation})"
        )
        entries = [
            AuditEntry.batch(
                "delete",
                repo.kind,
                handles,
                f"{reason}: a row of the old incarnation",
                message.worker,
            )
            for repo in self.inventories
            if (handles := [h for h, _ in repo.delete_all_of_workers(conn, [message.worker])])
        ]
        counts = {entry.kind: entry.count for entry in entries}
        entries.append(
            AuditEntry(
                "drop_rows",
                "worker",
                message.worker,
                f"{reason}: {counts.get('container', 0)} containers and "
                f"{counts.get('volume', 0)} volumes of the old incarnation deleted",
                worker=message.worker,
            )
        )
        self.audit.record(conn, entries, actor="reconciler", now=now)
        return sum(counts.values())

    def _judge(self, conn: Connection, message: Report | UnchangedReport):
        """Lock the worker and judge the report (rules 2, 6, 7): (now, worker, result)."""
        worker, now = self.workers.lock_with_clock(
            conn, message.worker, commit_without_waiting=True
        )
        tombstone = self.workers.tombstone(conn, message.worker) if worker is None else None
        outcome, reason = judge_report(worker, message.incarnation, message.seq, tombstone)
        problem = report_date_problem(now, message.after)
        if outcome is ReportOutcome.ACCEPTED and problem is not None:
            outcome, reason = ReportOutcome.REJECTED, problem
        result = ReportResult(message.worker, outcome, reason)
        if message.clock is not None:
            result.lag = now - message.clock
        return now, worker, result

    def _confirmed_unchanged(
        self, message: Report | UnchangedReport, digest: str
    ) -> ReportResult | None:
        """The fast path as one statement that is its own transaction (PostgreSQL): no lock
        taken first, no row read. None when it does not apply (nothing was written then): the
        caller judges the report in a transaction."""
        if not self.db.is_postgresql:
            return None
        now = self.workers.confirm_unchanged_report(
            message.worker,
            incarnation=message.incarnation,
            seq=message.seq,
            digest=digest,
            worker_clock=message.clock,
            after=message.after,
        )
        if now is None:
            return None
        result = ReportResult(message.worker, ReportOutcome.ACCEPTED, fast_path=True)
        if message.clock is not None:
            result.lag = now - message.clock
        return result

    def unchanged(self, message: UnchangedReport) -> ReportResult:
        """A compact report: confirms the last full report when nothing changed on either side;
        otherwise changes nothing and asks for a full report."""
        confirmed = self._confirmed_unchanged(message, message.digest)
        if confirmed is not None:
            return self._logged(confirmed)
        with self.db.transaction() as conn:
            now, worker, result = self._judge(conn, message)
            if result.outcome is not ReportOutcome.ACCEPTED:
                return self._logged(result)
            if not report_may_mark(worker, message.seq):
                result.outcome = ReportOutcome.FULL_REPORT_NEEDED
                result.reason = (
                    f"worker is {worker.state} or the report predates its running period"
                )
            elif not report_is_unchanged(worker, message.digest):
                result.outcome = ReportOutcome.FULL_REPORT_NEEDED
                result.reason = "digest unknown, or the worker's rows changed since that report"
            else:
                result.fast_path = True
                self.workers.record_report(
                    conn,
                    message.worker,
                    seq=message.seq,
                    worker_clock=message.clock,
                    confirmed_at=confirmation_time(
                        report_built_at(now, message.after), worker.last_report_at
                    ),
                    digest=None,
                )
        return self._logged(result)

    def report(self, message: Report) -> ReportResult:
        digest = report_digest(message.containers, message.volumes)
        confirmed = self._confirmed_unchanged(message, digest)
        if confirmed is not None:
            return self._logged(confirmed)
        reported = {"container": message.containers, "volume": message.volumes}
        rows_after: dict[str, WorkerRows] | None = None
        with self.db.transaction() as conn:
            now, worker, result = self._judge(conn, message)
            if result.outcome is not ReportOutcome.ACCEPTED:
                return self._logged(result)
            may_mark = report_may_mark(worker, message.seq)
            built_at = report_built_at(now, message.after)
            # A destruction this report is too old to confirm must be looked at again: the next
            # report with the same handles may not take the fast path.
            deferred = False
            if may_mark and report_is_unchanged(worker, digest):
                result.fast_path = True
            else:
                deferred, rows_after = self._diff(
                    conn, worker, reported, may_mark, now, built_at, result
                )
            if not may_mark:
                result.outcome = ReportOutcome.WORKER_NOT_RUNNING
                result.reason = (
                    f"worker is {worker.state}"
                    if worker.state != "running"
                    else "report was sent before the current running period began"
                )
            rows_changed = bool(result.rows_written) or deferred
            self.workers.record_report(
                conn,
                message.worker,
                seq=message.seq,
                worker_clock=message.clock,
                confirmed_at=(
                    confirmation_time(built_at, worker.last_report_at) if may_mark else None
                ),
                digest=digest if may_mark and not result.fast_path and not deferred else None,
                rows_changed=rows_changed,
            )
        # Committed: the rows are now `rows_after`, at the generation record_report left.
        if rows_after is not None:
            self.rows_cache.put(message.worker, worker.generation + int(rows_changed), rows_after)
        elif not result.fast_path:
            self.rows_cache.forget(message.worker)
        return self._logged(result)

    def _diff(
        self, conn: Connection, worker: WorkerView, reported, may_mark: bool, now, built_at, result
    ) -> tuple[bool, dict[str, WorkerRows] | None]:
        """Rules 1, 3, 8 and 9 for a report that did not take the fast path. Returns whether a
        destruction was too recent for this report to confirm (see `report`), and the worker's
        rows once this transaction commits, where every statement changed what the diff said
        (None otherwise)."""
        name = worker.name
        deferred = False
        listed = [repo for repo in self.inventories if reported[repo.kind]]
        rows = self.rows_cache.get(name, worker.generation)
        if rows is None:
            rows = handles_by_kind(conn, name, listed) if listed else {}
        after: dict[str, WorkerRows] | None = {}
        for repo in self.inventories:
            kind = repo.kind
            if reported[kind]:
                diff = diff_handles(rows[kind], reported[kind], may_mark=may_mark)
                result.marked[kind] = repo.mark_missing(conn, name, diff.to_mark, now)
                result.cleared[kind] = repo.clear_missing(conn, name, diff.to_clear)
                result.unknown[kind] = self._recorded_unknown(conn, repo, name, diff.unknown, now)
                gone = diff.confirmed_destroyed
            else:
                # No handle of this kind listed (a worker that lost everything): every created
                # row is missing, with no need to read them first; every destroying row is gone.
                gone = repo.handles_in_state(conn, name, "destroying")
                result.marked[kind] = repo.mark_all_missing(conn, name, now) if may_mark else 0
                result.cleared[kind] = result.unknown[kind] = 0
                diff = None
            destroyed = self._confirmed_destroyed(conn, repo, name, gone, built_at, now)
            result.destroyed[kind] = len(destroyed)
            deferred |= len(destroyed) < len(gone)
            as_planned = diff is not None and (
                result.marked[kind],
                result.cleared[kind],
                result.unknown[kind],
            ) == (len(diff.to_mark), len(diff.to_clear), len(diff.unknown))
            if after is not None and as_planned:
                after[kind] = rows_after_report(rows[kind], diff, destroyed)
            else:
                after = None
        return deferred, after

    def _recorded_unknown(self, conn, repo: InventoryRepository, name: str, handles, now) -> int:
        """Rule 8, audited by the same statement (rule 13): how many handles were recorded."""
        statement = repo.unknown_statement(name, handles, now) if handles else None
        audited = self._audited(conn, repo, statement, "record_unknown", "unknown", now)
        return sum(count for _, count in audited)

    def _confirmed_destroyed(
        self, conn, repo: InventoryRepository, name: str, handles, built_at, now
    ) -> list[str]:
        """Rule 9, audited by the same statement (rule 13): the handles whose rows went. An
        undated report (`built_at` None) confirms nothing."""
        statement = None
        if handles and built_at is not None:
            statement = repo.confirmed_destroyed_statement(name, handles, built_at)
        audited = self._audited(conn, repo, statement, "delete", "destroyed", now, handles=True)
        return sorted(handle for _, deleted in audited for handle in deleted)

    def _audited(self, conn, repo, statement, action: str, reason: str, now, **options) -> list:
        """Run a change of the reconciler's with its audit row (none when there is nothing)."""
        if statement is None:
            return []
        return self.audit.record_returned(
            conn,
            *statement,
            action=action,
            kind=repo.kind,
            reasons={reason: REASONS[reason]},
            actor="reconciler",
            now=now,
            **options,
        )

    @staticmethod
    def _logged(result: ReportResult) -> ReportResult:
        log.info(
            "report applied" if result.outcome is ReportOutcome.ACCEPTED else "report ignored",
            extra={
                "worker": result.worker,
                "outcome": str(result.outcome),
                "reason": result.reason,
                "fast_path": result.fast_path,
                "marked": result.marked,
                "cleared": result.cleared,
                "unknown": result.unknown,
                "destroyed": result.destroyed,
            },
        )
        return result
