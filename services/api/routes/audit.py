"""Audit route: ``GET /api/v1/audit``, the append-only log every mutating route writes.

Invariant: read-only; entries come newest first, filtered only by exact match on the
target type, target id and actor, and at most ``limit`` of them.
"""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta
from sqlalchemy import select

from services.api import audit, bodies
from services.api.context import ApiContext
from services.api.framework import Req, Route
from services.api.models import AuditEntry
from services.api.routes.common import V1


def routes(ctx: ApiContext) -> list[Route]:
    db = ctx.db

    async def list_audit(r: Req) -> dict[str, Any]:
        q = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(r.query.get("limit", 100))
        for key, col in (
            ("target_type", AuditEntry.target_type),
            ("target_id", AuditEntry.target_id),
            ("actor", AuditEntry.actor),
        ):
            if key in r.query:
                q = q.where(col == r.query[key])
        async with db.session() as s:
            return {"entries": [audit.audit_dict(e) for e in (await s.execute(q)).scalars()]}

    return [
        Route(
            "GET",
            f"{V1}/audit",
            list_audit,
            "audit log, newest first",
            "audit",
            query={
                # a filter is a value to match: never empty (an empty query value is refused)
                "target_type": Annotated[str, Meta(min_length=1, max_length=32)],
                "target_id": Annotated[str, Meta(min_length=1, max_length=256)],
                "actor": Annotated[str, Meta(min_length=1, max_length=128)],
                "limit": bodies.Limit,
            },
        ),
    ]
