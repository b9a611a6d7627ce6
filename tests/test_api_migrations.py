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
