"""Every SQL statement on the `containers` and `volumes` tables.

Both tables share one lifecycle (creating -> created -> destroying, creating -> failed ->
destroying), so one repository class serves both; the volume-only statements (parents, owning
containers) sit in `VolumeRepository`. Each rule is one statement over all of a worker's rows,
and every write is conditional, so that nothing unchanged is rewritten.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import (
    Connection,
    DateTime,
    Integer,
    Table,
    Text,
    any_,
    bindparam,
    cast,
    column,
    delete,
    func,
    literal,
    literal_column,
    select,
    text,
    true,
    union,
    union_all,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql import ARRAY

from gcworker.db.database import Database, commit_without_waiting_column
from gcworker.db.tables import INVENTORY_TABLES, ORPHANED, containers, volumes, workers
from gcworker.rules import WorkerRows, deletion_cutoff

# From this many handles on, a statement on a worker's rows also names the worker (see
# `InventoryRepository._by_handles`).
WORKER_INDEX_FROM = 1000
_STATEMENTS: dict[tuple, object] = {}


def _built_once(key: tuple, build):
    """The statement `build()` makes, made once per `key` (what it depends on: the table's kind,
    the backend, its shape): building one costs about as much as running it."""
    statement = _STATEMENTS.get(key)
    if statement is None:
        statement = _STATEMENTS[key] = build()
    return statement


class InventoryRepository:
    kind = "container"
    table: Table = containers

    def __init__(self, db: Database):
        self.db = db

    # Reads -------------------------------------------------------------------------------

    def handles_in_state(
        self, conn: Connection, worker: str, state: str, limit: int | None = None
    ) -> list[str]:
        """The worker's handles in `state`, sorted; with `limit`, those of its oldest rows."""
        t = self.table
        query = select(t.c.handle).where(t.c.worker_name == worker, t.c.state == state)
        if limit is not None:
            query = query.order_by(t.c.id).limit(limit)
        return sorted(conn.execute(query).scalars())

    def find(self, conn: Connection, handle: str, *, lock: bool = False) -> dict | None:
        query = select(self.table).where(self.table.c.handle == handle)
        if lock:
            query = query.with_for_update()
        row = conn.execute(query).one_or_none()
        return dict(row._mapping) if row else None

    def list(self, conn: Connection, worker: str | None = None) -> list[dict]:
        t = self.table
        query = select(*self._listing_columns()).select_from(self._listing_from())
        if worker is not None:
            query = query.where(t.c.worker_name == worker)
        return [dict(r._mapping) for r in conn.execute(query.order_by(t.c.worker_name, t.c.handle))]

    def _listing_columns(self):
        t = self.table
        return (
            t.c.handle,
            t.c.worker_name.label("worker"),
            t.c.state,
            t.c.missing_since,
            t.c.state_changed_at,
        )

    def _listing_from(self):
        return self.table

    # Report rules ------------------------------------------------------------------------

    def mark_missing(self, conn: Connection, worker: str, handles: list[str], now: datetime) -> int:
        """Rule 1: mark created rows the report lacks; never a creating row, never twice.

        `handles` are the worker's own (read under its lock, and handles are unique)."""
        if not handles:
            return 0
        return conn.execute(
            self._by_handles("mark", len(handles)), self._handles_params(worker, handles, now)
        ).rowcount

    def clear_missing(self, conn: Connection, worker: str, handles: list[str]) -> int:
        """Rule 3: a reported handle clears its mark; only marked rows are written."""
        if not handles:
            return 0
        return conn.execute(
            self._by_handles("clear", len(handles)), self._handles_params(worker, handles)
        ).rowcount

    def _by_handles(self, rule: str, count: int):
        """The statement of `rule` on the rows of some handles of a worker, built once per kind,
        backend and shape (building one costs more than running it).

        The handles come from the worker's own rows, read under its lock (and handles are
        unique): the worker condition is only a hint for PostgreSQL's planner, and only for many
        handles, where scanning the worker's index beats one probe per handle; for a few, it
        would make the planner scan the worker's whole index range for nothing."""
        by_worker = count >= WORKER_INDEX_FROM
        return _built_once(
            ("by handles", self.kind, self.db.dialect, rule, by_worker),
            lambda: self._by_handles_statement(rule, by_worker),
        )

    def _by_handles_statement(self, rule: str, by_worker: bool):
        t = self.table
        where = [self.db.member_of_parameter(t.c.handle, "p_handles")]
        if by_worker:
            where.append(t.c.worker_name == bindparam("p_worker"))
        if rule == "mark":
            return (
                update(t)
                .where(*where, t.c.state == "created", t.c.missing_since.is_(None))
                .values(missing_since=bindparam("p_now", type_=t.c.missing_since.type))
            )
        if rule == "clear":
            return (
                update(t).where(*where, t.c.missing_since.is_not(None)).values(missing_since=None)
            )
        # "destroyed": only rows that were destroying before the report was built
        return (
            delete(t)
            .where(
                *where,
                t.c.state == "destroying",
                t.c.state_changed_at <= bindparam("p_now", type_=t.c.state_changed_at.type),
            )
            .returning(t.c.handle, t.c.worker_name, literal("destroyed").label("reason"))
        )

    def _handles_params(self, worker: str, handles: list[str], now: datetime | None = None):
        params = {"p_handles": self.db.values_parameter(handles), "p_worker": worker}
        if now is not None:
            params["p_now"] = now
        return params

    def clear_all_marks(self, conn: Connection, worker: str) -> int:
        """Rule 5: when a worker comes back, absence must be seen afresh."""
        t = self.table
        return conn.execute(
            update(t)
            .where(t.c.worker_name == worker, t.c.missing_since.is_not(None))
            .values(missing_since=None)
        ).rowcount

    def unknown_statement(
        self, worker: str, handles: list[str], now: datetime
    ) -> tuple[object, dict]:
        """Rule 8: a handle with no row at all is recorded as destroying, so the worker removes it.
        A handle that another worker's row already holds is left alone (handles are unique).

        Returns the statement, built once per kind and backend, returning (handle, worker_name,
        reason "unknown") of each row it records, for `AuditRepository.record_returned` to audit
        in the same statement; and its parameters."""
        statement = _built_once(("unknown", self.kind, self.db.dialect), self._unknown_statement)
        return statement, {
            "p_handles": self.db.values_parameter(handles),
            "p_worker": worker,
            "p_now": now,
        }

    def _unknown_statement(self):
        t = self.table
        insert = postgresql.insert if self.db.is_postgresql else sqlite.insert
        reported = self.db.rowset_parameter("p_handles")
        worker = bindparam("p_worker", type_=t.c.worker_name.type)
        stamp = bindparam("p_now", type_=t.c.created_at.type)
        return (
            insert(t)
            .from_select(
                ["handle", "worker_name", "state", "created_at", "state_changed_at"],
                # SQLite needs a WHERE before ON CONFLICT in INSERT ... SELECT (parser ambiguity).
                select(reported.c.value, worker, literal("destroying"), stamp, stamp).where(true()),
            )
            .on_conflict_do_nothing(index_elements=["handle"])
            .returning(t.c.handle, t.c.worker_name, literal("unknown").label("reason"))
        )

    def confirmed_destroyed_statement(
        self, worker: str, handles: list[str], built_at: datetime
    ) -> tuple[object, dict]:
        """Rule 9: a destroying row whose handle the worker no longer reports is done, if it was
        destroying already when the report was built (`built_at`): a report that waited in a
        broker may predate the handle's creation. Returns the statement, returning (handle,
        worker_name, reason "destroyed") of each deleted row for `record_returned`, and its
        parameters."""
        return (
            self._by_handles("destroyed", len(handles)),
            self._handles_params(worker, handles, built_at),
        )

    def mark_all_missing(self, conn: Connection, worker: str, now: datetime) -> int:
        """Rule 1 for a report that lists no handle of this kind: every created row is missing
        (set-based: nothing to read first)."""
        t = self.table
        return conn.execute(
            update(t)
            .where(t.c.worker_name == worker, t.c.state == "created", t.c.missing_since.is_(None))
            .values(missing_since=now)
        ).rowcount

    def delete_all_of_workers(self, conn: Connection, names: list[str]) -> list[tuple[str, str]]:
        """Every row of these workers (rule 7: an ephemeral worker's old incarnation; or the
        workers are being deleted): returns (handle, worker) of each, for the audit."""
        t = self.table
        theirs = self.db.member_of(t.c.worker_name, names)
        if self.db.is_postgresql:
            return sorted(
                conn.execute(delete(t).where(theirs).returning(t.c.handle, t.c.worker_name))
            )
        # SQLite's cascade deletes a volume's children as it deletes the volume, unseen by
        # RETURNING (and so unaudited): read the rows first (the transaction is IMMEDIATE:
        # nothing changes between the two statements).
        rows = conn.execute(select(t.c.handle, t.c.worker_name).where(theirs)).all()
        conn.execute(delete(t).where(theirs))
        return sorted(rows)

    # Scheduler transitions ---------------------------------------------------------------

    def insert_creating(
        self, conn: Connection, *, worker: str, handle: str, now: datetime, **extra
    ) -> None:
        conn.execute(
            self.table.insert().values(
                handle=handle,
                worker_name=worker,
                state="creating",
                created_at=now,
                state_changed_at=now,
                **extra,
            )
        )

    def transition(
        self,
        conn: Connection,
        handle: str,
        *,
        from_states: Iterable[str],
        to_state: str,
        now: datetime,
    ) -> bool:
        t = self.table
        return (
            conn.execute(
                update(t)
                .where(t.c.handle == handle, t.c.state.in_(tuple(from_states)))
                # A mark belongs to `created` rows only (ck_*_missing_only_created).
                .values(state=to_state, state_changed_at=now, missing_since=None)
            ).rowcount
            == 1
        )

    # Collector statements ----------------------------------------------------------------

    def stuck_workers(self, conn: Connection, cutoff: datetime) -> list[str]:
        """The workers of the rows that rule 10 moves (creating since `cutoff` or earlier, or
        failed and free to go), read without a lock: the collector locks these workers before
        their rows, in the order of every writer of a worker's rows (`lock_workers`). A row
        that cannot move (a parent volume with children) names no worker: locking one bumps
        its generation, which would cost it its next fast path at every collection."""
        t = self.table
        creating = select(t.c.worker_name).where(
            _in_state(t, "creating"), t.c.state_changed_at <= cutoff
        )
        failed = select(t.c.worker_name).where(_in_state(t, "failed"), *self._may_destroy())
        return sorted(conn.execute(union(creating, failed)).scalars())

    def fail_stuck_creating(
        self, conn: Connection, names: list[str], cutoff: datetime, now: datetime
    ) -> list[tuple[str, str]]:
        """Rule 10, first half: a creating row of the (locked) workers `names` older than the
        creating-timeout becomes failed (read from `ix_<kind>_creating`: the few rows in
        creating)."""
        t = self.table
        result = conn.execute(
            update(t)
            .where(
                _in_state(t, "creating"),
                t.c.state_changed_at <= cutoff,
                self.db.member_of(t.c.worker_name, names),
            )
            .values(state="failed", state_changed_at=now)
            .returning(t.c.handle, t.c.worker_name)
        )
        return sorted(result.all())

    def destroy_failed(
        self, conn: Connection, names: list[str], now: datetime
    ) -> list[tuple[str, str]]:
        """Rule 10, second half: a failed row of the (locked) workers `names` goes to
        destroying (from `ix_<kind>_failed`)."""
        t = self.table
        result = conn.execute(
            update(t)
            .where(
                _in_state(t, "failed"),
                self.db.member_of(t.c.worker_name, names),
                *self._may_destroy(),
            )
            .values(state="destroying", state_changed_at=now)
            .returning(t.c.handle, t.c.worker_name)
        )
        return sorted(result.all())

    def _may_destroy(self) -> tuple:
        return ()

    def _deletable(self, now: datetime, grace: timedelta):
        """Rule 4's candidates of this kind: (kind, missing_since, id, worker) of rows missing
        for the grace period on a running worker whose last report, received at or after
        `missing_since + grace`, still lacked them."""
        t = self.table
        return (
            select(
                literal(self.kind).label("kind"),
                t.c.missing_since,
                t.c.id,
                t.c.worker_name,
            )
            .join(workers, workers.c.name == t.c.worker_name)
            .where(
                workers.c.state == "running",
                t.c.state == "created",
                t.c.missing_since.is_not(None),
                t.c.missing_since <= now - grace,
                # `missing_since + grace <= last_report_at`, written so that it is no index
                # condition: PostgreSQL then reads the candidates once and joins the few
                # workers, rather than scanning the index once per worker.
                self.db.minus(t.c.missing_since, -grace) <= workers.c.last_report_at,
            )
        )

    def _deletable_counts(self, now: datetime, grace: timedelta):
        """Rule 4's candidates of this kind counted per running worker: (kind, worker,
        count, last_report_at), a row per running worker (the count may be 0). A worker's
        candidates are one range of `ix_<kind>_worker_missing_since` (its rows marked at or
        before its cutoff, `min(now, last_report_at) - grace`), counted from the index alone,
        by a count of its own (no grouping of every candidate by worker). A mark is only ever
        made on a created row (ck_<kind>_missing_only_created), so the state needs no
        reading."""
        t = self.table
        count = (
            select(func.count())
            .where(
                t.c.worker_name == workers.c.name,
                t.c.missing_since.is_not(None),
                t.c.missing_since <= now - grace,
                t.c.missing_since <= self.db.minus(workers.c.last_report_at, grace),
            )
            .correlate(workers)
            .scalar_subquery()
        )
        return select(
            literal(self.kind).label("kind"),
            workers.c.name.label("worker_name"),
            count.label("count"),
            workers.c.last_report_at,
        ).where(workers.c.state == "running")

    def delete_missing(
        self, conn: Connection, deletion: Deletion, cutoff: datetime
    ) -> list[tuple[str, str]]:
        """Rule 4: delete the rows of `deletion` (its ids, or its worker's rows) that are still
        missing since `cutoff` or earlier. Returns (handle, reason) for every deleted row."""
        t = self.table
        ids = self._ids(conn, deletion, cutoff)
        statement = (
            delete(t)
            .where(*self._missing_before(deletion.worker, ids, cutoff))
            .returning(t.c.handle, literal("missing").label("reason"))
        )
        return sorted(conn.execute(statement).all())

    def _ids(self, conn: Connection, deletion: Deletion, cutoff: datetime) -> list[int]:
        """The ids of a deletion: its own, or its worker's rows marked at or before `cutoff`
        (the oldest marks first, at most its limit)."""
        if deletion.ids is not None:
            return list(deletion.ids)
        t = self.table
        query = (
            select(t.c.id)
            .where(t.c.worker_name == deletion.worker, *_marked_by(t, cutoff))
            .order_by(t.c.missing_since, t.c.id)
            .limit(deletion.limit)
        )
        return list(conn.execute(query).scalars())

    def delete_missing_statement(
        self, deletions: list[Deletion], cutoffs: dict[str, datetime]
    ) -> tuple[object, dict]:
        """`delete_missing` for the deletions of a batch in one statement (PostgreSQL), each
        worker's with its own cutoff, returning (handle, worker_name, reason), so that the
        audit can be written from it in the same statement (`AuditRepository.record_returned`).
        Returns the statement, built once per kind and shape of batch (building one costs
        about as much as a short statement's round trip), and the batch's parameters."""
        shape = _batch_shape(deletions)
        statement = _built_once(
            ("missing", self.kind, self.db.dialect, shape),
            lambda: self._delete_missing_statement(shape),
        )
        return statement, self._missing_params(shape, deletions, cutoffs)

    def _delete_missing_statement(self, shape: str):
        t = self.table
        return (
            delete(t)
            .where(*self._missing_rows(shape))
            .returning(t.c.handle, t.c.worker_name, literal("missing").label("reason"))
        )

    def _missing_rows(self, shape: str) -> tuple:
        """The conditions of a batch's rows (PostgreSQL), in the shape of the unbatched DELETE
        (a range of `ix_<kind>_worker_missing_since` per worker), whatever the batch holds:
        whole workers' candidates (one worker: "worker"; several: "workers"); the oldest
        `p_limit` of one worker's ("oldest"); or (over the cap) ids ("ids"). The values are
        parameters (`_missing_params`).

        "oldest" reads the batch's ids first, once, from the worker's index range (an InitPlan:
        `ARRAY(SELECT ... LIMIT)`), and deletes by primary key alone. A join of the rows to
        that subquery (or the same conditions beside the ids) let a planner with stale
        statistics (marks made since the last ANALYZE: the range looks empty) scan the whole
        range once per id, or per row: a nested loop quadratic in the worker's marks. The ids
        are read after the batch's worker lock, which every writer of a worker's rows takes
        first, so they still qualify when deleted."""
        t = self.table
        if shape == "ids":
            return (self.db.member_of_parameter(t.c.id, "p_ids"), *self._by_worker_cutoffs())
        if shape == "workers":
            return self._by_worker_cutoffs()
        worker = bindparam("p_worker", type_=Text)
        cutoff = bindparam("p_cutoff", type_=t.c.missing_since.type)
        mine = (t.c.worker_name == worker, t.c.state == "created", *_marked_by(t, cutoff))
        if shape == "worker":
            return mine
        inner = t.alias("candidate")
        oldest = (
            select(inner.c.id)
            .where(inner.c.worker_name == worker, *_marked_by(inner, cutoff))
            .order_by(inner.c.missing_since, inner.c.id)
            .limit(bindparam("p_limit", type_=Integer))
        )
        return (t.c.id == any_(func.array(oldest.scalar_subquery())),)

    def _missing_params(
        self, shape: str, deletions: list[Deletion], cutoffs: dict[str, datetime]
    ) -> dict:
        if shape in ("worker", "oldest"):
            (deletion,) = deletions
            params = {"p_worker": deletion.worker, "p_cutoff": cutoffs[deletion.worker]}
            if shape == "oldest":
                params["p_limit"] = deletion.limit
            return params
        names = sorted(cutoffs)
        params = {
            "p_workers": self.db.values_parameter(names),
            "p_cutoffs": self.db.values_parameter([cutoffs[n].isoformat() for n in names]),
        }
        if shape == "ids":
            params["p_ids"] = self.db.values_parameter(
                [id_ for d in deletions for id_ in d.ids or ()]
            )
        return params

    def _by_worker_cutoffs(self) -> tuple:
        """Rows of several workers, each marked at or before its own cutoff: a (worker, cutoff)
        rowset joined (PostgreSQL), from the parameters `p_workers` and `p_cutoffs`."""
        t = self.table
        allowed = (
            func.unnest(
                cast(bindparam("p_workers", type_=Text), ARRAY(Text)),
                cast(bindparam("p_cutoffs", type_=Text), ARRAY(DateTime(timezone=True))),
            )
            .table_valued(column("worker_name", Text), column("cutoff", DateTime(timezone=True)))
            .render_derived()
        )
        return (
            t.c.worker_name == allowed.c.worker_name,
            t.c.state == "created",
            t.c.missing_since.is_not(None),
            t.c.missing_since <= allowed.c.cutoff,
        )

    def _missing_before(self, worker: str, ids: list[int], cutoff: datetime) -> tuple:
        t = self.table
        return (
            self.db.member_of(t.c.id, ids),
            t.c.worker_name == worker,
            t.c.state == "created",
            *_marked_by(t, cutoff),
        )

    def clear_every_mark(self, conn: Connection) -> int:
        """Rule 12, on leaving disruption mode: every absence must be seen afresh."""
        t = self.table
        return conn.execute(
            update(t).where(t.c.missing_since.is_not(None)).values(missing_since=None)
        ).rowcount

    def count_missing(self, conn: Connection) -> int:
        t = self.table
        return conn.execute(
            select(func.count()).select_from(t).where(t.c.missing_since.is_not(None))
        ).scalar_one()


@dataclass(frozen=True)
class Deletion:
    """What a batch deletes of one worker's rule-4 candidates of one kind: every row marked at
    or before its cutoff (at most `limit` of them, the oldest marks, when the worker has more
    candidates than a batch holds), or the rows `ids` (over the deletion cap). `cutoff` is the
    plan's: a batch never deletes a row marked later, whatever it reads under the lock."""

    worker: str
    cutoff: datetime | None = None
    ids: tuple[int, ...] | None = None
    limit: int | None = None


@dataclass(frozen=True)
class Candidates:
    """One worker's rule-4 candidates of one kind, as planned: how many, and either the cutoff
    they were counted with (within the cap: all go) or their ids (the oldest, over the cap)."""

    kind: str
    worker: str
    count: int
    cutoff: datetime | None = None
    ids: tuple[int, ...] | None = None


def _batch_shape(deletions: list[Deletion]) -> str:
    """Which statement deletes a batch (see `InventoryRepository._missing_rows`)."""
    if any(d.ids is not None for d in deletions):
        return "ids"
    if len(deletions) > 1:
        return "workers"
    return "worker" if deletions[0].limit is None else "oldest"


def _marked_by(t, cutoff) -> tuple:
    return (t.c.missing_since.is_not(None), t.c.missing_since <= cutoff)


def _in_state(t, state: str):
    """`state = '<state>'` with the state inline, as the partial indexes on it are written, so
    that both backends prove the index usable."""
    return t.c.state == literal_column(f"'{state}'", t.c.state.type)


def handles_by_kind(
    conn: Connection, worker: str, repos: Iterable[InventoryRepository]
) -> dict[str, WorkerRows]:
    """The worker's handles by state, for each kind, in one statement and one short result: a
    row per (kind, state, marked) with the handles joined by commas (a handle never holds one),
    not a row per handle. On PostgreSQL the worker index covers these columns."""
    repos = list(repos)
    groups: dict[str, list] = {repo.kind: [] for repo in repos}
    query = _handles_statement(repos[0].db.is_postgresql, tuple(r.kind for r in repos))
    for kind, state, marked, handles in conn.execute(query, {"p_worker": worker}):
        groups[kind].append((state, bool(marked), handles.split(",")))
    return {kind: WorkerRows.of(found) for kind, found in groups.items()}


@functools.cache
def _handles_statement(postgresql: bool, kinds: tuple[str, ...]):
    """The statement of `handles_by_kind`, built once: building it costs more than running it."""
    parts = []
    for kind in kinds:
        t = INVENTORY_TABLES[kind]
        marked = t.c.missing_since.is_not(None)
        joined = (
            func.string_agg(t.c.handle, ",") if postgresql else func.group_concat(t.c.handle, ",")
        )
        parts.append(
            select(literal(kind).label("kind"), t.c.state, marked.label("marked"), joined)
            .where(t.c.worker_name == bindparam("p_worker"))
            .group_by(t.c.state, marked)
        )
    return union_all(*parts)


def deletion_plan(
    conn: Connection,
    repos: Iterable[InventoryRepository],
    now: datetime,
    grace: timedelta,
    cap: int,
) -> tuple[list[Candidates], bool]:
    """Rule 4's plan: each running worker's candidates of every kind, and whether more than
    `cap` were waiting. Within the cap (the usual case) every candidate goes: the plan is their
    count per (kind, worker), read from the indexes alone, with the cutoff it was counted with,
    and a batch deletes a worker's rows by (worker, cutoff) as the unbatched DELETE would. Over
    the cap: the oldest `cap` marks across kinds and workers, by id."""
    repos = list(repos)
    counts = conn.execute(union_all(*(repo._deletable_counts(now, grace) for repo in repos)))
    plan = sorted(
        (
            Candidates(kind, worker, count, deletion_cutoff(now, last_report_at, grace))
            for kind, worker, count, last_report_at in counts
            if count
        ),
        key=lambda c: (c.kind, c.worker),
    )
    if sum(c.count for c in plan) <= cap:
        return plan, False
    return [
        Candidates(kind, worker, len(ids), ids=tuple(ids))
        for kind, worker, ids in oldest_deletable(conn, repos, now, grace, cap)
    ], True


def oldest_deletable(
    conn: Connection,
    repos: Iterable[InventoryRepository],
    now: datetime,
    grace: timedelta,
    cap: int,
) -> list[tuple[str, str, list[int]]]:
    """Rule 4's `cap` oldest candidates across kinds and workers: (kind, worker, ids) groups.
    Grouped by the database: the ids come back joined, a row per group, not a row per
    candidate."""
    repos = list(repos)
    candidates = union_all(*(repo._deletable(now, grace) for repo in repos)).subquery()
    c = candidates.c
    oldest = (
        select(c.kind, c.worker_name, c.id)
        .order_by(c.missing_since, c.kind, c.worker_name, c.id)
        .limit(cap)
        .subquery()
    )
    return _grouped_ids(conn, repos[0].db, oldest)


def lock_workers(
    conn: Connection, db: Database, names: Iterable[str], *, commit_without_waiting: bool
) -> tuple[dict[str, tuple[str, datetime | None]], datetime]:
    """A collector's step, before it changes any row of the workers `names`: lock them (in
    name order, as every lock of several workers is taken), so that no report or scheduler
    change of theirs interleaves, and in the order every writer of a worker's rows takes its
    locks (the worker, then its rows: any other order closes a lock cycle with them); bump their
    generation (their rows are about to change: their next report takes the full diff, and the
    reconciler's known rows are read afresh; a worker whose rows then do not change only loses
    its next fast path); and read their state and last report as they are under the lock, with
    the control plane's time, in one statement on PostgreSQL: {name: (state, last_report_at)},
    now. With `commit_without_waiting` the same statement makes the commit not wait for the
    disk (for rule 4's batches: a batch lost in a server crash is a deletion not made yet, the
    next collection makes it)."""
    names = sorted(set(names))
    postgresql_ = db.is_postgresql
    statement = _lock_workers_statement(db, postgresql_ and commit_without_waiting)
    rows = conn.execute(statement, {"p_names": db.values_parameter(names)}).all()
    if postgresql_ and rows:
        now = db.clock(rows[0].clock_now)
    else:
        if postgresql_ and commit_without_waiting:
            db.commit_without_waiting(conn)
        now = db.now(conn)
    return {row.name: (row.state, row.last_report_at) for row in rows}, now


def _lock_workers_statement(db: Database, relaxed: bool):
    """The statement of `lock_workers`, built once per backend: the workers are
    locked by the subquery, in name order, before the UPDATE writes any of them; RETURNING
    reads each row after its lock, as it is then (and the clock after the lock)."""

    def build():
        w, mine = workers.c, workers.alias("locking").c
        locked = (
            select(mine.name)
            .where(db.member_of_parameter(mine.name, "p_names"))
            .order_by(mine.name)
            .with_for_update()
        )
        columns = [w.name, w.state, w.last_report_at]
        if db.is_postgresql:
            columns.append(func.clock_timestamp().label("clock_now"))
            if relaxed:
                columns.append(commit_without_waiting_column())
        return (
            update(workers)
            .where(w.name.in_(locked.scalar_subquery()))
            .values(generation=w.generation + 1)
            .returning(*columns)
        )

    return _built_once(("lock workers", db.dialect, relaxed), build)


def _grouped_ids(conn: Connection, db: Database, rows) -> list[tuple[str, str, list[int]]]:
    r = rows.c
    joined = (
        func.string_agg(cast(r.id, Text), ",") if db.is_postgresql else func.group_concat(r.id, ",")
    )
    query = (
        select(r.kind, r.worker_name, joined)
        .group_by(r.kind, r.worker_name)
        .order_by(r.kind, r.worker_name)
    )
    return [
        (kind, worker, [int(id_) for id_ in str(ids).split(",")])
        for kind, worker, ids in conn.execute(query)
    ]


class ContainerRepository(InventoryRepository):
    kind = "container"
    table = containers


_parent = volumes.alias("parent")


class VolumeRepository(InventoryRepository):
    kind = "volume"
    table = volumes

    def _listing_columns(self):
        return (
            *super()._listing_columns(),
            _parent.c.handle.label("parent"),
            containers.c.handle.label("container"),
        )

    def _listing_from(self):
        return volumes.outerjoin(_parent, _parent.c.id == volumes.c.parent_id).outerjoin(
            containers, containers.c.id == volumes.c.container_id
        )

    def has_children(self, conn: Connection, volume_id: int) -> bool:
        return (
            conn.execute(
                select(volumes.c.id).where(volumes.c.parent_id == volume_id).limit(1)
            ).first()
            is not None
        )

    def _may_destroy(self) -> tuple:
        """A parent cannot be destroyed while it has children."""
        child = volumes.alias("child")
        return (~select(child.c.id).where(child.c.parent_id == volumes.c.id).exists(),)

    def orphaned_workers(self, conn: Connection) -> list[str]:
        """The workers of the orphaned volumes free to go, read without a lock (see
        `stuck_workers`)."""
        query = select(volumes.c.worker_name).where(text(ORPHANED), *self._may_destroy()).distinct()
        return sorted(conn.execute(query).scalars())

    def destroy_orphaned(
        self, conn: Connection, names: list[str], now: datetime
    ) -> list[tuple[str, str]]:
        """A volume of the (locked) workers `names` made for a container whose row is gone goes
        to destroying (read from `ix_volumes_orphaned`, whose condition this is, word for
        word)."""
        result = conn.execute(
            update(volumes)
            .where(
                text(ORPHANED),
                self.db.member_of(volumes.c.worker_name, names),
                *self._may_destroy(),
            )
            .values(state="destroying", state_changed_at=now, missing_since=None)
            .returning(volumes.c.handle, volumes.c.worker_name)
        )
        return sorted(result.all())

    def delete_missing(
        self, conn: Connection, deletion: Deletion, cutoff: datetime
    ) -> list[tuple[str, str]]:
        """Rule 4 for volumes: a missing volume's copy-on-write descendants go with it."""
        ids = self._ids(conn, deletion, cutoff)
        subtree = self._missing_subtree(deletion.worker, ids, cutoff)
        # Read the subtree before deleting it: SQLite evaluates the CTE while it deletes, and the
        # foreign-key cascade removes descendants unseen by RETURNING (and so unaudited).
        result = conn.execute(
            select(volumes.c.id, volumes.c.handle).where(volumes.c.id.in_(select(subtree.c.id)))
        ).all()
        conn.execute(delete(volumes).where(self.db.member_of(volumes.c.id, [r.id for r in result])))
        roots = set(ids)
        return sorted(
            (handle, "missing" if id_ in roots else "descendant of a missing volume")
            for id_, handle in result
        )

    def _missing_subtree(self, worker: str, ids: list[int], cutoff: datetime):
        subtree = (
            select(volumes.c.id)
            .where(*self._missing_before(worker, ids, cutoff))
            .cte("subtree", recursive=True)
        )
        child = volumes.alias("child")
        return subtree.union(select(child.c.id).where(child.c.parent_id == subtree.c.id))

    def _delete_missing_statement(self, shape: str):
        """`delete_missing` in one statement, for PostgreSQL: the missing volumes are deleted
        as the unbatched DELETE would, and their descendants are found from the deleted rows
        (RETURNING) alone and deleted by a second DELETE of the same statement, so that
        RETURNING sees every row (the foreign-key cascade runs after the statement, and then
        finds nothing left)."""
        roots = (
            delete(volumes)
            .where(*self._missing_rows(shape))
            .returning(volumes.c.id, volumes.c.handle, volumes.c.worker_name)
            .cte("roots")
        )
        child = volumes.alias("child")
        below = (
            select(child.c.id)
            # Children, matched to the roots by hash when there are few of them (as a fleet
            # without copy-on-write volumes has: then nothing is probed per deleted volume).
            .where(child.c.parent_id.is_not(None), child.c.parent_id.in_(select(roots.c.id)))
            .cte("below", recursive=True)
        )
        grandchild = volumes.alias("grandchild")
        below = below.union(
            select(grandchild.c.id).join(below, grandchild.c.parent_id == below.c.id)
        )
        descendants = (
            delete(volumes)
            .where(
                volumes.c.id.in_(select(below.c.id)),
                # A descendant that is missing itself is among the roots, deleted once.
                volumes.c.id.not_in(select(roots.c.id)),
            )
            .returning(volumes.c.handle, volumes.c.worker_name)
            .cte("descendants")
        )
        return union_all(
            select(roots.c.handle, roots.c.worker_name, literal("missing").label("reason")),
            select(
                descendants.c.handle,
                descendants.c.worker_name,
                literal("descendant of a missing volume").label("reason"),
            ),
        )
