"""Tenants: tenants (versioned), their client API keys (sha256 digests), the directory
revision routers hold, and per-minute usage summed from router outcomes.

Revision ID: 0003_tenants
Revises: 0002_token_expiry_bootstrap
Create Date: 2027-02-01 09:00:00.000000
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003_tenants"
down_revision = "0002_token_expiry_bootstrap"
branch_labels = None
depends_on = None

TZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("spec", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("cache_salt", sa.String(length=64), nullable=False),
        sa.Column("created_at", TZ, server_default=sa.text("now()"), nullable=False),
        sa.Column("updated_at", TZ, server_default=sa.text("now()"), nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "tenant_versions",
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("spec", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("created_at", TZ, server_default=sa.text("now()"), nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("tenant_id", "version"),
    )
    op.create_table(
        "tenant_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("priority", sa.String(length=16), nullable=True),
        sa.Column(
            "allow_priority_header", sa.Boolean(), server_default=sa.text("false"), nullable=False
        ),
        sa.Column("created_at", TZ, server_default=sa.text("now()"), nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.Column("revoked_at", TZ, nullable=True),
        sa.Column("expires_at", TZ, nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("key_hash"),
    )
    op.create_index(op.f("ix_tenant_keys_tenant_id"), "tenant_keys", ["tenant_id"], unique=False)
    op.create_table(
        "tenant_state",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("revision", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", TZ, server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "tenant_usage",
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("minute", sa.BigInteger(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("errors", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("unreported_prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "minute"),
    )
    op.create_table(
        "tenant_usage_seen",
        sa.Column("stream_seq", sa.BigInteger(), nullable=False),
        sa.Column("stored_us", sa.BigInteger(), nullable=False),
        sa.Column("seen_at", TZ, server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("stream_seq", "stored_us"),
    )
    # the single tenant_state row (see services.api.models.TenantState)
    op.execute("INSERT INTO tenant_state (id, revision) VALUES (1, 0)")


def downgrade() -> None:
    op.drop_table("tenant_usage_seen")
    op.drop_table("tenant_usage")
    op.drop_table("tenant_state")
    op.drop_index(op.f("ix_tenant_keys_tenant_id"), table_name="tenant_keys")
    op.drop_table("tenant_keys")
    op.drop_table("tenant_versions")
    op.drop_table("tenants")
