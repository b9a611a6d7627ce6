"""Database access for the admin API: one async engine, sessions, and the rule that tells
"Postgres is unreachable" (-> HTTP 503, retried by itself) from real errors.

Invariants:
- The engine never caches a broken connection across requests (``pool_pre_ping``), so once
  Postgres answers again the next request succeeds without a restart.
- Getting a connection takes at most ``acquire_timeout_s``: a Postgres that does not answer
  (frozen, network partition: connections stay open, nothing comes back) makes the request
  fail with :class:`DatabaseUnavailable` (HTTP 503) within that time, not after the 15 s
  command timeout. The stuck attempt is abandoned, not awaited (it ends by itself).
- Once unavailable, requests fail at once (no connection attempt) until a background probe,
  on its own connection outside the pool, gets an answer (every ``retry_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from services.common.logging import get_logger

log = get_logger("api.db")
T = TypeVar("T")


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
    def __init__(
        self,
        url: str,
        pool_size: int = 5,
        connect_timeout_s: float = 3.0,
        acquire_timeout_s: float = 1.0,
        retry_s: float = 1.0,
    ) -> None:
        self.url = url
        self.acquire_timeout_s = acquire_timeout_s
        self.retry_s = retry_s
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
        self.down_since: float | None = None  # monotonic; None while Postgres answers
        self._probe: asyncio.Task[None] | None = None
        self._abandoned: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ bounded waits
    async def _bounded(self, make: Callable[[], Awaitable[T]], what: str) -> T:
        """Run ``make()`` for at most ``acquire_timeout_s``; past that, leave it running on
        its own (cancelling a pooled asyncpg connection mid-ping would wait for its close)
        and report the database unavailable."""
        if self.down_since is not None:
            self._ensure_probe()
            raise DatabaseUnavailable(
                f"PostgreSQL unavailable for {time.monotonic() - self.down_since:.0f} s; "
                "retrying in the background"
            )
        task = asyncio.ensure_future(make())
        try:
            done, _ = await asyncio.wait({task}, timeout=self.acquire_timeout_s)
        except asyncio.CancelledError:  # the request went away: whatever comes is given back
            self._abandon(task)
            raise
        if not done:
            self._abandon(task)
            self._mark_down(f"{what}: no answer in {self.acquire_timeout_s} s")
            raise DatabaseUnavailable(
                f"PostgreSQL did not answer within {self.acquire_timeout_s} s"
            )
        try:
            return task.result()
        except Exception as exc:
            if is_unavailable(exc):
                self._mark_down(f"{what}: {type(exc).__name__}")
            raise

    def _abandon(self, task: asyncio.Task[Any]) -> None:
        self._abandoned.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._abandoned.discard(t)
            if t.cancelled() or t.exception() is not None:
                return
            conn = t.result()
            if isinstance(conn, AsyncConnection):  # it answered after all: give it back
                closing = asyncio.ensure_future(conn.close())
                self._abandoned.add(closing)
                closing.add_done_callback(self._abandoned.discard)

        task.add_done_callback(done)

    def _mark_down(self, why: str) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            log.warning("database unavailable; failing fast until it answers", reason=why)
        self._ensure_probe()

    def _ensure_probe(self) -> None:
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._probe_until_up())

    async def _probe_until_up(self) -> None:
        """Ask Postgres on a connection of our own (not the pool's) until it answers."""
        import asyncpg

        dsn = self.url.replace("postgresql+asyncpg://", "postgresql://", 1)
        while self.down_since is not None:
            await asyncio.sleep(self.retry_s)
            conn = None
            try:
                conn = await asyncpg.connect(dsn, timeout=self.acquire_timeout_s)
                await conn.fetchval("SELECT 1", timeout=self.acquire_timeout_s)
            except Exception as exc:  # still down (or refusing): try again later
                if not is_unavailable(exc) and not isinstance(exc, asyncpg.PostgresError):
                    log.warning("database probe failed", error=repr(exc)[:200])
                continue
            finally:
                if conn is not None:
                    conn.terminate()  # no goodbye round trip to a server that may freeze
            log.info(
                "database available again",
                down_s=round(time.monotonic() - (self.down_since or time.monotonic()), 1),
            )
            self.down_since = None

    # ------------------------------------------------------------------ sessions
    async def _connect(self) -> AsyncConnection:
        return await self._bounded(self.engine.connect, "connect")

    @asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        conn = await self._connect()
        try:
            async with self.sessions(bind=conn) as s:
                yield s
        finally:
            await conn.close()

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncSession]:
        conn = await self._connect()
        try:
            async with self.sessions(bind=conn) as s, s.begin():
                yield s
        finally:
            await conn.close()

    async def ping(self) -> bool:
        from sqlalchemy import text

        async def select_one() -> bool:
            async with self.engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
            return True

        try:
            return await self._bounded(select_one, "ping")
        except Exception as exc:
            if is_unavailable(exc):
                return False
            raise

    async def close(self) -> None:
        for t in (self._probe, *self._abandoned):
            if t is not None and not t.done():
                t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.engine.dispose(), 5)
