"""Every SQL statement on the audit log: what the collector (and the reconciler, when it drops an
ephemeral worker's rows) changed, and why (rule 13)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, case, insert, literal, select

from gcworker.db.tables import audit_events


@dataclass(frozen=True)
class AuditEntry:
    action: str
    kind: str
    subject: str
    reason: str
    worker: str | None = None


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
        *,
        action: str,
        kind: str,
        worker: str | None,
        reasons: dict[str, str],
        actor: str,
        now: datetime,
    ) -> int:
        """Run `changes` (a DELETE or UPDATE ... RETURNING handle, reason) and audit every row it
        returns in the same statement (PostgreSQL): no row travels to Python and back.
        `reasons` rewrites the returned reasons; returns the number of rows changed."""
        changed = changes.cte("changed")
        reason = (
            case(reasons, value=changed.c.reason, else_=changed.c.reason)
            if reasons
            else changed.c.reason
        )
        rows = select(
            literal(now, audit_events.c.at.type),
            literal(actor),
            literal(action),
            literal(kind),
            changed.c.handle,
            literal(worker),
            reason,
            literal(False),
        ).select_from(changed)
        columns = ["at", "actor", "action", "kind", "subject", "worker_name", "reason", "dry_run"]
        statement = insert(audit_events).from_select(columns, rows).add_cte(changed)
        return conn.execute(statement).rowcount

    def list(self, conn: Connection, limit: int | None = None) -> list[dict]:
        query = select(audit_events).order_by(audit_events.c.at.desc(), audit_events.c.id.desc())
        if limit is not None:
            query = query.limit(limit)
        return [dict(r._mapping) for r in conn.execute(query)]
