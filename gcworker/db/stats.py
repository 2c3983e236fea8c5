"""Every SQL statement behind the state gauges of `/metrics`: workers by state, missing rows
and the backlog (rows waiting in creating, failed or destroying) by kind. A handful of grouped
counts, read after each collection."""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import func, select

from gcworker.db.database import Database
from gcworker.db.tables import INVENTORY_TABLES, workers


@dataclass
class StateCounts:
    workers: dict[str, int] = field(default_factory=dict)  # state -> workers
    missing: dict[str, int] = field(default_factory=dict)  # kind -> rows marked missing
    # (kind, state) -> rows in every state but created: creating, failed, destroying
    backlog: dict[tuple[str, str], int] = field(default_factory=dict)
    # (kind, state) -> seconds the oldest row has been in that state, by the control plane's clock
    oldest: dict[tuple[str, str], float] = field(default_factory=dict)


def state_counts(db: Database) -> StateCounts:
    counts = StateCounts()
    with db.transaction() as conn:
        now = db.now(conn)
        counts.workers = dict(
            conn.execute(select(workers.c.state, func.count()).group_by(workers.c.state)).all()
        )
        for kind, table in INVENTORY_TABLES.items():
            counts.missing[kind] = conn.execute(
                select(func.count()).select_from(table).where(table.c.missing_since.is_not(None))
            ).scalar_one()
            rows = conn.execute(
                select(table.c.state, func.count(), func.min(table.c.state_changed_at))
                .where(table.c.state != "created")
                .group_by(table.c.state)
            ).all()
            for state, n, since in rows:
                counts.backlog[kind, state] = n
                counts.oldest[kind, state] = max(0.0, (now - since).total_seconds())
    return counts
