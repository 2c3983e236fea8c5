"""Deleted workers stay deleted (rule 16): `worker_tombstones` keeps, per deleted worker name, its
last incarnation, the highest sequence number it had sent, and why and when it was deleted, so
that its old messages, replayed, are rejected.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "worker_tombstones",
        sa.Column("worker_name", sa.String(length=64), nullable=False),
        sa.Column("incarnation", sa.BigInteger(), nullable=False),
        sa.Column("last_seq", sa.BigInteger(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("worker_name"),
    )


def downgrade() -> None:
    op.drop_table("worker_tombstones")
