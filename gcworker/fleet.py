"""Operators' actions on workers: land, retire, prune. Each is audited with actor `operator`.

A pruned worker leaves a tombstone (rule 16): its old messages, replayed, are rejected, and it
registers again only from a higher incarnation (a restarted reporter). Its key stays registered,
so that a worker pruned while it was away can come back by restarting; `revoke_key` revokes it
in the same transaction, for a worker that must never come back under that key."""

from __future__ import annotations

from gcworker.db.audit import AuditEntry, AuditRepository
from gcworker.db.database import Database
from gcworker.db.keys import KeyRepository
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

    def prune(self, name: str, *, revoke_key: bool = False) -> dict[str, int]:
        """Delete a worker that is not running, with its rows, leaving its tombstone; with
        `revoke_key`, revoke its key too. Returns how many rows of each kind went with it."""
        with self.db.transaction() as conn:
            worker = self._locked(conn, name)
            if worker.state == "running":
                raise Conflict(
                    f"worker {name!r} is running: only a worker that is not running can be pruned "
                    "(land or retire it first, or wait for it to stall)"
                )
            now = self.db.now(conn)
            reason = f"pruned by an operator ({worker.state})"
            if revoke_key:
                KeyRepository().revoke(conn, name, now)
                reason += ", its key revoked"
            (deleted,) = self.workers.delete(conn, [name], reason=reason, now=now)
            self.audit.record(conn, deleted.audit(reason), actor="operator", now=now)
        return deleted.counts

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
