"""Meta routes: ``/health`` (also under ``/api/v1``) and ``/api/v1/openapi.json``.

Invariants: both are public (no token); health never fails because a dependency is down,
it reports it (``degraded``); the OpenAPI document is built from the very route table the
server installs, so it cannot describe a route that is not served or miss one that is.
"""

from __future__ import annotations

from typing import Any

from services.api.context import ApiContext
from services.api.framework import Req, Route
from services.api.routes.common import V1


def routes(ctx: ApiContext, table: list[Route]) -> list[Route]:
    """``table`` is the complete route list; the OpenAPI handler reads it when called."""
    db = ctx.db

    async def health(_r: Req) -> dict[str, Any]:
        ok = await db.ping()
        return {
            "status": "ok" if ok else "degraded",
            "database": "ok" if ok else "unavailable",
            "bus": "ok" if ctx.bus.is_connected else "disconnected",
        }

    async def openapi(_r: Req) -> dict[str, Any]:
        from services.api.openapi import build_document

        return build_document(table, ctx.policy_schemas)

    return [
        Route("GET", "/health", health, "liveness and dependencies", "meta", role="public"),
        Route("GET", f"{V1}/health", health, "liveness and dependencies", "meta", role="public"),
        Route("GET", f"{V1}/openapi.json", openapi, "this document", "meta", role="public"),
    ]
