"""Alembic upgrade and downgrade on a real Postgres; the migration matches the models."""

from __future__ import annotations

import asyncio

import asyncpg

from services.api.migrate import alembic_config, downgrade, upgrade
from services.api.models import Base
from services.common.embedded import asyncpg_dsn


async def _tables(url: str) -> set[str]:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        rows = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        return {r["tablename"] for r in rows}
    finally:
        await conn.close()


def _diff(url: str) -> list:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy.ext.asyncio import create_async_engine

    async def run() -> list:
        engine = create_async_engine(url)
        try:
            async with engine.connect() as conn:
                return await conn.run_sync(
                    lambda c: compare_metadata(MigrationContext.configure(c), Base.metadata)
                )
        finally:
            await engine.dispose()

    return asyncio.run(run())


def test_upgrade_downgrade_upgrade(fresh_database_url: str) -> None:
    url = fresh_database_url
    upgrade(url)
    tables = asyncio.run(_tables(url))
    assert set(Base.metadata.tables) <= tables
    assert _diff(url) == [], "models and migrations disagree"
    downgrade(url, "base")
    assert asyncio.run(_tables(url)) <= {"alembic_version"}
    upgrade(url)
    assert set(Base.metadata.tables) <= asyncio.run(_tables(url))


def test_policy_state_row_exists_after_upgrade(fresh_database_url: str) -> None:
    upgrade(fresh_database_url)

    async def row() -> tuple:
        conn = await asyncpg.connect(asyncpg_dsn(fresh_database_url))
        try:
            tenants = tuple(await conn.fetchrow("SELECT id, revision FROM tenant_state"))
            assert tenants == (1, 0), tenants
            return tuple(await conn.fetchrow("SELECT id, revision FROM policy_state"))
        finally:
            await conn.close()

    assert asyncio.run(row()) == (1, 0)


def test_single_head() -> None:
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(alembic_config("postgresql+asyncpg://x/y"))
    assert len(script.get_heads()) == 1


def test_stored_slo_aware_specs_lose_the_parameters_it_does_not_take(
    fresh_database_url: str,
) -> None:
    """Specs stored before 0004 were normalised with kv_aware's cost terms filled in (they
    changed nothing for slo_aware, which now refuses them): the migration removes them from
    versions, the active spec and canaries, leaves other policies' specs alone, and bumps the
    revision so the api republishes what routers run; the stored specs then validate."""
    import json

    from services.core.policy import validate_policy_spec

    url = fresh_database_url
    upgrade(url, "0003_tenants")
    dropped = {"uncached_weight": 2.0, "kv_pressure_weight": 256.0, "stall_tpot_weight": 25.0}
    slo = {"name": "slo_aware", "params": {**validate_policy_spec("slo_aware", {}), **dropped}}
    kv = {"name": "kv_aware", "params": validate_policy_spec("kv_aware", {})}

    async def run(*sql: str) -> list:
        conn = await asyncpg.connect(asyncpg_dsn(url))
        try:
            return [await conn.fetch(q) for q in sql]
        finally:
            await conn.close()

    j = json.dumps
    asyncio.run(
        run(
            "INSERT INTO policies (id, name, description, latest_version, created_by) VALUES "
            "(1, 'slo', '', 1, ''), (2, 'kv', '', 1, '')",
            f"INSERT INTO policy_versions (policy_id, version, spec, created_by) VALUES "
            f"(1, 1, '{j(slo)}', ''), (2, 1, '{j(kv)}', '')",
            f"UPDATE policy_state SET revision = 7, active_name = 'slo', active_version = 1, "
            f"active_spec = '{j(slo)}' WHERE id = 1",
            f"INSERT INTO canaries (id, state, candidate_name, candidate_version, candidate_spec,"
            f" control_name, control_version, control_spec, steps, step_duration_s, criteria,"
            f' step_index, "window", window_started_at, next_eval_at, reason, created_by) VALUES'
            f" ('c1', 'running', 'kv', 1, '{j(kv)}', 'slo', 1, '{j(slo)}', '[0.1]', 60, '{{}}',"
            f" 0, 0, 0, 0, '', '')",
        )
    )
    upgrade(url)
    versions, state, canary = asyncio.run(
        run(
            "SELECT policy_id, spec FROM policy_versions ORDER BY policy_id",
            "SELECT revision, active_spec FROM policy_state",
            "SELECT candidate_spec, control_spec FROM canaries",
        )
    )
    specs = [json.loads(r["spec"]) for r in versions]
    active = json.loads(state[0]["active_spec"])
    control = json.loads(canary[0]["control_spec"])
    for spec in (specs[0], active, control):
        assert spec["params"] == validate_policy_spec("slo_aware", spec["params"])
        assert not set(dropped) & set(spec["params"])
    assert specs[1] == kv and json.loads(canary[0]["candidate_spec"]) == kv
    assert state[0]["revision"] == 8
    downgrade(url, "0003_tenants")
    upgrade(url)  # nothing left to remove: the revision stays
    assert asyncio.run(run("SELECT revision FROM policy_state"))[0][0]["revision"] == 8
