"""Every SQL statement on the audit log: what the collector (and the reconciler, when it drops an
ephemeral worker's rows) changed, and why (rule 13)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, select

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

    def list(self, conn: Connection, limit: int | None = None) -> list[dict]:
        query = select(audit_events).order_by(audit_events.c.at.desc(), audit_events.c.id.desc())
        if limit is not None:
            query = query.limit(limit)
        return [dict(r._mapping) for r in conn.execute(query)]
