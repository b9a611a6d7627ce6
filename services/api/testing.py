"""A real admin API (real Postgres, real NATS) inside a test's event loop, on a free port.

Used by tests/test_api*.py and usable from benchmarks. Nothing here is a fake: it runs the
migrations, starts :class:`services.api.app.ApiService`, and serves HTTP on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from services.api.app import ApiConfig, ApiService
from services.api.db import Database
from services.api.migrate import upgrade
from services.api.tokens import create_token
from services.common.embedded import free_port


async def migrate(database_url: str) -> None:
    """Alembic upgrade head (alembic's env runs its own event loop, hence the thread)."""
    await asyncio.to_thread(upgrade, database_url)


async def make_token(database_url: str, role: str, name: str = "") -> str:
    db = Database(database_url)
    try:
        token, _ = await create_token(db, role, name)
        return token
    finally:
        await db.close()


@dataclass
class ApiHarness:
    cfg: ApiConfig
    port: int = field(default_factory=free_port)
    service: ApiService | None = None
    runner: web.AppRunner | None = None
    session: aiohttp.ClientSession | None = None
    admin: str = ""
    viewer: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> ApiHarness:
        from services.common.service import start_http

        self.service = ApiService(self.cfg)
        app = await self.service.start()
        self.runner = await start_http(app, "127.0.0.1", self.port)
        if self.session is None:
            self.session = aiohttp.ClientSession()
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
        if self.service is not None:
            await self.service.stop()
            self.service = None

    async def close(self) -> None:
        await self.stop()
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        token: str | None = "admin",
        **kw: Any,
    ) -> tuple[int, Any]:
        """HTTP call; ``token`` is 'admin', 'viewer', a literal token, or None."""
        assert self.session is not None
        headers = dict(kw.pop("headers", {}) or {})
        tok = {"admin": self.admin, "viewer": self.viewer}.get(token or "", token)
        if tok:
            headers["Authorization"] = f"Bearer {tok}"
        url = path if path.startswith("http") else self.url + path
        async with self.session.request(method, url, json=body, headers=headers, **kw) as r:
            try:
                data = await r.json(content_type=None)
            except ValueError:
                data = await r.text()
            return r.status, data


async def start_api(
    database_url: str,
    nats_url: str,
    subject_prefix: str,
    *,
    migrate_first: bool = True,
    **cfg: Any,
) -> ApiHarness:
    if migrate_first:
        await migrate(database_url)
    config = ApiConfig(
        database_url=database_url,
        nats_url=nats_url,
        subject_prefix=subject_prefix,
        **{"eval_interval_s": 0.2, "flush_interval_s": 0.1, "republish_s": 1.0, **cfg},
    )
    h = ApiHarness(config)
    h.admin = await make_token(database_url, "admin", "test-admin")
    h.viewer = await make_token(database_url, "viewer", "test-viewer")
    return await h.start()
