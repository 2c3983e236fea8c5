"""Control-plane state: the collector's disruption mode (the safety brake of rule 12).

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "control_plane_state",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("disruption_since", sa.DateTime(timezone=True), nullable=True),
        sa.Column("disruption_reason", sa.Text(), nullable=True),
        sa.CheckConstraint("id = 1", name="ck_control_plane_state_single_row"),
        sa.PrimaryKeyConstraint("id"),
    )


def downgrade() -> None:
    op.drop_table("control_plane_state")
