"""Indexes for the collector, so that a collection reads only what it changes:

- `ix_<kind>_worker_missing_since` (worker_name, missing_since) on marked rows replaces
  `ix_<kind>_missing_since`: a worker's rule-4 candidates are one range of it, counted from the
  index alone and deleted by (worker, cutoff), as the unbatched DELETE would;
- `ix_<kind>_creating` and `ix_<kind>_failed` (state_changed_at) on the rows in those states
  (rule 10);
- `ix_volumes_orphaned` on container-owned volumes without a container (orphaned volumes).

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

TABLES = ("containers", "volumes")
WORKER_MISSING = ["worker_name", "missing_since"]
MARKED = "missing_since IS NOT NULL"
ORPHANED = "container_owned AND container_id IS NULL AND state = 'created'"


def _partial(name: str, table: str, columns: list[str], where: str) -> None:
    op.create_index(
        name, table, columns, postgresql_where=sa.text(where), sqlite_where=sa.text(where)
    )


def upgrade() -> None:
    for table in TABLES:
        op.drop_index(f"ix_{table}_missing_since", table_name=table)
        _partial(f"ix_{table}_worker_missing_since", table, WORKER_MISSING, MARKED)
        for state in ("creating", "failed"):
            _partial(f"ix_{table}_{state}", table, ["state_changed_at"], f"state = '{state}'")
    _partial("ix_volumes_orphaned", "volumes", ["id"], ORPHANED)


def downgrade() -> None:
    op.drop_index("ix_volumes_orphaned", table_name="volumes")
    for table in TABLES:
        for state in ("creating", "failed"):
            op.drop_index(f"ix_{table}_{state}", table_name=table)
        op.drop_index(f"ix_{table}_worker_missing_since", table_name=table)
        _partial(f"ix_{table}_missing_since", table, ["missing_since"], MARKED)
