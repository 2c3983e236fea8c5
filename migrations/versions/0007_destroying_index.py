"""A worker's destroying rows from an index of their own: what a report that lists no handle of a
kind deletes (rule 9) and what the snapshot handed to a reporter lists are read without scanning
the worker's other rows (`ix_<kind>_worker_destroying` on (worker_name, handle), rows in
`destroying` only).

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

TABLES = ("containers", "volumes")
DESTROYING = "state = 'destroying'"


def upgrade() -> None:
    for table in TABLES:
        op.create_index(
            f"ix_{table}_worker_destroying",
            table,
            ["worker_name", "handle"],
            postgresql_where=sa.text(DESTROYING),
            sqlite_where=sa.text(DESTROYING),
        )


def downgrade() -> None:
    for table in TABLES:
        op.drop_index(f"ix_{table}_worker_destroying", table_name=table)
