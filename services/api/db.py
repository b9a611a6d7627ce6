"""Database access for the admin API: one async engine, sessions, and the rule that tells
"Postgres is unreachable" (-> HTTP 503, retried by itself) from real errors.

Invariant: the engine never caches a broken connection across requests (``pool_pre_ping``),
so once Postgres answers again the next request succeeds without a restart.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)


class DatabaseUnavailable(Exception):
    """Postgres cannot be reached or refuses service right now."""


def is_unavailable(exc: BaseException) -> bool:
    """True for errors that mean "the database is not there" rather than "bad request"."""
    if isinstance(exc, DatabaseUnavailable | sa_exc.TimeoutError | ConnectionError | OSError):
        return True
    if isinstance(exc, TimeoutError):
        return True
    if isinstance(exc, sa_exc.IntegrityError | sa_exc.DataError):
        return False
    if isinstance(exc, sa_exc.DBAPIError):
        return True  # operational / interface / connection-invalidated / missing database
    try:
        import asyncpg

        if isinstance(
            exc,
            asyncpg.PostgresConnectionError
            | asyncpg.InterfaceError
            | asyncpg.CannotConnectNowError
            | asyncpg.InvalidCatalogNameError
            | asyncpg.TooManyConnectionsError
            | asyncpg.AdminShutdownError,
        ):
            return True
    except ImportError:  # pragma: no cover - asyncpg is a dependency
        pass
    return False


class Database:
    def __init__(self, url: str, pool_size: int = 5, connect_timeout_s: float = 3.0) -> None:
        self.url = url
        self.engine: AsyncEngine = create_async_engine(
            url,
            pool_pre_ping=True,
            pool_size=pool_size,
            max_overflow=pool_size,
            pool_timeout=5,
            pool_recycle=300,
            connect_args={"timeout": connect_timeout_s, "command_timeout": 15},
        )
        self.sessions = async_sessionmaker(self.engine, expire_on_commit=False)

    @asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        async with self.sessions() as s:
            yield s

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncSession]:
        async with self.sessions() as s, s.begin():
            yield s

    async def ping(self) -> bool:
        from sqlalchemy import text

        try:
            async with self.engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
            return True
        except Exception as exc:
            if is_unavailable(exc):
                return False
            raise

    async def close(self) -> None:
        await self.engine.dispose()
