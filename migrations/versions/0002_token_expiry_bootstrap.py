"""API tokens: an optional expiry (``expires_at``) and the ``bootstrap`` mark of the row that
records the environment's bootstrap admin token (KVGATE_API_ADMIN_TOKEN) by its digest, so
that it can be listed and revoked like any token.

Revision ID: 0002_token_expiry_bootstrap
Revises: 0001_admin_api
Create Date: 2027-01-12 09:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0002_token_expiry_bootstrap"
down_revision = "0001_admin_api"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("api_tokens", sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column(
        "api_tokens",
        sa.Column("bootstrap", sa.Boolean(), server_default=sa.text("false"), nullable=False),
    )


def downgrade() -> None:
    op.drop_column("api_tokens", "bootstrap")
    op.drop_column("api_tokens", "expires_at")
