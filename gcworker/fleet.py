"""Operators' actions on workers: land, retire, prune. Each is audited with actor `operator`."""

from __future__ import annotations

from gcworker.db.audit import AuditEntry, AuditRepository
from gcworker.db.database import Database
from gcworker.db.workers import WorkerRepository
from gcworker.errors import Conflict, NotFound

LAND_FROM = ("running",)
RETIRE_FROM = ("running", "landing", "landed", "stalled")


class Fleet:
    def __init__(self, db: Database):
        self.db = db
        self.workers = WorkerRepository(db)
        self.audit = AuditRepository()

    def land(self, name: str) -> None:
        self._move(name, "landing", LAND_FROM, "land", "operator asked the worker to land")

    def retire(self, name: str) -> None:
        self._move(name, "retiring", RETIRE_FROM, "retire", "operator asked the worker to retire")

    def prune(self, name: str) -> dict[str, int]:
        """Delete a worker that is not running, with its rows; returns what went with it."""
        with self.db.transaction() as conn:
            worker = self._locked(conn, name)
            if worker.state == "running":
                raise Conflict(
                    f"worker {name!r} is running: only a worker that is not running can be pruned "
                    "(land or retire it first, or wait for it to stall)"
                )
            counts = self.workers.row_counts(conn, name)
            self.workers.delete(conn, [name])
            self.audit.record(
                conn,
                [
                    AuditEntry(
                        "delete",
                        "worker",
                        name,
                        f"pruned by an operator ({worker.state}); {counts['containers']} "
                        f"containers and {counts['volumes']} volumes deleted with it",
                        worker=name,
                    )
                ],
                actor="operator",
                now=self.db.now(conn),
            )
        return counts

    def _move(self, name: str, state: str, from_states, action: str, reason: str) -> None:
        with self.db.transaction() as conn:
            worker = self._locked(conn, name)
            if worker.state not in from_states:
                raise Conflict(
                    f"worker {name!r} is {worker.state}: it cannot become {state} "
                    f"(only from {' or '.join(from_states)})"
                )
            now = self.db.now(conn)
            self.workers.set_state(conn, [name], state=state, from_states=from_states, now=now)
            self.audit.record(
                conn,
                [AuditEntry(action, "worker", name, reason, worker=name)],
                actor="operator",
                now=now,
            )

    def _locked(self, conn, name: str):
        worker = self.workers.lock(conn, name)
        if worker is None:
            raise NotFound(f"unknown worker {name!r}")
        return worker
