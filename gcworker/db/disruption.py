"""Every SQL statement on the control-plane state: the collector's disruption mode (rule 12)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, select, update
from sqlalchemy.dialects import postgresql, sqlite

from gcworker.db.database import Database
from gcworker.db.tables import control_plane_state


@dataclass(frozen=True)
class Disruption:
    since: datetime
    reason: str


class DisruptionRepository:
    def __init__(self, db: Database):
        self.db = db

    def current(self, conn: Connection, *, lock: bool = False) -> Disruption | None:
        query = select(
            control_plane_state.c.disruption_since, control_plane_state.c.disruption_reason
        ).where(control_plane_state.c.id == 1)
        row = conn.execute(query.with_for_update() if lock else query).one_or_none()
        if row is None or row.disruption_since is None:
            return None
        return Disruption(row.disruption_since, row.disruption_reason)

    def enter(self, conn: Connection, now: datetime, reason: str) -> None:
        insert = postgresql.insert if self.db.is_postgresql else sqlite.insert
        conn.execute(
            insert(control_plane_state)
            .values(id=1, disruption_since=now, disruption_reason=reason)
            .on_conflict_do_update(
                index_elements=["id"],
                set_={"disruption_since": now, "disruption_reason": reason},
            )
        )

    def leave(self, conn: Connection) -> None:
        conn.execute(
            update(control_plane_state)
            .where(control_plane_state.c.id == 1)
            .values(disruption_since=None, disruption_reason=None)
        )
