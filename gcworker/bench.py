"""`gcworker bench`: what a report and a collection cost, beside the usual ways of doing it.

Everything runs on the configured PostgreSQL database, in a scratch schema of its own that is
dropped at the end (also on failure, Ctrl-C or SIGTERM). One run measures, for each number of
handles per worker H (20 workers' rows in the tables, each worker's rows interleaved with the
others' as a fleet's rows are):

- gcworker's reconcile path (`Reconciler.report`, timed from the decoded message to the commit):
  a steady report (the same list as the last one: the fast path), the same report when the
  fast path may not be taken (the worker's generation moved: the full diff, writing nothing),
  a 1% churn report (0.5% of the rows go missing, the 0.5% that were missing come back), a
  mass-loss report (a restarted durable worker that lost everything), and the compact unchanged
  report;
- the same reports through two baselines implemented here: `last_seen` (stamp every reported
  row) and the clear + mark statement pair over the whole list; both get the list as one array
  literal, as gcworker does;
- the floor: one `SELECT 1` round trip;
- per case: median and p95 ms, SQL statements per report (a `before_cursor_execute` listener;
  BEGIN and COMMIT are not statements), container and volume rows written per report (the
  transaction's own tuple counters, read in one extra, untimed report) and WAL bytes per report
  (`pg_current_wal_insert_lsn()` before and after; the median, since the cluster is shared);
- the collector deleting 100,000 missing rows beside an unbatched DELETE of the same rows;
- the collector after a mass loss marked since the last ANALYZE (stale planner statistics: 4
  workers x 25,000 marked rows, batches of 1,000 and 10,000), beside the same collection after
  ANALYZE;
- the peak RSS of a reconciler process (a child process) handling a 100,000-handle report;
- the pipeline through Redis and real Celery worker processes (`gcworker.bench_pipeline`).

`--json FILE` writes every figure under stable keys (see `BenchResult.as_json`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, event, text
from sqlalchemy.engine import make_url

from gcworker.db.database import Database, _pg_array_literal, create_database_engine
from gcworker.db.migrate import upgrade
from gcworker.errors import GcworkerError
from gcworker.messages import Heartbeat, Report, UnchangedReport
from gcworker.reconcile import Reconciler
from gcworker.rules import report_digest

DEFAULT_SIZES = (1_000, 10_000, 50_000)
QUICK_SIZES = (200, 1_000)
FLEET_WORKERS = 20
BENCH_WORKER = "w00"
COLLECT_ROWS = 100_000
RSS_HANDLES = 100_000
SCHEMA_PREFIX = "gcbench_"

# Targets of issue 5 (ratios from one run on the reference machine).
TARGET_COMPACT_VS_FLOOR = 5.0
TARGET_STEADY_VS_PAIR = {10_000: 20.0, 50_000: 30.0}
TARGET_CHURN_VS_PAIR = (10_000, 3.0)
TARGET_MASS_LOSS_H = 50_000
TARGET_LONGEST_STATEMENT_MS = 250.0
TARGET_COLLECT_VS_UNBATCHED = 1.5
TARGET_PIPELINE_VS_NOOP = 0.7
TARGET_COMPACT_BYTES = 1024
TARGET_RSS_MB = 200.0
# Issue 9: a collection's cost does not depend on fresh statistics.
STALE_WORKERS = 4
STALE_ROWS_PER_WORKER = 25_000
STALE_BATCHES = (1_000, 10_000)
TARGET_STALE_VS_ANALYZED = 2.0


class BenchError(GcworkerError):
    pass


# Statistics --------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summarize(samples_s: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in samples_s]
    return {
        "median_ms": round(statistics.median(ms), 3),
        "p95_ms": round(percentile(ms, 95), 3),
        "min_ms": round(min(ms), 3),
        "max_ms": round(max(ms), 3),
        "reps": len(ms),
    }


# The scratch schema ------------------------------------------------------------------------


def require_postgresql(url: str) -> None:
    backend = make_url(url).get_backend_name()
    if backend != "postgresql":
        raise BenchError(
            f"gcworker bench needs PostgreSQL (the database is {backend}): set "
            "GCWORKER_DATABASE_URL=postgresql://user@host/db; it works in a scratch schema of "
            "its own and drops it after"
        )


def schema_url(url: str, schema: str) -> str:
    """`url` with the search path set to `schema` (and `public` for extensions)."""
    parsed = make_url(url)
    options = parsed.query.get("options", "")
    if isinstance(options, tuple):
        options = " ".join(options)
    options = (options + f" -csearch_path={schema}").strip()
    return parsed.update_query_dict({"options": options}).render_as_string(hide_password=False)


@contextlib.contextmanager
def scratch_schema(url: str, before_drop: Callable[[], None] | None = None) -> Iterator[str]:
    """Create a schema of our own, yield its URL, and drop it whatever happens."""
    admin = create_database_engine(url).execution_options(isolation_level="AUTOCOMMIT")
    schema = SCHEMA_PREFIX + uuid.uuid4().hex[:12]
    with admin.connect() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    try:
        yield schema_url(url, schema)
    finally:
        try:
            if before_drop is not None:
                before_drop()
        finally:
            with admin.connect() as conn:
                conn.execute(text("SET lock_timeout = '60s'"))
                conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
            admin.dispose()


@contextlib.contextmanager
def terminate_on_sigterm() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so that every `finally` (the schema's drop) runs."""

    def handler(signum, _frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# Instruments -------------------------------------------------------------------------------


_XACT_ROWS = (
    "SELECT coalesce(sum(pg_stat_get_xact_tuples_inserted(oid) + "
    "pg_stat_get_xact_tuples_updated(oid) + pg_stat_get_xact_tuples_deleted(oid)), 0) "
    "FROM pg_class WHERE oid IN (to_regclass('containers'), to_regclass('volumes'))"
)


class Instruments:
    """Statement counts and durations on an engine; rows written when asked.

    Rows written are read from the transaction's own tuple counters (inserted + updated +
    deleted on `containers` and `volumes`) at its start and just before its commit: exact, and
    counting every row a statement touches even when no value changes. PostgreSQL 15 folds a
    backend's not-yet-flushed counts into these, hence the difference of two readings.
    """

    def __init__(self, engine: Engine, *single_statement_engines: Engine | None):
        self.statements = 0
        self.durations: list[float] = []
        self.longest = (0.0, "")
        self.counting_rows = False
        self.rows_written = 0
        self._started: float | None = None
        self._rows_at_begin: dict[int, int] = {}
        for each in (engine, *filter(None, single_statement_engines)):
            event.listen(each, "before_cursor_execute", self._before)
            event.listen(each, "after_cursor_execute", self._after)
        event.listen(engine, "begin", self._begin)
        event.listen(engine, "commit", self._commit)

    def reset(self) -> None:
        self.statements = 0
        self.durations = []
        self.rows_written = 0
        self.longest = (0.0, "")

    def _before(self, *_args):
        self.statements += 1
        self._started = time.perf_counter()

    def _after(self, _conn, _cursor, statement, *_args):
        if self._started is not None:
            elapsed = time.perf_counter() - self._started
            self.durations.append(elapsed)
            if elapsed > self.longest[0]:
                self.longest = (elapsed, " ".join(statement.split())[:70])
            self._started = None

    @staticmethod
    def _xact_rows(conn) -> int:
        cursor = conn.connection.dbapi_connection.cursor()
        try:
            cursor.execute(_XACT_ROWS)
            return int(cursor.fetchone()[0])
        finally:
            cursor.close()

    def _begin(self, conn):
        if self.counting_rows:
            self._rows_at_begin[id(conn)] = self._xact_rows(conn)

    def _commit(self, conn):
        if self.counting_rows and id(conn) in self._rows_at_begin:
            self.rows_written += self._xact_rows(conn) - self._rows_at_begin.pop(id(conn))

    @contextlib.contextmanager
    def rows(self) -> Iterator[None]:
        self.counting_rows = True
        self.rows_written = 0
        try:
            yield
        finally:
            self.counting_rows = False
            self._rows_at_begin.clear()


def _lsn(text_value: str) -> int:
    high, low = text_value.split("/")
    return (int(high, 16) << 32) + int(low, 16)


# Workers and reports -----------------------------------------------------------------------


class BenchWorker:
    """Plays one worker: heartbeats and reports with a sequence number that only grows."""

    def __init__(self, reconciler: Reconciler, name: str):
        self.reconciler = reconciler
        self.name = name
        self.incarnation = 1
        self._seq = itertools.count(1)

    def heartbeat(self) -> None:
        self.reconciler.heartbeat(
            Heartbeat(
                worker=self.name,
                incarnation=self.incarnation,
                seq=next(self._seq),
                ttl_seconds=24 * 3600,
            )
        )

    def restart(self) -> None:
        self.incarnation += 1
        self._seq = itertools.count(1)
        self.heartbeat()

    def report(self, containers: list[str], volumes: list[str]) -> Report:
        return Report(
            worker=self.name,
            incarnation=self.incarnation,
            seq=next(self._seq),
            clock=datetime.now(UTC),
            containers=containers,
            volumes=volumes,
        )

    def unchanged(self, digest: str) -> UnchangedReport:
        return UnchangedReport(
            worker=self.name,
            incarnation=self.incarnation,
            seq=next(self._seq),
            clock=datetime.now(UTC),
            digest=digest,
        )


# The benchmark -----------------------------------------------------------------------------


@dataclass
class BenchOptions:
    sizes: tuple[int, ...] = DEFAULT_SIZES
    quick: bool = False
    workers: int = FLEET_WORKERS
    collect_rows: int = COLLECT_ROWS
    rss_handles: int = RSS_HANDLES
    pipeline: bool = True
    pipeline_sizes: tuple[int, ...] = (1_000, 10_000)
    stale_rows_per_worker: int = STALE_ROWS_PER_WORKER
    stale_batches: tuple[int, ...] = STALE_BATCHES
    reps: int | None = None  # per case; default depends on H

    @classmethod
    def make(cls, sizes: tuple[int, ...] | None, quick: bool) -> BenchOptions:
        if quick:
            return cls(
                sizes=sizes or QUICK_SIZES,
                quick=True,
                workers=6,
                collect_rows=2_000,
                rss_handles=5_000,
                pipeline=False,
                pipeline_sizes=(100,),
                reps=3,
                stale_rows_per_worker=500,
                stale_batches=(100, 1_000),
            )
        return cls(sizes=sizes or DEFAULT_SIZES)

    def reps_for(self, handles: int) -> int:
        if self.reps is not None:
            return self.reps
        if handles <= 2_000:
            return 30
        if handles <= 20_000:
            return 15
        return 7


@dataclass
class BenchResult:
    options: BenchOptions
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    server_version: str = ""
    schema: str = ""
    seconds: float = 0.0
    reconcile: dict[str, dict[str, Any]] = field(default_factory=dict)
    wire: dict[str, dict[str, int]] = field(default_factory=dict)
    collector: dict[str, Any] = field(default_factory=dict)
    stale_statistics: dict[str, Any] = field(default_factory=dict)
    rss: dict[str, Any] = field(default_factory=dict)
    pipeline: dict[str, Any] = field(default_factory=dict)
    targets: list[dict[str, Any]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "version": 1,
            "started_at": self.started_at.isoformat(),
            "seconds": round(self.seconds, 1),
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "platform": platform.platform(),
            },
            "database": {"server_version": self.server_version, "scratch_schema": self.schema},
            "options": {
                "sizes": list(self.options.sizes),
                "quick": self.options.quick,
                "workers": self.options.workers,
                "collect_rows": self.options.collect_rows,
                "rss_handles": self.options.rss_handles,
            },
            "reconcile": self.reconcile,
            "wire": self.wire,
            "collector": self.collector,
            "stale_statistics": self.stale_statistics,
            "rss": self.rss,
            "pipeline": self.pipeline,
            "targets": {t["key"]: t for t in self.targets},
        }


@dataclass
class Case:
    """One way of handling one kind of report: `action(prepare(i))` is timed, `prepare` not."""

    impl: str
    name: str
    prepare: Callable[[int], Any]
    action: Callable[[Any], Any]
    expect_fast: bool | None = None  # gcworker's cases: whether every report takes the fast path
    # Untimed, after each report: cleaning up after a case that rewrites many rows, so that the
    # case after it (whose rows share the pages) does not pay for it.
    after: Callable[[], None] | None = None

    @property
    def key(self) -> str:
        return f"{self.impl}.{self.name}"


class Bench:
    """One benchmark run on a migrated scratch schema at `url`."""

    def __init__(self, url: str, options: BenchOptions, progress: Callable[[str], None]):
        self.url = url
        self.options = options
        self.progress = progress
        self.db = Database.from_url(url)
        self.engine = self.db.engine
        self.admin = create_database_engine(url).execution_options(isolation_level="AUTOCOMMIT")
        # The autocommit engine runs the fast path's single statement (no BEGIN, no COMMIT).
        self.instruments = Instruments(self.engine, self.db.autocommit_engine)
        self.reconciler = Reconciler(self.db, timedelta(days=1))
        self._admin_conn = None

    def close(self) -> None:
        if self._admin_conn is not None:
            self._admin_conn.close()
        self.engine.dispose()
        self.admin.dispose()

    # Plumbing ------------------------------------------------------------------------------

    def sql(self, statement: str, **params) -> Any:
        """Run one untimed statement in autocommit (setup, resets, VACUUM)."""
        if self._admin_conn is None:
            self._admin_conn = self.admin.connect()
        return self._admin_conn.execute(text(statement), params)

    def lsn(self) -> int:
        return _lsn(self.sql("SELECT pg_current_wal_insert_lsn()::text").scalar_one())

    def cleanup(self) -> None:
        self.vacuum(analyze=False)

    def vacuum(self, analyze: bool = True) -> None:
        for table in ("containers", "volumes"):
            self.sql(f"VACUUM {'(ANALYZE) ' if analyze else ''}{table}")
        self.sql("VACUUM workers")

    def migrate(self) -> None:
        upgrade(self.engine)
        # The `last_seen` baseline's column, in the scratch schema only (nullable: no rewrite).
        self.sql("ALTER TABLE containers ADD COLUMN last_seen timestamptz")
        self.sql("ALTER TABLE volumes ADD COLUMN last_seen timestamptz")
        self.server_version = self.sql("SHOW server_version").scalar_one()

    def empty(self) -> None:
        self.sql("TRUNCATE audit_events, volumes, containers, workers RESTART IDENTITY CASCADE")

    def fleet(self, workers: int, containers: int, volumes: int) -> list[BenchWorker]:
        """`workers` workers, each with `containers` + `volumes` created rows, interleaved with
        each other's rows on disk; returns their players."""
        self.empty()
        players = [BenchWorker(self.reconciler, f"w{i:02d}") for i in range(workers)]
        for player in players:
            player.heartbeat()
        for table, letter, count in (("containers", "c", containers), ("volumes", "v", volumes)):
            if count:
                self.sql(
                    f"INSERT INTO {table} (handle, worker_name, state, missing_since, "
                    "created_at, state_changed_at) "
                    f"SELECT md5(w.name || '/{letter}/' || g)::uuid::text, w.name, 'created', "
                    "NULL, now(), now() "
                    "FROM workers w CROSS JOIN generate_series(1, :n) g ORDER BY g, w.name",
                    n=count,
                )
        self.vacuum()
        return players

    def handles(self, worker: str) -> tuple[list[str], list[str]]:
        def of(table):
            query = f"SELECT handle FROM {table} WHERE worker_name = :w ORDER BY id"
            return list(self.sql(query, w=worker).scalars())

        return of("containers"), of("volumes")

    def reset_marks(self, worker: str) -> None:
        """Untimed: clear the worker's marks (as the scheduler's hand would) and record it."""
        for table in ("containers", "volumes"):
            self.sql(
                f"UPDATE {table} SET missing_since = NULL "
                "WHERE worker_name = :w AND missing_since IS NOT NULL",
                w=worker,
            )
        self.bump_generation(worker)

    def bump_generation(self, worker: str) -> None:
        self.sql("UPDATE workers SET generation = generation + 1 WHERE name = :w", w=worker)

    def measure(self, cases: list[Case], reps: int, *, warmup: int = 1) -> dict[str, dict]:
        """Run the cases round-robin (each round in a rotated order, so that a noisy moment
        hits them all alike): `warmup` untimed rounds, `reps` timed ones, then one more round
        counting rows. Returns stats by case key."""
        samples: dict[str, list] = {c.key: [] for c in cases}
        statements: dict[str, list] = {c.key: [] for c in cases}
        wal: dict[str, list] = {c.key: [] for c in cases}
        results: dict[str, list] = {c.key: [] for c in cases}
        for i in range(warmup + reps):
            shift = i % len(cases)
            for case in cases[shift:] + cases[:shift]:
                argument = case.prepare(i)
                before = self.lsn()
                self.instruments.reset()
                started = time.perf_counter()
                result = case.action(argument)
                elapsed = time.perf_counter() - started
                after = self.lsn()
                if case.after is not None:
                    case.after()
                if i >= warmup:
                    samples[case.key].append(elapsed)
                    statements[case.key].append(self.instruments.statements)
                    wal[case.key].append(after - before)
                    results[case.key].append(result)
        out = {}
        for case in cases:
            argument = case.prepare(warmup + reps)
            with self.instruments.rows():
                case.action(argument)
            stats = summarize(samples[case.key])
            stats.update(
                statements=statistics.median(statements[case.key]),
                rows_written=self.instruments.rows_written,
                wal_bytes=int(statistics.median(wal[case.key])),
            )
            if case.expect_fast is not None:
                done = results[case.key]
                fast = [r.fast_path for r in done]
                stats["fast_path"] = all(fast) if case.expect_fast else any(fast)
                stats["outcomes"] = sorted({str(r.outcome) for r in done})
            out[case.key] = stats
        return out

    # Reconcile -----------------------------------------------------------------------------

    def bench_size(self, handles: int) -> dict[str, Any]:
        """Every reconcile case at H = `handles`. Each implementation works on a worker of its
        own (same number of rows, rows interleaved on the same pages), so that the cases can
        run round-robin without disturbing each other."""
        opts = self.options
        reps = opts.reps_for(handles)
        n_containers, n_volumes = handles // 2, handles - handles // 2
        self.progress(f"H={handles:,}: {opts.workers} workers' rows")
        players = self.fleet(opts.workers, n_containers, n_volumes)
        gc, ls, pair, compact, full = players[:5]
        lists = {p.name: self.handles(p.name) for p in players[:5]}
        out: dict[str, Any] = {"handles": handles, "fleet_workers": opts.workers}

        def apply(message):
            if isinstance(message, Report):
                return self.reconciler.report(message)
            return self.reconciler.unchanged(message)

        def reset() -> None:
            for player in players[:5]:
                self.reset_marks(player.name)
            self.vacuum()

        # Steady: the same lists again. The warm-up round's full reports record the digests.
        self.progress(f"H={handles:,}: steady reports")
        cases = [
            Case("gcworker", "steady", lambda i: gc.report(*lists[gc.name]), apply, True),
            Case(
                "gcworker",
                "steady_full_diff",
                lambda i: self.bump_generation(full.name) or full.report(*lists[full.name]),
                apply,
                False,
            ),
            Case(
                "last_seen",
                "steady",
                lambda i: lists[ls.name],
                _baseline(self.engine, last_seen_report, ls.name),
                # Each report rewrites every row: VACUUM keeps the baseline at its best.
                after=self.cleanup,
            ),
            Case(
                "pair",
                "steady",
                lambda i: lists[pair.name],
                _baseline(self.engine, pair_report, pair.name),
            ),
        ]
        digest = report_digest(*lists[compact.name])
        cases.append(
            Case(
                "gcworker",
                "compact_unchanged",
                lambda i: compact.unchanged(digest) if i else compact.report(*lists[compact.name]),
                apply,
                True,
            )
        )
        # The floor as a report meets it: one SELECT 1 on a connection from the pool the fast
        # path uses, among the other cases (a round trip to a server process that has waited).
        cases.append(Case("floor", "select1", lambda i: None, self._select1_from_pool))
        results = self.measure(cases, reps)
        out["select1"] = results.pop("floor.select1")
        out["select1_held"] = self.tight_loop(
            lambda: None, lambda _, conn: conn.exec_driver_sql("SELECT 1").scalar()
        )
        results["gcworker.compact_unchanged_loop"] = self.tight_loop(
            lambda: compact.unchanged(digest), lambda message, _: apply(message)
        )

        # 1% churn: each report lacks a new window of 0.5% of the handles (marked) and has again
        # the window the report before lacked (cleared): 1% of the rows change per report.
        self.progress(f"H={handles:,}: 1% churn reports")
        reset()
        window = max(1, handles // 200)

        def churn(player):
            containers, volumes = lists[player.name]
            sequence = _interleave(containers, volumes)

            def lists_of(i: int) -> tuple[list[str], list[str]]:
                start = (i * window) % max(1, len(sequence) - window)
                lacking = {h for _, h in sequence[start : start + window]}
                return (
                    [h for h in containers if h not in lacking],
                    [h for h in volumes if h not in lacking],
                )

            return lists_of

        churn_gc, churn_ls, churn_pair = churn(gc), churn(ls), churn(pair)
        results |= self.measure(
            [
                Case("gcworker", "churn_1pct", lambda i: gc.report(*churn_gc(i)), apply, False),
                Case(
                    "last_seen",
                    "churn_1pct",
                    churn_ls,
                    _baseline(self.engine, last_seen_report, ls.name),
                    after=self.cleanup,
                ),
                Case(
                    "pair",
                    "churn_1pct",
                    lambda i: churn_pair(i),
                    _baseline(self.engine, pair_report, pair.name),
                ),
            ],
            reps,
        )
        out["rows_changed_per_churn_report"] = 2 * window

        # Mass loss: a durable worker restarted and lost everything; its first report is empty.
        self.progress(f"H={handles:,}: mass-loss reports")
        reset()

        def lost(player, message: bool, writes: bool = True):
            def prepare(i):
                if writes:  # undo the last report's marks
                    self.reset_marks(player.name)
                self.cleanup()
                player.restart()
                return player.report([], []) if message else ([], [])

            return prepare

        results |= self.measure(
            [
                Case("gcworker", "mass_loss", lost(gc, True), apply, False),
                # `last_seen` writes nothing for an empty report: its cost comes later, in the
                # sweep that finds the rows not seen lately.
                Case(
                    "last_seen",
                    "mass_loss",
                    lost(ls, False, writes=False),
                    _baseline(self.engine, last_seen_report, ls.name),
                ),
                Case(
                    "pair",
                    "mass_loss",
                    lost(pair, False),
                    _baseline(self.engine, pair_report, pair.name),
                ),
            ],
            # Each of these reports rewrites every row of its worker: fewer of them, no warm-up
            # (each starts from the same state, on pages the cases before have read).
            max(7, reps // 2),
            warmup=0,
        )
        reset()
        for key, stats in results.items():
            impl, name = key.split(".")
            out.setdefault(impl, {})[name] = stats
        return out

    def tight_loop(
        self,
        prepare: Callable[[], Any],
        action: Callable[[Any, Any], Any],
        warmup: int = 50,
        reps: int = 300,
    ) -> dict[str, Any]:
        """`action(prepare(), conn)` timed again and again in a tight loop (hot: the server
        process and this one never wait between round trips); `conn` is held, in autocommit."""
        with self.admin.connect() as conn:
            timings = []
            for _ in range(warmup + reps):
                argument = prepare()
                started = time.perf_counter()
                action(argument, conn)
                timings.append(time.perf_counter() - started)
        # Only timed: the statements, rows and WAL of each case are counted among the cases.
        return summarize(timings[warmup:]) | {
            "statements": None,
            "rows_written": None,
            "wal_bytes": None,
        }

    def _select1_from_pool(self, _argument) -> None:
        engine = self.db.autocommit_engine or self.engine
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1").scalar()

    def wire_sizes(self, handles: int) -> dict[str, int]:
        """Bytes of a signed full report of `handles` handles and of a signed compact report."""
        from gcworker.codec import encode
        from gcworker.signing import generate_private_key

        key = generate_private_key()
        player = BenchWorker(self.reconciler, "w00")
        containers = [str(uuid.uuid4()) for _ in range(handles // 2)]
        volumes = [str(uuid.uuid4()) for _ in range(handles - handles // 2)]
        full = json.dumps(encode(player.report(containers, volumes), key))
        compact = json.dumps(encode(player.unchanged(report_digest(containers, volumes)), key))
        return {
            "full_report_bytes": len(full.encode()),
            "compact_report_bytes": len(compact.encode()),
        }

    # Collector -----------------------------------------------------------------------------

    def collector_data(self, rows: int) -> None:
        """10 workers, `rows` missing rows (half containers, half volumes) confirmed by a later
        report, and as many rows that are not missing."""
        workers = 10
        per_kind = rows // workers // 2
        self.fleet(workers, per_kind, per_kind)
        for table, letter in (("containers", "c"), ("volumes", "v")):
            self.sql(
                f"INSERT INTO {table} (handle, worker_name, state, missing_since, created_at, "
                "state_changed_at) "
                f"SELECT md5(w.name || '/m{letter}/' || g)::uuid::text, w.name, 'created', "
                "now() - interval '1 hour', now(), now() "
                "FROM workers w CROSS JOIN generate_series(1, :n) g ORDER BY g, w.name",
                n=per_kind,
            )
        self.sql("UPDATE workers SET last_report_at = now()")
        self.vacuum()

    def missing_rows(self) -> int:
        return self.sql(
            "SELECT (SELECT count(*) FROM containers WHERE missing_since IS NOT NULL) + "
            "(SELECT count(*) FROM volumes WHERE missing_since IS NOT NULL)"
        ).scalar_one()

    def bench_collector(self, rows: int, runs: int) -> dict[str, Any]:
        from gcworker.gc.collection import collect
        from gcworker.settings import load_settings

        settings = load_settings(
            database_url=self.url,
            missing_grace_period="5m",
            max_deletes_per_collection=max(rows, 10_000),
            dry_run=False,
        )
        batched, unbatched, audited_unbatched = [], [], []
        for run in range(runs):
            for audit, out in ((False, unbatched), (True, audited_unbatched)):
                what = "unbatched DELETE" + (" + audit" if audit else "")
                self.progress(f"collector: {rows:,} missing rows, {what} (run {run + 1})")
                self.collector_data(rows)
                out.append(self.unbatched_delete(audit))

            self.progress(f"collector: {rows:,} missing rows, gcworker collect (run {run + 1})")
            self.collector_data(rows)
            expected = self.missing_rows()
            self.instruments.reset()
            before = self.lsn()
            started = time.perf_counter()
            summary = collect(self.db, settings)
            elapsed = time.perf_counter() - started
            wal = self.lsn() - before
            left = self.missing_rows()
            # A batch's deletions of one worker and reason are one audit row holding every handle.
            audit_rows, audited = self.sql(
                "SELECT count(*), coalesce(sum(coalesce(cardinality(subjects), 1)), 0) "
                "FROM audit_events WHERE action = 'delete'"
            ).one()
            batched.append(
                {
                    "total_ms": elapsed * 1000,
                    "longest_statement_ms": max(self.instruments.durations) * 1000,
                    "longest_statement": self.instruments.longest[1],
                    "statements": self.instruments.statements,
                    "rows_deleted": expected - left,
                    "audited_deletions": audited,
                    "audit_rows": audit_rows,
                    "wal_bytes": wal,
                    "outcome": summary.outcome,
                }
            )

        def median_of(runs_: list[dict]) -> dict[str, Any]:
            best = sorted(runs_, key=lambda r: r["total_ms"])[len(runs_) // 2]
            out = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in best.items()}
            out["runs_total_ms"] = [round(r["total_ms"], 1) for r in runs_]
            return out

        return {
            "rows": rows,
            "delete_batch_size": settings.delete_batch_size,
            "gcworker": median_of(batched),
            "unbatched_delete": median_of(unbatched),
            "unbatched_delete_with_audit": median_of(audited_unbatched),
        }

    def bench_stale_statistics(self, per_worker: int, batches: tuple[int, ...]) -> dict[str, Any]:
        """A mass loss (every container of 4 workers marked, and confirmed) collected with the
        statistics of before the loss ("stale": the planner believes the marked ranges empty;
        autovacuum is held off meanwhile) and after ANALYZE, for each batch size. Both runs
        VACUUM first, so that they differ in the column statistics alone."""
        from gcworker.gc.collection import collect
        from gcworker.settings import load_settings

        rows = STALE_WORKERS * per_worker
        out: dict[str, Any] = {
            "workers": STALE_WORKERS,
            "rows_per_worker": per_worker,
            "rows": rows,
            "batches": {},
        }
        for batch in batches:
            settings = load_settings(
                database_url=self.url,
                missing_grace_period="5m",
                max_deletes_per_collection=rows,
                delete_batch_size=batch,
                dry_run=False,
            )
            runs = out["batches"][str(batch)] = {}
            for statistics_ in ("stale", "analyzed"):
                self.progress(
                    f"collector: {STALE_WORKERS} x {per_worker:,} rows marked, batches of "
                    f"{batch:,}, {statistics_} statistics"
                )
                self.fleet(STALE_WORKERS, per_worker, 0)  # analyzed before the loss
                self.sql("ALTER TABLE containers SET (autovacuum_enabled = false)")
                try:
                    self.sql("UPDATE containers SET missing_since = now() - interval '1 hour'")
                    self.sql("UPDATE workers SET last_report_at = now()")
                    self.vacuum(analyze=statistics_ == "analyzed")
                    self.instruments.reset()
                    started = time.perf_counter()
                    summary = collect(self.db, settings)
                    elapsed = time.perf_counter() - started
                finally:
                    self.sql("ALTER TABLE containers RESET (autovacuum_enabled)")
                runs[statistics_] = {
                    "total_ms": round(elapsed * 1000, 1),
                    "longest_statement_ms": round(self.instruments.longest[0] * 1000, 2),
                    "longest_statement": self.instruments.longest[1],
                    "statements": self.instruments.statements,
                    "rows_deleted": rows - self.missing_rows(),
                    "outcome": summary.outcome,
                }
        return out

    def unbatched_delete(self, audit: bool) -> dict[str, Any]:
        """Every missing row deleted by one statement per table (and, with `audit`, its audit
        rows written by the same statement): the floor a batched collection is compared with."""
        condition = (
            "state = 'created' AND missing_since IS NOT NULL AND "
            "missing_since <= now() - interval '5 minutes'"
        )
        self.instruments.reset()
        before = self.lsn()
        started = time.perf_counter()
        deleted = 0
        with self.engine.begin() as conn:
            for table, kind in (("containers", "container"), ("volumes", "volume")):
                statement = f"DELETE FROM {table} WHERE {condition}"
                if audit:
                    statement = (
                        f"WITH changed AS ({statement} RETURNING handle, worker_name) "
                        "INSERT INTO audit_events (at, actor, action, kind, subject, "
                        "worker_name, reason, dry_run) SELECT now(), 'collector', 'delete', "
                        f"'{kind}', handle, worker_name, 'missing for at least 5m, confirmed "
                        "by a later report', false FROM changed"
                    )
                deleted += conn.execute(text(statement)).rowcount
        elapsed = time.perf_counter() - started
        return {
            "total_ms": elapsed * 1000,
            "longest_statement_ms": max(self.instruments.durations) * 1000,
            "statements": self.instruments.statements,
            "rows_deleted": deleted,
            "wal_bytes": self.lsn() - before,
        }

    # Reconciler RSS ------------------------------------------------------------------------

    def bench_rss(self, handles: int) -> dict[str, Any]:
        """Peak RSS of a fresh process that decodes and applies one `handles`-handle report of
        a worker with as many rows (the full diff: its first report)."""
        from gcworker.codec import encode

        self.progress(f"reconciler RSS: one {handles:,}-handle report in a child process")
        player = self.fleet(1, handles // 2, handles - handles // 2)[0]
        containers, volumes = self.handles(player.name)
        with tempfile.TemporaryDirectory(prefix="gcbench-") as tmp:
            path = Path(tmp) / "report.json"
            path.write_text(json.dumps(encode(player.report(containers, volumes), None)))
            message_bytes = path.stat().st_size
            del containers, volumes
            child = subprocess.run(
                [sys.executable, "-m", "gcworker.bench", "--rss-child", self.url, str(path)],
                capture_output=True,
                text=True,
                timeout=300,
            )
        if child.returncode != 0:
            raise BenchError(f"the RSS child process failed: {child.stderr.strip()[-2000:]}")
        figures = json.loads(child.stdout.strip().splitlines()[-1])
        children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        figures.update(handles=handles, message_bytes=message_bytes, rusage_children_kb=children)
        figures["peak_rss_mb"] = round(figures["vm_hwm_kb"] / 1024, 1)
        return figures


def rss_child(url: str, path: str) -> None:
    """In a fresh process: what a reconciler does with one report as it arrives."""
    from gcworker.control_plane import ControlPlane
    from gcworker.settings import load_settings

    plane = ControlPlane(load_settings(database_url=url, allow_unsigned=True))
    before = _proc_status("VmRSS")
    started = time.perf_counter()
    envelope = json.loads(Path(path).read_text())
    result = plane.receive(envelope)
    elapsed = time.perf_counter() - started
    outcome = getattr(result, "outcome", None)
    print(
        json.dumps(
            {
                "rss_before_kb": before,
                "vm_hwm_kb": _proc_status("VmHWM"),
                "ru_maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                "seconds": round(elapsed, 3),
                "outcome": str(outcome) if outcome is not None else repr(result),
                "fast_path": getattr(result, "fast_path", None),
            }
        )
    )


def _proc_status(field_name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# Baselines ---------------------------------------------------------------------------------


def last_seen_report(conn, worker: str, kind: str, handles: str) -> None:
    """Write every reported row: the sweep finds what was not seen lately."""
    conn.execute(
        text(
            f"UPDATE {kind} SET last_seen = now() "
            "WHERE worker_name = :w AND handle = ANY(CAST(:handles AS text[]))"
        ),
        {"w": worker, "handles": handles},
    )


def pair_report(conn, worker: str, kind: str, handles: str) -> None:
    """Clear the reported rows' marks, mark the created rows the report lacks."""
    conn.execute(
        text(
            f"UPDATE {kind} SET missing_since = NULL WHERE worker_name = :w "
            "AND missing_since IS NOT NULL AND handle = ANY(CAST(:handles AS text[]))"
        ),
        {"w": worker, "handles": handles},
    )
    conn.execute(
        text(
            f"UPDATE {kind} SET missing_since = now() WHERE worker_name = :w "
            "AND state = 'created' AND missing_since IS NULL "
            "AND handle <> ALL(CAST(:handles AS text[]))"
        ),
        {"w": worker, "handles": handles},
    )


def _baseline(engine: Engine, implementation, worker: str):
    """A baseline run on one report: (containers, volumes) -> one transaction."""

    def run(lists: tuple[list[str], list[str]]) -> None:
        containers, volumes = lists
        with engine.begin() as conn:
            implementation(conn, worker, "containers", _pg_array_literal(containers))
            implementation(conn, worker, "volumes", _pg_array_literal(volumes))

    return run


def _interleave(containers: list[str], volumes: list[str]) -> list[tuple[str, str]]:
    out = []
    for c, v in itertools.zip_longest(containers, volumes):
        if c is not None:
            out.append(("container", c))
        if v is not None:
            out.append(("volume", v))
    return out


# Targets -----------------------------------------------------------------------------------


def evaluate_targets(result: BenchResult) -> list[dict[str, Any]]:
    targets: list[dict[str, Any]] = []

    def add(key, description, value, met, figure=None):
        targets.append(
            {"key": key, "target": description, "value": value, "met": met, "figure": figure}
        )

    def case(h, impl, name):
        return result.reconcile.get(str(h), {}).get(impl, {}).get(name)

    for h in result.options.sizes:
        cases = result.reconcile.get(str(h), {})
        compact, floor = case(h, "gcworker", "compact_unchanged"), cases.get("select1")
        loop, held = case(h, "gcworker", "compact_unchanged_loop"), cases.get("select1_held")
        key = f"compact_unchanged_vs_select1_h{h}"
        if compact and floor:
            ratio = compact["median_ms"] / floor["median_ms"]
            value = (
                f"{ratio:.1f}x among the cases ({compact['median_ms']:.2f} / "
                f"{floor['median_ms']:.3f} ms)"
            )
            if loop and held:
                value += (
                    f"; {loop['median_ms'] / held['median_ms']:.1f}x in tight loops "
                    f"({loop['median_ms']:.3f} / {held['median_ms']:.3f} ms)"
                )
            add(
                key,
                f"compact unchanged report <= {TARGET_COMPACT_VS_FLOOR:g}x SELECT 1 (H={h:,})",
                value,
                ratio <= TARGET_COMPACT_VS_FLOOR,
                round(ratio, 2),
            )
        else:
            add(key, f"compact unchanged report (H={h:,})", "not measured: no compact report", None)

    for h, needed in TARGET_STEADY_VS_PAIR.items():
        key = f"steady_vs_pair_h{h}"
        desc = f"full steady report >= {needed:g}x faster than the pair (H={h:,})"
        gc, pair = case(h, "gcworker", "steady"), case(h, "pair", "steady")
        if gc and pair:
            ratio = pair["median_ms"] / gc["median_ms"]
            add(
                key,
                desc,
                f"{ratio:.1f}x ({gc['median_ms']:.2f} vs {pair['median_ms']:.1f} ms)",
                ratio >= needed and gc["rows_written"] == 0,
                round(ratio, 2),
            )
        else:
            add(key, desc, f"not measured: H={h} not in --sizes", None)

    h, needed = TARGET_CHURN_VS_PAIR
    key = f"churn_vs_pair_h{h}"
    desc = f"1% churn >= {needed:g}x faster than the pair, rows written = rows changed (H={h:,})"
    gc, pair = case(h, "gcworker", "churn_1pct"), case(h, "pair", "churn_1pct")
    if gc and pair:
        ratio = pair["median_ms"] / gc["median_ms"]
        changed = result.reconcile[str(h)]["rows_changed_per_churn_report"]
        add(
            key,
            desc,
            f"{ratio:.1f}x ({gc['median_ms']:.2f} vs {pair['median_ms']:.1f} ms), "
            f"{gc['rows_written']} rows written of {changed} changed",
            ratio >= needed and gc["rows_written"] == changed,
            round(ratio, 2),
        )
    else:
        add(key, desc, f"not measured: H={h} not in --sizes", None)

    h = TARGET_MASS_LOSS_H
    key = f"mass_loss_vs_pair_h{h}"
    desc = f"mass loss no slower than the pair (H={h:,})"
    gc, pair = case(h, "gcworker", "mass_loss"), case(h, "pair", "mass_loss")
    if gc and pair:
        ratio = pair["median_ms"] / gc["median_ms"]
        add(
            key,
            desc,
            f"{ratio:.2f}x ({gc['median_ms']:.1f} vs {pair['median_ms']:.1f} ms)",
            gc["median_ms"] <= pair["median_ms"],
            round(ratio, 2),
        )
    else:
        add(key, desc, f"not measured: H={h} not in --sizes", None)

    col = result.collector
    rows = col.get("rows", 0)
    if col:
        gc, single = col["gcworker"], col["unbatched_delete"]
        longest = gc["longest_statement_ms"]
        add(
            "collector_longest_statement",
            f"collection of {rows:,} rows: no statement over {TARGET_LONGEST_STATEMENT_MS:g} ms",
            f"{longest:.1f} ms ({gc.get('longest_statement', '')[:40]}...)",
            longest <= TARGET_LONGEST_STATEMENT_MS and gc["rows_deleted"] == rows,
            longest,
        )
        ratio = gc["total_ms"] / single["total_ms"]
        value = f"{ratio:.2f}x ({gc['total_ms']:.0f} vs {single['total_ms']:.0f} ms)"
        floor = col.get("unbatched_delete_with_audit")
        if floor:
            value += (
                f"; {gc['total_ms'] / floor['total_ms']:.2f}x the unbatched DELETE that also "
                f"writes one audit row per deleted row ({floor['total_ms']:.0f} ms)"
            )
        add(
            "collector_total_vs_unbatched",
            f"collection of {rows:,} rows within {TARGET_COLLECT_VS_UNBATCHED:g}x the unbatched "
            "DELETE",
            value,
            ratio <= TARGET_COLLECT_VS_UNBATCHED,
            round(ratio, 2),
        )

    stale = result.stale_statistics
    for batch, runs in stale.get("batches", {}).items():
        old, fresh = runs["stale"], runs["analyzed"]
        ratio = old["total_ms"] / fresh["total_ms"]
        longest = old["longest_statement_ms"]
        add(
            f"collector_stale_statistics_b{batch}",
            f"collection of {stale['workers']} x {stale['rows_per_worker']:,} rows marked "
            f"without ANALYZE (batch {int(batch):,}): within {TARGET_STALE_VS_ANALYZED:g}x of "
            f"after-ANALYZE, no statement over {TARGET_LONGEST_STATEMENT_MS:g} ms",
            f"{ratio:.2f}x ({old['total_ms']:.0f} vs {fresh['total_ms']:.0f} ms), longest "
            f"{longest:.1f} ms ({old['longest_statement'][:40]}...)",
            ratio <= TARGET_STALE_VS_ANALYZED
            and longest <= TARGET_LONGEST_STATEMENT_MS
            and old["rows_deleted"] == fresh["rows_deleted"] == stale["rows"],
            round(ratio, 2),
        )

    pipe = result.pipeline
    for n in result.options.pipeline_sizes:
        key = f"pipeline_vs_noop_n{n}"
        desc = (
            f"pipeline: full reports >= {TARGET_PIPELINE_VS_NOOP:.0%} of the no-op rate (N={n:,})"
        )
        row = pipe.get("sizes", {}).get(str(n)) if pipe.get("measured") else None
        if row:
            ratio = row["reports_per_s"] / row["noop_per_s"]
            add(
                key,
                desc,
                f"{ratio:.0%} ({row['reports_per_s']:.0f} vs {row['noop_per_s']:.0f} /s)",
                ratio >= TARGET_PIPELINE_VS_NOOP,
                round(ratio, 3),
            )
        else:
            add(key, desc, f"not measured: {pipe.get('reason', 'pipeline skipped')}", None)

    on_broker = pipe.get("compact_broker_bytes")
    envelope = next((w.get("compact_report_bytes") for w in result.wire.values() if w), None)
    compact_bytes = on_broker if on_broker is not None else envelope
    if compact_bytes is not None:
        where = (
            f"as stored in Redis (envelope {envelope} B)"
            if on_broker is not None
            else "envelope only, pipeline not measured"
        )
        add(
            "compact_report_bytes",
            f"compact unchanged report under {TARGET_COMPACT_BYTES} bytes on the broker",
            f"{compact_bytes} bytes, {where}",
            compact_bytes < TARGET_COMPACT_BYTES,
            compact_bytes,
        )
    else:
        add("compact_report_bytes", "compact unchanged report size", "not measured", None)

    if result.rss:
        mb = result.rss["peak_rss_mb"]
        add(
            "reconciler_rss",
            f"reconciler peak RSS under {TARGET_RSS_MB:g} MB "
            f"({result.rss['handles']:,}-handle report)",
            f"{mb:.0f} MB",
            mb < TARGET_RSS_MB,
            mb,
        )
    return targets


# Running -----------------------------------------------------------------------------------


def run_bench(
    url: str, options: BenchOptions, progress: Callable[[str], None] = lambda _: None
) -> BenchResult:
    require_postgresql(url)
    result = BenchResult(options)
    started = time.perf_counter()
    bench: Bench | None = None

    def close():
        if bench is not None:
            bench.close()

    with terminate_on_sigterm(), scratch_schema(url, before_drop=close) as scratch:
        bench = Bench(scratch, options, progress)
        result.schema = make_url(scratch).query["options"].rsplit("search_path=", 1)[1]
        bench.migrate()
        result.server_version = bench.server_version
        for handles in options.sizes:
            result.reconcile[str(handles)] = bench.bench_size(handles)
            result.wire[str(handles)] = bench.wire_sizes(handles)
        result.collector = bench.bench_collector(options.collect_rows, 1 if options.quick else 3)
        result.stale_statistics = bench.bench_stale_statistics(
            options.stale_rows_per_worker, options.stale_batches
        )
        result.rss = bench.bench_rss(options.rss_handles)
        if options.pipeline:
            from gcworker.bench_pipeline import bench_pipeline

            result.pipeline = bench_pipeline(bench, options, progress)
        else:
            reason = "skipped (--quick)" if options.quick else "skipped (--no-pipeline)"
            result.pipeline = {"measured": False, "reason": reason}
    result.seconds = time.perf_counter() - started
    result.targets = evaluate_targets(result)
    return result


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--rss-child":
        rss_child(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit("usage: python -m gcworker.bench --rss-child URL FILE")
