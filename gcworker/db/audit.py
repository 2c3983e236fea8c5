"""Every SQL statement on the audit log: what the collector, the reconciler and operators
changed, and why (rule 13).

A row records one subject, or the handles of one batch: one row per (batch, kind, worker,
reason), its handles in `subjects` (the collector's deletions; a report's unknown handles and
confirmed destructions; the rows deleted with a worker). Readers see one entry per subject
either way (`expand`)."""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, bindparam, case, func, insert, literal, select

from gcworker.db.tables import audit_events


@dataclass(frozen=True)
class AuditEntry:
    action: str
    kind: str
    subject: str | None
    reason: str
    worker: str | None = None
    # The handles of a batch, recorded in one row (`subject` is then None).
    subjects: tuple[str, ...] | None = None

    @classmethod
    def batch(
        cls, action: str, kind: str, subjects: Iterable[str], reason: str, worker: str | None
    ) -> AuditEntry:
        return cls(action, kind, None, reason, worker, tuple(sorted(subjects)))

    @property
    def count(self) -> int:
        """How many subjects (changes) this entry records."""
        return 1 if self.subjects is None else len(self.subjects)


class AuditRepository:
    def record(
        self,
        conn: Connection,
        entries: Iterable[AuditEntry],
        *,
        actor: str,
        now: datetime,
        dry_run: bool = False,
    ) -> int:
        rows = [
            {
                "at": now,
                "actor": actor,
                "action": e.action,
                "kind": e.kind,
                "subject": e.subject,
                "subjects": e.subjects,
                "worker_name": e.worker,
                "reason": e.reason,
                "dry_run": dry_run,
            }
            for e in entries
        ]
        if rows:
            conn.execute(audit_events.insert(), rows)
        return len(rows)

    def record_returned(
        self,
        conn: Connection,
        changes,
        params: dict,
        *,
        action: str,
        kind: str,
        reasons: dict[str, str],
        actor: str,
        now: datetime,
        handles: bool = False,
    ) -> list[tuple[str, int]] | list[tuple[str, list[str]]]:
        """Run `changes` (an INSERT, DELETE or UPDATE ... RETURNING handle, worker_name, reason,
        with the parameters `params`) and audit what it returns in the same statement
        (PostgreSQL): one row per (worker, reason) holding every handle, and no row travels to
        Python and back. `reasons` rewrites the returned reasons. Returns (worker, number of rows
        changed) per audit row, or with `handles` (worker, the handles changed). The statement is
        built once per `changes` (a statement built once itself) and audit columns: a batch only
        binds its values. On SQLite the changed rows come back and are recorded as batch rows."""
        if conn.dialect.name != "postgresql":
            return self._record_changed(
                conn, changes, params, action, kind, reasons, actor, now, handles
            )
        statement = _returned_statement(
            changes, action, kind, tuple(reasons.items()), actor, handles
        )
        rows = conn.execute(statement, {**params, "p_audit_at": now})
        return [(worker, changed) for worker, changed in rows]

    def _record_changed(self, conn, changes, params, action, kind, reasons, actor, now, handles):
        """`record_returned` in two statements: the change, then its audit rows."""
        changed = defaultdict(list)
        for handle, worker, reason in conn.execute(changes, params):
            changed[worker, reasons.get(reason, reason)].append(handle)
        entries = [
            AuditEntry.batch(action, kind, subjects, reason, worker)
            for (worker, reason), subjects in sorted(changed.items())
        ]
        self.record(conn, entries, actor=actor, now=now)
        return [
            (entry.worker, list(entry.subjects) if handles else entry.count) for entry in entries
        ]

    def list(
        self,
        conn: Connection,
        limit: int | None = None,
        *,
        worker: str | None = None,
        since: datetime | None = None,
        actions: tuple[str, ...] = (),
    ) -> list[dict]:
        """The newest `limit` entries first, a batch row expanded into one entry per handle;
        only `worker`'s, at or after `since`, of `actions`, when given."""
        query = select(audit_events).order_by(audit_events.c.at.desc(), audit_events.c.id.desc())
        if worker is not None:
            query = query.where(audit_events.c.worker_name == worker)
        if since is not None:
            query = query.where(audit_events.c.at >= since)
        if actions:
            query = query.where(audit_events.c.action.in_(actions))
        if limit is not None:
            query = query.limit(limit)  # every row holds one entry at least
        return expand(conn.execute(query))[:limit]


def expand(rows: Iterable) -> list[dict]:
    """Audit rows (mappings or result rows) as entries of one subject each, in the rows' order
    and, within a batch row, in the handles' order: every column but `subjects`."""
    entries = []
    for row in rows:
        entry = dict(getattr(row, "_mapping", row))
        subjects = entry.pop("subjects", None)
        if subjects is None:
            entries.append(entry)
        else:
            entries.extend({**entry, "subject": subject} for subject in sorted(subjects))
    return entries


@functools.lru_cache(maxsize=64)
def _returned_statement(
    changes, action: str, kind: str, reasons: tuple, actor: str, returning_handles: bool
):
    """The statement of `AuditRepository.record_returned`, its time left to `p_audit_at`."""
    changed = changes.cte("changed")
    reason = (
        case(dict(reasons), value=changed.c.reason, else_=changed.c.reason)
        if reasons
        else changed.c.reason
    )
    handles = func.array_agg(changed.c.handle, type_=audit_events.c.subjects.type)
    rows = (
        select(
            bindparam("p_audit_at", type_=audit_events.c.at.type),
            literal(actor),
            literal(action),
            literal(kind),
            handles,
            changed.c.worker_name,
            reason,
            literal(False),
        )
        .select_from(changed)
        .group_by(changed.c.worker_name, changed.c.reason)
    )
    columns = ["at", "actor", "action", "kind", "subjects", "worker_name", "reason", "dry_run"]
    return (
        insert(audit_events)
        .from_select(columns, rows)
        .add_cte(changed)
        .returning(
            audit_events.c.worker_name,
            audit_events.c.subjects
            if returning_handles
            else func.cardinality(audit_events.c.subjects),
        )
    )
