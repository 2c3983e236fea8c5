"""Fixtures: a real database per test (a SQLite file, or a PostgreSQL schema of its own),
migrated with Alembic, and helpers that play workers and the scheduler."""

from __future__ import annotations

import contextlib
import itertools
import os
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import create_engine, event, text

from gcworker.control_plane import ControlPlane
from gcworker.db.database import Database
from gcworker.db.migrate import upgrade
from gcworker.messages import Heartbeat, Report
from gcworker.settings import load_settings

PG_ADMIN_URL = os.environ.get("GCWORKER_TEST_PG_URL", "postgresql+psycopg2://root@127.0.0.1/test")
BACKENDS = ("sqlite", "postgresql")


@pytest.fixture(scope="session")
def pg_admin_engine():
    engine = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    yield engine
    engine.dispose()


def _pg_schema_url(schema: str) -> str:
    return f"{PG_ADMIN_URL}?options=-csearch_path%3D{schema}"


@pytest.fixture
def database_url(request, tmp_path) -> str:
    """A fresh, empty database for this test, on the backend the test is parametrized with."""
    backend = getattr(request, "param", "sqlite")
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'gcworker.db'}"
    admin = request.getfixturevalue("pg_admin_engine")
    schema = "t_" + uuid.uuid4().hex[:16]
    with admin.connect() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    request.addfinalizer(lambda: _drop_schema(admin, schema))
    return _pg_schema_url(schema)


def _drop_schema(admin, schema: str) -> None:
    with admin.connect() as conn:
        conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))


def pytest_generate_tests(metafunc):
    """Every test that uses the database runs on both SQLite and PostgreSQL, unless it names one
    with `@pytest.mark.backends("postgresql")`."""
    if "database_url" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("backends")
        backends = marker.args if marker else BACKENDS
        metafunc.parametrize("database_url", backends, indirect=True)


def pytest_configure(config):
    config.addinivalue_line("markers", "backends(*names): run only on these database backends")


@pytest.fixture
def settings(database_url):
    return load_settings(database_url=database_url)


@pytest.fixture
def db(settings):
    database = Database.from_url(settings.database_url)
    upgrade(database.engine)
    yield database
    database.dispose()


@pytest.fixture
def plane(settings, db) -> ControlPlane:
    return ControlPlane(settings, db)


class FakeWorker:
    """Plays one worker: heartbeats and reports with a sequence number that only grows."""

    def __init__(self, plane: ControlPlane, name: str, *, ephemeral: bool = False):
        self.plane = plane
        self.name = name
        self.ephemeral = ephemeral
        self.incarnation = 1
        self._seq = itertools.count(1)

    def next_seq(self) -> int:
        return next(self._seq)

    def heartbeat_message(self, **fields) -> Heartbeat:
        fields.setdefault("seq", self.next_seq())
        return Heartbeat(
            worker=self.name, incarnation=self.incarnation, ephemeral=self.ephemeral, **fields
        )

    def report_message(self, containers=(), volumes=(), **fields) -> Report:
        """A report built now, dated as a reporter dates it: with the control plane's time it
        read before building it (rule 4). `after=None` makes an undated report."""
        fields.setdefault("seq", self.next_seq())
        if "after" not in fields:
            fields["after"] = self.plane.now()
        return Report(
            worker=self.name,
            incarnation=self.incarnation,
            containers=list(containers),
            volumes=list(volumes),
            **fields,
        )

    def heartbeat(self, **fields):
        return self.plane.reconciler.heartbeat(self.heartbeat_message(**fields))

    def report(self, containers=(), volumes=(), **fields):
        return self.plane.reconciler.report(self.report_message(containers, volumes, **fields))

    def restart(self):
        """A new incarnation (rule 7), announced by its first heartbeat."""
        self.incarnation += 1
        self._seq = itertools.count(1)
        return self.heartbeat()


@pytest.fixture
def make_worker(plane):
    def make(name: str = "w1", *, ephemeral: bool = False, heartbeat: bool = True) -> FakeWorker:
        worker = FakeWorker(plane, name, ephemeral=ephemeral)
        if heartbeat:
            worker.heartbeat()
        return worker

    return make


@pytest.fixture
def advance(db, plane):
    """Move the control plane's clock forward (no sleeping): advance(minutes=5)."""

    def move(**delta):
        db.advance(timedelta(**delta))

    return move


def states(plane: ControlPlane, kind: str = "container") -> dict[str, tuple[str, bool]]:
    """handle -> (state, marked missing) for every row of `kind`."""
    rows = plane.containers() if kind == "container" else plane.volumes()
    return {r["handle"]: (r["state"], r["missing_since"] is not None) for r in rows}


def created(plane: ControlPlane, worker: str, *handles: str, kind: str = "container") -> None:
    """The scheduler records and the worker creates each handle."""
    for handle in handles:
        if kind == "container":
            plane.scheduler.create_container(worker, handle)
            plane.scheduler.container_created(handle)
        else:
            plane.scheduler.create_volume(worker, handle)
            plane.scheduler.volume_created(handle)


@contextlib.contextmanager
def recorded_statements(db: Database, keep=lambda statement: True):
    """The list of the statements run on the database (on both of its engines) while inside,
    those that `keep(statement)` keeps."""
    seen: list[str] = []

    def record(_conn, _cursor, statement, *_args):
        if keep(statement):
            seen.append(statement)

    engines = [engine for engine in (db.engine, db.autocommit_engine) if engine is not None]
    for engine in engines:
        event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        for engine in engines:
            event.remove(engine, "before_cursor_execute", record)


@pytest.fixture
def board():
    """A destroying board (`gcworker.handoff`) on the test Redis, in a namespace of its own,
    signing and verifying with a control-plane key of its own."""
    import redis

    from gcworker.handoff import DestroyingBoard
    from gcworker.signing import generate_private_key, public_key_text
    from tests.pipeline_support import REDIS_URL

    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    key = generate_private_key()
    yield DestroyingBoard(client, namespace, signing_key=key, public_key=public_key_text(key))
    for key in client.scan_iter(f"{namespace}:*"):
        client.delete(key)
    client.close()


@pytest.fixture
def private_postgres():
    """A PostgreSQL cluster of this test's own (tests/fault_support.py), removed at the end."""
    from tests.fault_support import PrivatePostgres

    server = PrivatePostgres()
    try:
        server.start()
        yield server
    finally:
        server.remove()
