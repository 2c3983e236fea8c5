"""The schema as SQLAlchemy Core tables: workers, their tombstones, containers, volumes and the
audit log.

Alembic migrations in `migrations/` create exactly this schema (a test compares the two); the
repositories build every statement from these tables.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

from sqlalchemy import (
    DDL,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    event,
    text,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.types import DateTime, TypeDecorator

metadata = MetaData()

WORKER_STATES = ("running", "stalled", "landing", "landed", "retiring")
ROW_STATES = ("creating", "created", "destroying", "failed")


class UTCDateTime(TypeDecorator):
    """A timestamp that is always UTC and always timezone-aware in Python.

    PostgreSQL stores `timestamptz`; SQLite stores the naive UTC text SQLAlchemy writes, which
    compares correctly as text because every value has the same format.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given where a UTC timestamp is required")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value, dialect):
        if value is None:
            return None
        if isinstance(value, str):
            value = datetime.fromisoformat(value)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


workers = Table(
    "workers",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("state", String(16), nullable=False),
    Column("ephemeral", Boolean, nullable=False, server_default=text("false")),
    Column("incarnation", BigInteger, nullable=False),
    # Sequence numbers of the current incarnation: heartbeats and reports share one counter.
    Column("last_heartbeat_seq", BigInteger, nullable=True),
    Column("last_report_seq", BigInteger, nullable=True),
    # The sequence number of the heartbeat that began the current running period (rule 2).
    Column("running_since_seq", BigInteger, nullable=True),
    Column("running_since", UTCDateTime, nullable=True),
    Column("heartbeat_expires_at", UTCDateTime, nullable=False),
    Column("stalled_at", UTCDateTime, nullable=True),
    # When the last report that was allowed to mark arrived (the confirmation of rule 4).
    Column("last_report_at", UTCDateTime, nullable=True),
    Column("last_worker_clock", UTCDateTime, nullable=True),
    # Bumped by every change to the worker or its rows; lets an unchanged report skip the diff.
    Column("generation", BigInteger, nullable=False, server_default=text("0")),
    Column("report_digest", String(64), nullable=True),
    Column("report_generation", BigInteger, nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("state_changed_at", UTCDateTime, nullable=False),
    CheckConstraint(
        "state IN ('running', 'stalled', 'landing', 'landed', 'retiring')", name="ck_workers_state"
    ),
)


# What is left of a deleted worker (rule 16): its last incarnation, the highest sequence number
# it had sent, and why and when it was deleted. A message of that name is accepted again only
# from a higher incarnation (a restarted worker, rule 7): an older or equal one is a replay.
worker_tombstones = Table(
    "worker_tombstones",
    metadata,
    Column("worker_name", String(64), primary_key=True),
    Column("incarnation", BigInteger, nullable=False),
    Column("last_seq", BigInteger, nullable=True),
    Column("reason", Text, nullable=False),
    Column("deleted_at", UTCDateTime, nullable=False),
)

_DIFF_COLUMNS = ["state", "missing_since", "handle"]
ORPHANED = "container_owned AND container_id IS NULL AND state = 'created'"


def _inventory_schema(kind: str) -> list:
    """The columns, constraints and indexes containers and volumes share."""
    return [
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("handle", String(128), nullable=False, unique=True),
        Column(
            "worker_name",
            String(64),
            ForeignKey("workers.name", ondelete="CASCADE"),
            nullable=False,
        ),
        Column("state", String(16), nullable=False),
        Column("missing_since", UTCDateTime, nullable=True),
        Column("created_at", UTCDateTime, nullable=False),
        Column("state_changed_at", UTCDateTime, nullable=False),
        CheckConstraint(
            "state IN ('creating', 'created', 'destroying', 'failed')", name=f"ck_{kind}_state"
        ),
        CheckConstraint(
            "missing_since IS NULL OR state = 'created'", name=f"ck_{kind}_missing_only_created"
        ),
        # Covers what a report's diff reads: a worker's rows come from the index alone.
        Index(f"ix_{kind}_worker_name", "worker_name", postgresql_include=_DIFF_COLUMNS),
        # A worker's marked rows in mark order: the collector counts and deletes a worker's
        # candidates (rule 4) from it alone (migration 0006).
        Index(
            f"ix_{kind}_worker_missing_since",
            "worker_name",
            "missing_since",
            postgresql_where=text("missing_since IS NOT NULL"),
            sqlite_where=text("missing_since IS NOT NULL"),
        ),
        # The few rows in creating or failed, for rule 10's statements (migration 0006).
        *(
            Index(
                f"ix_{kind}_{state}",
                "state_changed_at",
                postgresql_where=text(f"state = '{state}'"),
                sqlite_where=text(f"state = '{state}'"),
            )
            for state in ("creating", "failed")
        ),
        # A worker's destroying rows, for rule 9 and the snapshot a reporter reads (migration
        # 0007).
        Index(
            f"ix_{kind}_worker_destroying",
            "worker_name",
            "handle",
            postgresql_where=text("state = 'destroying'"),
            sqlite_where=text("state = 'destroying'"),
        ),
    ]


containers = Table(
    "containers",
    metadata,
    *_inventory_schema("containers"),
)

volumes = Table(
    "volumes",
    metadata,
    *_inventory_schema("volumes"),
    Column("parent_id", Integer, ForeignKey("volumes.id", ondelete="CASCADE"), nullable=True),
    Column(
        "container_id", Integer, ForeignKey("containers.id", ondelete="SET NULL"), nullable=True
    ),
    # True for a volume made for a container: once that container's row is gone, it is orphaned.
    Column("container_owned", Boolean, nullable=False, server_default=text("false")),
    Index("ix_volumes_parent_id", "parent_id"),
    Index("ix_volumes_container_id", "container_id"),
    # Container-owned volumes whose container's row is gone: the orphaned-volume collector's
    # candidates, none most of the time (migration 0006).
    Index(
        "ix_volumes_orphaned",
        "id",
        postgresql_where=text(ORPHANED),
        sqlite_where=text(ORPHANED),
    ),
)


class HandleList(TypeDecorator):
    """A list of handles: `text[]` on PostgreSQL, a JSON array in SQLite's text."""

    impl = Text
    cache_ok = True

    def load_dialect_impl(self, dialect):
        if dialect.name == "postgresql":
            return dialect.type_descriptor(postgresql.ARRAY(Text))
        return dialect.type_descriptor(Text())

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        return list(value) if dialect.name == "postgresql" else json.dumps(list(value))

    def process_result_value(self, value, dialect):
        if value is None:
            return None
        return list(value) if dialect.name == "postgresql" else json.loads(value)


AUDIT_SUBJECTS_STORAGE = "ALTER TABLE audit_events ALTER COLUMN subjects SET STORAGE EXTERNAL"

audit_events = Table(
    "audit_events",
    metadata,
    Column(
        "id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    ),
    Column("at", UTCDateTime, nullable=False),
    Column("actor", String(16), nullable=False),
    Column("action", String(32), nullable=False),
    Column("kind", String(16), nullable=False),
    # One subject (a handle, a worker), or the handles of one batch (`subjects`): one row per
    # (batch, kind, worker, reason) of the collector's deletions. Listings expand them.
    Column("subject", String(128), nullable=True),
    Column("subjects", HandleList, nullable=True),
    Column("worker_name", String(64), nullable=True),
    Column("reason", Text, nullable=False),
    Column("dry_run", Boolean, nullable=False, server_default=text("false")),
    CheckConstraint("(subject IS NULL) <> (subjects IS NULL)", name="ck_audit_events_one_subject"),
    Index("ix_audit_events_at", "at"),
)
# A batch's handles are written once and compress little: stored out of line, uncompressed
# (migration 0005 does the same), so that a batch's audit costs no compression in its statement.
event.listen(
    audit_events,
    "after_create",
    DDL(AUDIT_SUBJECTS_STORAGE).execute_if(dialect="postgresql"),
)

INVENTORY_TABLES = {"container": containers, "volume": volumes}

# One row (id = 1): whether the collector is in disruption mode (rule 12), since when and why.
control_plane_state = Table(
    "control_plane_state",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("disruption_since", UTCDateTime, nullable=True),
    Column("disruption_reason", Text, nullable=True),
    CheckConstraint("id = 1", name="ck_control_plane_state_single_row"),
)

# Workers' Ed25519 public keys (base64 of the 32 raw bytes); a revoked key verifies nothing.
worker_keys = Table(
    "worker_keys",
    metadata,
    Column("worker_name", String(64), primary_key=True),
    Column("public_key", String(64), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("revoked_at", UTCDateTime, nullable=True),
)

# Rejected messages with the reason, newest kept, bounded in number.
dead_letters = Table(
    "dead_letters",
    metadata,
    Column(
        "id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    ),
    Column("at", UTCDateTime, nullable=False),
    Column("worker_name", String(64), nullable=True),
    Column("reason", Text, nullable=False),
    Column("excerpt", Text, nullable=False),
)
