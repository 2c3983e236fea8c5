"""What every collector is handed: the database, the settings, and a way to take short steps.

A step is one short transaction on the fenced connection, with the control plane's time read at
its start. In a dry run the whole collection is one transaction that is rolled back at the end,
so every collector sees the effects of the ones before it and nothing is kept but the audit.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import Connection

from gcworker.db.audit import AuditEntry, AuditRepository
from gcworker.db.database import Database
from gcworker.settings import Settings


@dataclass
class Step:
    conn: Connection
    now: datetime


@dataclass
class CollectionContext:
    db: Database
    settings: Settings
    conn: Connection
    dry_run: bool = False
    # Returns why the control plane is itself behind (rule 12), or None; set by the pipeline.
    self_check: Callable[[], str | None] | None = None
    # Set by the safety brake at the start of each collection.
    disrupted: bool = False
    disruption_reason: str | None = None
    counts: Counter = field(default_factory=Counter)
    pending_audit: list[AuditEntry] = field(default_factory=list)

    @contextlib.contextmanager
    def step(self) -> Iterator[Step]:
        with self.transaction() as conn:
            yield Step(conn, self.db.now(conn))

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A step that reads the clock itself (along with its first statement)."""
        if self.dry_run:
            yield self.conn
            return
        with self.conn.begin():
            yield self.conn

    def record(self, step: Step, entries: Iterable[AuditEntry]) -> None:
        """Audit what a step did (rule 13) and count it for the summary."""
        entries = list(entries)
        for entry in entries:
            self.counts[(entry.action, entry.kind)] += entry.count
        if self.dry_run:
            self.pending_audit.extend(entries)
        else:
            AuditRepository().record(step.conn, entries, actor="collector", now=step.now)
