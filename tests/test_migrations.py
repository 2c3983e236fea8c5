"""Schema changes are Alembic migrations only: they upgrade and downgrade on both backends, and the
migrated schema is exactly `gcworker.db.tables`."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from gcworker.db.audit import AuditEntry, AuditRepository
from gcworker.db.database import Database
from gcworker.db.migrate import (
    SchemaOutOfDate,
    current_revision,
    downgrade,
    head_revision,
    require_current,
    upgrade,
)
from gcworker.db.tables import metadata


@pytest.fixture
def engine(database_url):
    database = Database.from_url(database_url)
    yield database.engine
    database.dispose()


def gcworker_tables(engine) -> set[str]:
    return set(inspect(engine).get_table_names()) - {"alembic_version"}


def test_migrations_upgrade_to_head_downgrade_to_base_and_upgrade_again(engine):
    assert current_revision(engine) is None

    assert upgrade(engine) == (None, head_revision())
    assert gcworker_tables(engine) == set(metadata.tables)

    downgrade(engine, "base")
    assert current_revision(engine) is None
    assert gcworker_tables(engine) == set()

    upgrade(engine)
    assert current_revision(engine) == head_revision()
    assert gcworker_tables(engine) == set(metadata.tables)


def test_migrations_upgrade_is_safe_to_run_twice(engine):
    upgrade(engine)

    assert upgrade(engine) == (head_revision(), head_revision())
    assert gcworker_tables(engine) == set(metadata.tables)


def test_migrations_every_step_downgrades_and_upgrades_again(engine):
    upgrade(engine)
    revisions = []
    while (revision := current_revision(engine)) is not None:
        revisions.append(revision)
        downgrade(engine, "-1")
    assert revisions and revisions[0] == head_revision()

    for revision in reversed(revisions):
        upgrade(engine, revision)
        assert current_revision(engine) == revision


def test_migrations_the_migrated_schema_matches_the_tables_metadata(engine):
    upgrade(engine)

    with engine.connect() as conn:
        differences = compare_metadata(MigrationContext.configure(conn), metadata)

    assert differences == []


def test_migrations_commands_refuse_a_database_that_is_not_migrated(engine):
    with pytest.raises(SchemaOutOfDate, match="gcworker migrate"):
        require_current(engine)
    upgrade(engine)
    require_current(engine)


def test_migrations_downgrading_0005_expands_a_batch_audit_row_into_one_row_per_handle(engine):
    upgrade(engine)
    with engine.begin() as conn:
        AuditRepository().record(
            conn,
            [
                AuditEntry.batch("delete", "container", ["c2", "c1"], "missing", "w1"),
                AuditEntry("stall", "worker", "w1", "heartbeat expired"),
            ],
            actor="collector",
            now=datetime(2030, 1, 1, tzinfo=UTC),
        )

    downgrade(engine, "0004")

    with engine.connect() as conn:
        rows = conn.execute(text("SELECT action, subject, worker_name FROM audit_events")).all()
    assert sorted(map(tuple, rows)) == [
        ("delete", "c1", "w1"),
        ("delete", "c2", "w1"),
        ("stall", "w1", None),
    ]
    upgrade(engine)
    assert current_revision(engine) == head_revision()
