"""Alembic environment: async SQLAlchemy (asyncpg). The URL comes from the alembic Config
(set by ``kvgate migrate`` from KVGATE_DATABASE_URL), never from a file in the repo."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.ext.asyncio import create_async_engine

config = context.config

try:  # the admin API's models, once they exist
    from services.api.models import Base

    target_metadata = Base.metadata
except ImportError:  # pragma: no cover - before the API models land
    target_metadata = None


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


async def _run_async() -> None:
    engine = create_async_engine(config.get_main_option("sqlalchemy.url"))
    async with engine.connect() as conn:
        await conn.run_sync(_run)
        await conn.commit()
    await engine.dispose()


if context.is_offline_mode():
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_run_async())
