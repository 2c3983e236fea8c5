"""The worker index of `containers` and `volumes` covers what a report's diff reads (state,
missing_since, handle), so that PostgreSQL reads a worker's rows from the index alone.

Revision ID: 0004
Revises: 0003
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

COVERED = ["state", "missing_since", "handle"]


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return  # SQLite has no INCLUDE: its plain index stays
    for table in ("containers", "volumes"):
        op.drop_index(f"ix_{table}_worker_name", table_name=table)
        op.create_index(
            f"ix_{table}_worker_name", table, ["worker_name"], postgresql_include=COVERED
        )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in ("containers", "volumes"):
        op.drop_index(f"ix_{table}_worker_name", table_name=table)
        op.create_index(f"ix_{table}_worker_name", table, ["worker_name"])
