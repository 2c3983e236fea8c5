"""The audit log records a batch of the collector's deletions in one row: `subjects` holds the
handles of one (batch, kind, worker, reason), and `subject` is then NULL (exactly one of the two
is set). On PostgreSQL `subjects` is `text[]`, stored out of line and uncompressed; on SQLite a
JSON array. Downgrading expands every batch row back into one row per handle.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

CHECK = "ck_audit_events_one_subject"
COLUMNS = ("at", "actor", "action", "kind", "worker_name", "reason", "dry_run")


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.add_column("audit_events", sa.Column("subjects", postgresql.ARRAY(sa.Text())))
        op.execute("ALTER TABLE audit_events ALTER COLUMN subjects SET STORAGE EXTERNAL")
        op.alter_column("audit_events", "subject", existing_type=sa.String(128), nullable=True)
        op.create_check_constraint(CHECK, "audit_events", "(subject IS NULL) <> (subjects IS NULL)")
        return
    with op.batch_alter_table("audit_events") as batch:
        batch.add_column(sa.Column("subjects", sa.Text()))
        batch.alter_column("subject", existing_type=sa.String(128), nullable=True)
        batch.create_check_constraint(CHECK, "(subject IS NULL) <> (subjects IS NULL)")


def downgrade() -> None:
    postgresql_ = op.get_bind().dialect.name == "postgresql"
    each = ", ".join(f"a.{column}" for column in COLUMNS)
    if postgresql_:
        handles = f"SELECT {each}, unnest(a.subjects) FROM audit_events a"
    else:
        handles = f"SELECT {each}, h.value FROM audit_events a, json_each(a.subjects) h"
    op.execute(
        f"INSERT INTO audit_events ({', '.join(COLUMNS)}, subject) {handles} "
        "WHERE a.subjects IS NOT NULL ORDER BY a.id"
    )
    op.execute("DELETE FROM audit_events WHERE subjects IS NOT NULL")
    if postgresql_:
        op.drop_constraint(CHECK, "audit_events", type_="check")
        op.alter_column("audit_events", "subject", existing_type=sa.String(128), nullable=False)
        op.drop_column("audit_events", "subjects")
        return
    with op.batch_alter_table("audit_events") as batch:
        batch.drop_constraint(CHECK, type_="check")
        batch.alter_column("subject", existing_type=sa.String(128), nullable=False)
        batch.drop_column("subjects")
