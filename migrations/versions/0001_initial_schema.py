"""Initial schema: workers, containers, volumes and the audit log.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "audit_events",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(length=16), nullable=False),
        sa.Column("action", sa.String(length=32), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("subject", sa.String(length=128), nullable=False),
        sa.Column("worker_name", sa.String(length=64), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("dry_run", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_audit_events_at", "audit_events", ["at"], unique=False)
    op.create_table(
        "workers",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("ephemeral", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("incarnation", sa.BigInteger(), nullable=False),
        sa.Column("last_heartbeat_seq", sa.BigInteger(), nullable=True),
        sa.Column("last_report_seq", sa.BigInteger(), nullable=True),
        sa.Column("running_since_seq", sa.BigInteger(), nullable=True),
        sa.Column("running_since", sa.DateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("stalled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_report_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_worker_clock", sa.DateTime(timezone=True), nullable=True),
        sa.Column("generation", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("report_digest", sa.String(length=64), nullable=True),
        sa.Column("report_generation", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("state_changed_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "state IN ('running', 'stalled', 'landing', 'landed', 'retiring')",
            name="ck_workers_state",
        ),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "containers",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("handle", sa.String(length=128), nullable=False),
        sa.Column("worker_name", sa.String(length=64), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("missing_since", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("state_changed_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "missing_since IS NULL OR state = 'created'", name="ck_containers_missing_only_created"
        ),
        sa.CheckConstraint(
            "state IN ('creating', 'created', 'destroying', 'failed')", name="ck_containers_state"
        ),
        sa.ForeignKeyConstraint(["worker_name"], ["workers.name"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("handle"),
    )
    op.create_index(
        "ix_containers_missing_since",
        "containers",
        ["missing_since"],
        unique=False,
        postgresql_where=sa.text("missing_since IS NOT NULL"),
        sqlite_where=sa.text("missing_since IS NOT NULL"),
    )
    op.create_index("ix_containers_worker_name", "containers", ["worker_name"], unique=False)
    op.create_table(
        "volumes",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("handle", sa.String(length=128), nullable=False),
        sa.Column("worker_name", sa.String(length=64), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("missing_since", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("state_changed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("parent_id", sa.Integer(), nullable=True),
        sa.Column("container_id", sa.Integer(), nullable=True),
        sa.Column("container_owned", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.CheckConstraint(
            "missing_since IS NULL OR state = 'created'", name="ck_volumes_missing_only_created"
        ),
        sa.CheckConstraint(
            "state IN ('creating', 'created', 'destroying', 'failed')", name="ck_volumes_state"
        ),
        sa.ForeignKeyConstraint(["container_id"], ["containers.id"], ondelete="SET NULL"),
        sa.ForeignKeyConstraint(["parent_id"], ["volumes.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["worker_name"], ["workers.name"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("handle"),
    )
    op.create_index("ix_volumes_container_id", "volumes", ["container_id"], unique=False)
    op.create_index(
        "ix_volumes_missing_since",
        "volumes",
        ["missing_since"],
        unique=False,
        postgresql_where=sa.text("missing_since IS NOT NULL"),
        sqlite_where=sa.text("missing_since IS NOT NULL"),
    )
    op.create_index("ix_volumes_parent_id", "volumes", ["parent_id"], unique=False)
    op.create_index("ix_volumes_worker_name", "volumes", ["worker_name"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_volumes_worker_name", table_name="volumes")
    op.drop_index("ix_volumes_parent_id", table_name="volumes")
    op.drop_index(
        "ix_volumes_missing_since",
        table_name="volumes",
        postgresql_where=sa.text("missing_since IS NOT NULL"),
        sqlite_where=sa.text("missing_since IS NOT NULL"),
    )
    op.drop_index("ix_volumes_container_id", table_name="volumes")
    op.drop_table("volumes")
    op.drop_index("ix_containers_worker_name", table_name="containers")
    op.drop_index(
        "ix_containers_missing_since",
        table_name="containers",
        postgresql_where=sa.text("missing_since IS NOT NULL"),
        sqlite_where=sa.text("missing_since IS NOT NULL"),
    )
    op.drop_table("containers")
    op.drop_table("workers")
    op.drop_index("ix_audit_events_at", table_name="audit_events")
    op.drop_table("audit_events")
