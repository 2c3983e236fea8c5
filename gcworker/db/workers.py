"""Every SQL statement on the `workers` table and on the tombstones deleted workers leave.

Any change to a worker or to its rows bumps `generation`; a report whose handles match the last
accepted report of the same generation can then skip the diff (the steady-state fast path).
"""

from __future__ import annotations

import functools
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import Connection, bindparam, delete, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite

from gcworker.db.audit import AuditEntry
from gcworker.db.database import Database, commit_without_waiting_column, statement_clock
from gcworker.db.inventory import ContainerRepository, VolumeRepository
from gcworker.db.oneshot import execute_one
from gcworker.db.tables import containers, worker_tombstones, workers
from gcworker.rules import Tombstone, WorkerView

_VIEW_COLUMNS = (
    workers.c.name,
    workers.c.state,
    workers.c.ephemeral,
    workers.c.incarnation,
    workers.c.last_heartbeat_seq,
    workers.c.last_report_seq,
    workers.c.running_since_seq,
    workers.c.generation,
    workers.c.report_digest,
    workers.c.report_generation,
    workers.c.last_report_at,
)


class UnknownWorker(LookupError):
    pass


@dataclass(frozen=True)
class DeletedWorker:
    """A worker deleted by `WorkerRepository.delete`: the state it was in, and the handles of
    the rows that went with it, by kind."""

    name: str
    state: str
    handles: dict[str, list[str]]

    @property
    def counts(self) -> dict[str, int]:
        return {f"{kind}s": len(handles) for kind, handles in self.handles.items()}

    def audit(self, reason: str) -> list[AuditEntry]:
        """Rule 13: every row that went with the worker, by handle, then the worker itself."""
        rows = [
            AuditEntry.batch(
                "delete", kind, handles, f"deleted with worker {self.name}: {reason}", self.name
            )
            for kind, handles in sorted(self.handles.items())
            if handles
        ]
        counts = self.counts
        return [
            *rows,
            AuditEntry(
                "delete",
                "worker",
                self.name,
                f"{reason}; {counts['containers']} containers and {counts['volumes']} volumes "
                "deleted with it",
                worker=self.name,
            ),
        ]


class WorkerRepository:
    def __init__(self, db: Database):
        self.db = db

    def lock(self, conn: Connection, name: str) -> WorkerView | None:
        """Read a worker and hold its row until commit: its events apply one at a time."""
        row = conn.execute(
            select(*_VIEW_COLUMNS).where(workers.c.name == name).with_for_update()
        ).one_or_none()
        return WorkerView(**row._mapping) if row else None

    def lock_with_clock(
        self, conn: Connection, name: str, *, commit_without_waiting: bool = False
    ) -> tuple[WorkerView | None, datetime]:
        """`lock`, and the control plane's time, in one statement on PostgreSQL; with
        `commit_without_waiting`, the same statement also makes this transaction's commit not
        wait for the disk (`Database.commit_without_waiting`, for a report or a collector
        batch, whose loss in a server crash the rules already tolerate)."""
        if not self.db.is_postgresql:
            return self.lock(conn, name), self.db.now(conn)
        row = conn.execute(
            _lock_with_clock_statement(commit_without_waiting), {"p_name": name}
        ).one_or_none()
        if row is None:
            if commit_without_waiting:
                self.db.commit_without_waiting(conn)
            return None, self.db.now(conn)
        fields = dict(row._mapping)
        now = self.db.clock(fields.pop("clock_now"))
        fields.pop("relaxed", None)
        return WorkerView(**fields), now

    def get(self, conn: Connection, name: str) -> dict:
        row = conn.execute(select(workers).where(workers.c.name == name)).one_or_none()
        if row is None:
            raise UnknownWorker(f"unknown worker {name!r}")
        return dict(row._mapping)

    def list(self, conn: Connection) -> list[dict]:
        return [dict(r._mapping) for r in conn.execute(select(workers).order_by(workers.c.name))]

    def register(
        self,
        conn: Connection,
        *,
        name: str,
        ephemeral: bool,
        incarnation: int,
        seq: int,
        now: datetime,
        ttl: timedelta,
        worker_clock: datetime | None,
    ) -> None:
        conn.execute(
            workers.insert().values(
                name=name,
                state="running",
                ephemeral=ephemeral,
                incarnation=incarnation,
                last_heartbeat_seq=seq,
                running_since_seq=seq,
                running_since=now,
                heartbeat_expires_at=now + ttl,
                last_worker_clock=worker_clock,
                created_at=now,
                state_changed_at=now,
                # Not 0: a worker registered again under an old name must not meet an old
                # registration's generation (see `gcworker.rows_cache`).
                generation=secrets.randbits(48),
            )
        )

    def record_heartbeat(
        self,
        conn: Connection,
        name: str,
        *,
        seq: int,
        now: datetime,
        ttl: timedelta,
        worker_clock: datetime | None,
        ephemeral: bool,
        incarnation: int | None = None,
        new_state: str | None = None,
        starts_running_period: bool = False,
    ) -> None:
        values = {
            "last_heartbeat_seq": seq,
            "heartbeat_expires_at": now + ttl,
            "last_worker_clock": worker_clock,
            "ephemeral": ephemeral,
        }
        if incarnation is not None:
            values.update(incarnation=incarnation, last_report_seq=None, report_digest=None)
        if starts_running_period:
            values.update(running_since_seq=seq, running_since=now, stalled_at=None)
        if new_state is not None:
            values.update(state=new_state, state_changed_at=now)
        if incarnation is not None or new_state is not None or starts_running_period:
            values["generation"] = workers.c.generation + 1
        conn.execute(update(workers).where(workers.c.name == name).values(**values))

    def record_report(
        self,
        conn: Connection,
        name: str,
        *,
        seq: int,
        worker_clock: datetime | None,
        confirmed_at: datetime | None,
        digest: str | None,
        rows_changed: bool = False,
    ) -> None:
        """Advance the report sequence (rule 6); `confirmed_at` is set by a report that may mark;
        `rows_changed` bumps the generation in the same statement (the report wrote rows)."""
        shape = (confirmed_at is not None, digest is not None, rows_changed)
        conn.execute(
            _record_report_statement(*shape),
            {
                "p_name": name,
                "p_seq": seq,
                "p_clock": worker_clock,
                "p_confirmed_at": confirmed_at,
                "p_digest": digest,
            },
        )

    def confirm_unchanged_report(
        self,
        name: str,
        *,
        incarnation: int,
        seq: int,
        digest: str,
        worker_clock: datetime | None,
        after: datetime | None,
    ) -> datetime | None:
        """The fast path in one statement (PostgreSQL): a report of the worker's last accepted
        digest, with nothing changed since, is recorded as `record_report` would record it
        after `judge_report` (rules 6, 7), `report_may_mark` (rule 2) and `report_is_unchanged`
        all said yes and `after` is no later than now; rule 4's confirmation moves to
        `confirmation_time(report_built_at(now, after), last_report_at)`. A transaction of
        its own (`execute_one`), so call it outside any other. Returns the control plane's
        time, or None when any condition fails: nothing was written, and the report needs the
        whole judgement."""
        row = execute_one(
            self.db,
            _confirm_unchanged_statement(),
            {
                "p_name": name,
                "p_incarnation": incarnation,
                "p_seq": seq,
                "p_digest": digest,
                "p_clock": worker_clock,
                "p_after": after,
                **self.db.clock_parameters(),
            },
            prepared="gcworker_confirm_unchanged_report",
        )
        return None if row is None else row.now.astimezone(UTC)

    def bump_generation(self, conn: Connection, names) -> None:
        """Record that these workers' rows changed; also takes their row locks first."""
        names = sorted(set(names))
        if names:
            conn.execute(
                update(workers)
                .where(self.db.member_of(workers.c.name, names))
                .values(generation=workers.c.generation + 1)
            )

    def set_state(
        self, conn: Connection, names, *, state: str, from_states, now: datetime, **extra
    ) -> list[str]:
        """Move workers in `from_states` to `state`; returns the names that moved."""
        names = sorted(set(names))
        if not names:
            return []
        result = conn.execute(
            update(workers)
            .where(self.db.member_of(workers.c.name, names), workers.c.state.in_(from_states))
            .values(state=state, state_changed_at=now, generation=workers.c.generation + 1, **extra)
            .returning(workers.c.name)
        )
        return sorted(result.scalars())

    def delete(self, conn: Connection, names, *, reason: str, now: datetime) -> list[DeletedWorker]:
        """Delete workers with their rows, and leave a tombstone of each (rule 16): its last
        incarnation and highest sequence number, and `reason`, so that its old messages,
        replayed, are rejected. The workers are locked first (their incarnation and sequence
        numbers cannot move before they go); their rows are deleted by statements that return
        their handles, for the audit (a cascade would delete them unseen)."""
        names = sorted(set(names))
        if not names:
            return []
        w = workers.c
        found = conn.execute(
            select(w.name, w.state, w.incarnation, w.last_heartbeat_seq, w.last_report_seq)
            .where(self.db.member_of(w.name, names))
            .order_by(w.name)
            .with_for_update()
        ).all()
        if not found:
            return []
        gone = [row.name for row in found]
        handles: dict[str, dict[str, list[str]]] = {name: {} for name in gone}
        # Volumes first: deleting containers first would only set their volumes' owner to NULL.
        for repo in (VolumeRepository(self.db), ContainerRepository(self.db)):
            for name in gone:
                handles[name][repo.kind] = []
            for handle, name in repo.delete_all_of_workers(conn, gone):
                handles[name][repo.kind].append(handle)
        insert = postgresql.insert if self.db.is_postgresql else sqlite.insert
        tombstones = insert(worker_tombstones).values(
            [
                {
                    "worker_name": row.name,
                    "incarnation": row.incarnation,
                    "last_seq": max(
                        (s for s in (row.last_heartbeat_seq, row.last_report_seq) if s is not None),
                        default=None,
                    ),
                    "reason": reason,
                    "deleted_at": now,
                }
                for row in found
            ]
        )
        conn.execute(
            tombstones.on_conflict_do_update(
                index_elements=["worker_name"],
                set_={
                    column: tombstones.excluded[column]
                    for column in ("incarnation", "last_seq", "reason", "deleted_at")
                },
            )
        )
        conn.execute(delete(workers).where(self.db.member_of(w.name, gone)))
        return [
            DeletedWorker(row.name, row.state, {k: sorted(h) for k, h in handles[row.name].items()})
            for row in found
        ]

    def tombstone(self, conn: Connection, name: str) -> Tombstone | None:
        """The tombstone a deleted worker left (rule 16), or None. Read only for a message of a
        worker that has no row, never on the path of a known worker's messages."""
        t = worker_tombstones.c
        row = conn.execute(
            select(t.incarnation, t.reason).where(t.worker_name == name)
        ).one_or_none()
        return None if row is None else Tombstone(name, row.incarnation, row.reason)

    # Collector queries -------------------------------------------------------------------

    def expired_heartbeats(
        self, conn: Connection, now: datetime, *, states, ephemeral=None
    ) -> list[str]:
        query = select(workers.c.name).where(
            workers.c.state.in_(states), workers.c.heartbeat_expires_at < now
        )
        if ephemeral is not None:
            query = query.where(workers.c.ephemeral.is_(ephemeral))
        return sorted(conn.execute(query).scalars())

    def landing_without_active_containers(self, conn: Connection) -> list[str]:
        active = (
            select(containers.c.id)
            .where(
                containers.c.worker_name == workers.c.name,
                containers.c.state.in_(("creating", "created")),
            )
            .exists()
        )
        return sorted(
            conn.execute(
                select(workers.c.name).where(workers.c.state == "landing", ~active)
            ).scalars()
        )

    def stalled_since_before(self, conn: Connection, cutoff: datetime) -> list[str]:
        return sorted(
            conn.execute(
                select(workers.c.name).where(
                    workers.c.state == "stalled", workers.c.stalled_at <= cutoff
                )
            ).scalars()
        )

    def count_in_states(self, conn: Connection, states) -> int:
        return conn.execute(
            select(func.count()).select_from(workers).where(workers.c.state.in_(states))
        ).scalar_one()

    def restart_every_clock(self, conn: Connection, now: datetime, ttl: timedelta) -> None:
        """Rule 12, on leaving disruption mode: every heartbeat expiry starts afresh, and every
        worker's rows count as changed."""
        conn.execute(
            update(workers).values(
                heartbeat_expires_at=now + ttl, generation=workers.c.generation + 1
            )
        )


# Statements every report runs, built once (building them costs more than sending them).


@functools.cache
def _lock_with_clock_statement(commit_without_waiting: bool):
    columns = [*_VIEW_COLUMNS, func.clock_timestamp().label("clock_now")]
    if commit_without_waiting:
        columns.append(commit_without_waiting_column())
    return select(*columns).where(workers.c.name == bindparam("p_name")).with_for_update()


@functools.cache
def _confirm_unchanged_statement():
    w = workers.c
    seq = bindparam("p_seq", type_=w.last_report_seq.type)
    now = statement_clock()
    # Rule 4: `after` is the report's date (never later than now: a later one is for the
    # full judgement to reject); GREATEST skips NULLs, so an undated report confirms nothing
    # and no earlier confirmation leaves this one.
    built_at = bindparam("p_after", type_=w.last_report_at.type)
    return (
        update(workers)
        .where(
            w.name == bindparam("p_name"),
            w.incarnation == bindparam("p_incarnation"),
            or_(w.last_report_seq.is_(None), w.last_report_seq < seq),
            w.state == "running",
            w.running_since_seq < seq,
            w.report_digest == bindparam("p_digest"),
            w.report_generation == w.generation,
            or_(built_at.is_(None), built_at <= now),
        )
        .values(
            last_report_seq=seq,
            last_worker_clock=bindparam("p_clock", type_=w.last_worker_clock.type),
            last_report_at=func.greatest(w.last_report_at, built_at),
        )
        # Written by a report: its commit need not wait for the disk (see `lock_with_clock`).
        .returning(now.label("now"), commit_without_waiting_column())
    )


@functools.cache
def _record_report_statement(confirmed: bool, digest: bool, rows_changed: bool):
    values = {
        "last_report_seq": bindparam("p_seq", type_=workers.c.last_report_seq.type),
        "last_worker_clock": bindparam("p_clock", type_=workers.c.last_worker_clock.type),
    }
    if confirmed:
        values["last_report_at"] = bindparam("p_confirmed_at", type_=workers.c.last_report_at.type)
    generation = workers.c.generation + 1 if rows_changed else workers.c.generation
    if rows_changed:
        values["generation"] = generation
    if digest:
        values["report_digest"] = bindparam("p_digest", type_=workers.c.report_digest.type)
        values["report_generation"] = generation
    return update(workers).where(workers.c.name == bindparam("p_name")).values(**values)
