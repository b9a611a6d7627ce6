"""``slo_aware`` no longer takes ``kv_aware``'s cost terms (``uncached_weight``,
``kv_pressure_weight``, ``stall_tpot_weight``): its latency-model cost never used them, and a
spec naming one is now refused. Stored specs were normalised with every default filled in, so
each stored ``slo_aware`` spec names all three; they are removed here (the policy they describe
is the same: the keys changed nothing), from the policy versions, the active spec and the
canaries' specs. When the active spec or an open canary's changes, the policy-state revision
is bumped, so the api republishes the notice routers read (a router would refuse the old one).

Revision ID: 0004_slo_aware_not_taken
Revises: 0003_tenants
Create Date: 2026-11-28 19:30:00.000000
"""

from alembic import op

revision = "0004_slo_aware_not_taken"
down_revision = "0003_tenants"
branch_labels = None
depends_on = None

KEYS = "ARRAY['uncached_weight', 'kv_pressure_weight', 'stall_tpot_weight']"


def _stripped(col: str) -> str:
    return f"jsonb_set({col}, '{{params}}', ({col} -> 'params') - {KEYS})"


def _names_one(col: str) -> str:
    return (
        f"{col} ->> 'name' = 'slo_aware' AND jsonb_typeof({col} -> 'params') = 'object' "
        f"AND jsonb_exists_any({col} -> 'params', {KEYS})"
    )


def upgrade() -> None:
    # the notice routers read changes: bump the revision first (it reads the specs as stored)
    op.execute(
        "UPDATE policy_state SET revision = revision + 1, updated_at = now() WHERE id = 1 AND ("
        f"({_names_one('active_spec')}) OR EXISTS (SELECT 1 FROM canaries WHERE "
        f"state IN ('running', 'paused') AND {_names_one('candidate_spec')}))"
    )
    op.execute(f"UPDATE policy_versions SET spec = {_stripped('spec')} WHERE {_names_one('spec')}")
    op.execute(
        f"UPDATE policy_state SET active_spec = {_stripped('active_spec')} "
        f"WHERE {_names_one('active_spec')}"
    )
    for col in ("candidate_spec", "control_spec"):
        op.execute(f"UPDATE canaries SET {col} = {_stripped(col)} WHERE {_names_one(col)}")


def downgrade() -> None:
    # nothing to restore: the earlier schema fills the removed keys with their defaults, and
    # slo_aware never read them
    pass
