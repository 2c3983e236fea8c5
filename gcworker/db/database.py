"""The inventory database: the engine, its transactions and the control plane's clock.

PostgreSQL is the distributed mode's source of truth; SQLite serves the embedded mode. Every
timestamp that drives a decision is read from the database (`clock_timestamp()` on PostgreSQL,
the host clock that owns the SQLite file otherwise), never from a worker.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import (
    BigInteger,
    Connection,
    DateTime,
    Engine,
    Interval,
    Text,
    bindparam,
    cast,
    create_engine,
    event,
    func,
    select,
)
from sqlalchemy import any_ as sql_any
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import psycopg2 as postgresql_psycopg2
from sqlalchemy.engine import make_url
from sqlalchemy.sql.elements import ColumnElement

SQLITE_BUSY_TIMEOUT_MS = 30_000
PG_KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
}


def create_database_engine(url: str) -> Engine:
    """An engine for `url`; SQLite gets foreign keys, WAL and writer-serialising transactions."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})
        _make_sqlite_transactions_immediate(engine)
        return engine
    if parsed.drivername == "postgresql":
        # SQLAlchemy 2.1 picks psycopg 3 for a bare postgresql://; the stack is psycopg2.
        parsed = parsed.set(drivername="postgresql+psycopg2")
    # A server (or the network to it) gone silent fails a statement within a minute or so,
    # instead of hanging until TCP gives up (hours); the URL's own values win.
    keepalives = {k: v for k, v in PG_KEEPALIVES.items() if k not in parsed.query}
    return create_engine(parsed, pool_pre_ping=True, connect_args=keepalives)


def _make_sqlite_transactions_immediate(engine: Engine) -> None:
    # pysqlite's own BEGIN is deferred: two writers would both read, then one fails to upgrade its
    # lock. Taking the write lock at BEGIN serialises writers the way row locks do on PostgreSQL.
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cursor.close()

        dbapi_connection.create_function(
            "gc_minus_seconds", 2, _sqlite_minus_seconds, deterministic=True
        )

    @event.listens_for(engine, "begin")
    def _on_begin(connection):
        connection.exec_driver_sql("BEGIN IMMEDIATE")


@dataclass
class Database:
    """An engine plus the clock every decision is timed by.

    `offset` shifts the database clock; tests use `advance()` to move through grace periods
    without sleeping. Nothing else sets it.

    On PostgreSQL a second engine, `autocommit_engine`, runs single statements that are their
    own transaction (`gcworker.db.oneshot`: the unchanged report's one statement, a key read): no
    BEGIN and COMMIT round trips, and no liveness ping; a caller falls back to `transaction()`
    when its connection turns out dead (SQLAlchemy drops it from the pool then).
    """

    engine: Engine
    offset: timedelta = field(default_factory=timedelta)
    autocommit_engine: Engine | None = field(default=None, init=False, repr=False)
    _held: dict[threading.Thread, Connection] = field(default_factory=dict, init=False, repr=False)
    _held_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.is_postgresql:
            self.autocommit_engine = create_engine(self.engine.url, isolation_level="AUTOCOMMIT")

    @classmethod
    def from_url(cls, url: str) -> Database:
        return cls(create_database_engine(url))

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @property
    def is_postgresql(self) -> bool:
        return self.dialect == "postgresql"

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Connection]:
        with self.engine.begin() as connection:
            yield connection

    @contextlib.contextmanager
    def autocommit(self) -> Iterator[Connection]:
        """This thread's connection whose every statement commits on its own (PostgreSQL only),
        held from one use to the next: a checkout from the pool costs about as much as a short
        statement's round trip. Given back to the pool after an error, and once its thread is
        gone (when another thread takes one)."""
        if self.autocommit_engine is None:
            raise RuntimeError("single-statement transactions are a PostgreSQL feature here")
        thread = threading.current_thread()
        connection = self._held.get(thread) or self._hold(thread)
        try:
            yield connection
        except BaseException:
            with self._held_lock:
                self._held.pop(thread, None)
            connection.close()
            raise

    def _hold(self, thread: threading.Thread) -> Connection:
        with self._held_lock:
            for gone in [other for other in self._held if not other.is_alive()]:
                self._held.pop(gone).close()
            connection = self._held[thread] = self.autocommit_engine.connect()
            return connection

    def execute_prepared(self, connection: Connection, name: str, statement, params: dict):
        """Run `statement` as the server-side prepared statement `name` of this connection,
        prepared on its first use there (PostgreSQL): a statement that runs on every report
        saves its parsing and planning, most of its cost. Only for statements whose plan does
        not depend on their values (a generic plan serves them: no `= ANY(array)`)."""
        text_, names, processors, constants = prepared_form(statement)
        prepared = connection.connection.info.setdefault("gcworker_prepared", set())
        if name not in prepared:
            connection.exec_driver_sql(f"PREPARE {name} {text_}")
            prepared.add(name)
        values = []
        for key, process in zip(names, processors, strict=True):
            value = params[key] if key in params else constants[key]
            values.append(value if process is None else process(value))
        placeholders = ", ".join(["%s"] * len(values))
        return connection.exec_driver_sql(f"EXECUTE {name}({placeholders})", tuple(values))

    def now(self, connection: Connection) -> datetime:
        """The control plane's clock, read through `connection`."""
        if self.is_postgresql:
            return self.clock(connection.execute(select(func.clock_timestamp())).scalar_one())
        return self.clock(datetime.now(UTC))

    def clock(self, current: datetime) -> datetime:
        """The control plane's time from a `clock_timestamp()` read along with other columns."""
        return current.astimezone(UTC) + self.offset

    def clock_parameters(self) -> dict:
        """The parameters of `statement_clock()`: the offset (and no pinned time)."""
        return {"p_clock_offset": self.offset, "p_clock_pinned": None}

    def commit_without_waiting(self, connection: Connection) -> None:
        """Let this transaction's commit return before its WAL reaches the disk (PostgreSQL
        `synchronous_commit = off`, for this transaction only; nothing on SQLite).

        Only for transactions whose loss in a server crash equals a report that never arrived
        or a deletion not made yet: such a commit is visible at once, is never half-applied, and
        becomes durable no later than any durable commit that saw it (WAL is flushed in order).
        """
        if self.is_postgresql:
            connection.execute(select(commit_without_waiting_column()))

    def advance(self, by: timedelta) -> None:
        self.offset += by

    def member_of(self, column: ColumnElement, values: Iterable) -> ColumnElement:
        """`column IN values`, sent as one parameter however many values there are.

        psycopg2 renders a Python list element by element into the SQL text; one array literal
        (PostgreSQL) or one JSON text (SQLite) keeps the statement short and its plan custom.
        """
        values_text = self.values_parameter(values)
        return self._member_of(column, bindparam(None, values_text, type_=Text, unique=True))

    def member_of_parameter(self, column: ColumnElement, name: str) -> ColumnElement:
        """`member_of` with the values left to the parameter `name`, for a statement built once
        and run many times; its value is `values_parameter(values)`."""
        return self._member_of(column, bindparam(name, type_=Text))

    def _member_of(self, column: ColumnElement, values_text) -> ColumnElement:
        if self.is_postgresql:
            return column == sql_any(cast(values_text, ARRAY(column.type)))
        return column.in_(select(func.json_each(values_text).table_valued("value").c.value))

    def values_parameter(self, values: Iterable) -> str:
        """The value of a `member_of_parameter` parameter."""
        values = list(values)
        return _pg_array_literal(values) if self.is_postgresql else json.dumps(values)

    def rowset(self, values: Iterable):
        """The values as a one-column table (`value`), sent as one parameter."""
        values = list(values)
        if self.is_postgresql:
            element = Text() if values and isinstance(values[0], str) else BigInteger()
            rows = func.unnest(cast(self._array_param(values), ARRAY(element)))
            return rows.table_valued("value").render_derived()
        rows = func.json_each(bindparam(None, json.dumps(values), type_=Text, unique=True))
        return rows.table_valued("value")

    def rowset_parameter(self, name: str):
        """`rowset` of text values left to the parameter `name` (its value is
        `values_parameter(values)`), for a statement built once and run many times."""
        values = bindparam(name, type_=Text)
        if self.is_postgresql:
            return func.unnest(cast(values, ARRAY(Text()))).table_valued("value").render_derived()
        return func.json_each(values).table_valued("value")

    @staticmethod
    def _array_param(values: list):
        return bindparam(None, _pg_array_literal(values), type_=Text, unique=True)

    def minus(self, timestamp: ColumnElement, duration: timedelta) -> ColumnElement:
        """`timestamp - duration`, computed by the database."""
        seconds = duration.total_seconds()
        if self.is_postgresql:
            return timestamp - func.make_interval(0, 0, 0, 0, 0, 0, seconds)
        return func.gc_minus_seconds(timestamp, seconds, type_=timestamp.type)

    def dispose(self) -> None:
        with self._held_lock:
            held, self._held = list(self._held.values()), {}
        for connection in held:
            connection.close()
        self.engine.dispose()
        if self.autocommit_engine is not None:
            self.autocommit_engine.dispose()


_NUMBERED = postgresql_psycopg2.dialect(paramstyle="numeric_dollar")


@functools.cache
def prepared_form(statement) -> tuple[str, tuple[str, ...], tuple, dict]:
    """`statement` as the text of a PREPARE (`(types) AS sql` with $n parameters), the names of
    its parameters in order, their bind processors, and the values of its constants."""
    compiled = statement.compile(dialect=_NUMBERED)
    names = tuple(compiled.positiontup)
    binds = [compiled.binds[name] for name in names]
    types = ", ".join(bind.type.compile(dialect=_NUMBERED) for bind in binds)
    processors = tuple(bind.type._cached_bind_processor(_NUMBERED) for bind in binds)
    return f"({types}) AS {compiled.string}", names, processors, dict(compiled.params)


def commit_without_waiting_column() -> ColumnElement:
    """`Database.commit_without_waiting` as a column (`relaxed`) of a statement the transaction
    runs anyway (PostgreSQL): the same effect, no round trip of its own."""
    return func.set_config("synchronous_commit", "off", True).label("relaxed")


def statement_clock() -> ColumnElement:
    """The control plane's time inside one PostgreSQL statement that decides by it: the start
    of the statement, plus the offset (`Database.clock_parameters` gives the values), or a pinned
    time where a test's clock replaces the database's."""
    return func.coalesce(
        bindparam("p_clock_pinned", type_=DateTime(timezone=True)),
        func.statement_timestamp() + bindparam("p_clock_offset", type_=Interval()),
        type_=DateTime(timezone=True),
    )


SQLITE_TIMESTAMP_FORMAT = "%Y-%m-%d %H:%M:%S.%f"  # how SQLAlchemy stores DateTime on SQLite


def _sqlite_minus_seconds(timestamp: str | None, seconds: float) -> str | None:
    if timestamp is None:
        return None
    shifted = datetime.fromisoformat(timestamp) - timedelta(seconds=seconds)
    return shifted.strftime(SQLITE_TIMESTAMP_FORMAT)


def _pg_array_literal(values: list) -> str:
    def element(value) -> str:
        if isinstance(value, str):
            return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return str(int(value))

    return "{" + ",".join(element(v) for v in values) + "}"
