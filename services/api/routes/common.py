"""What every resource module of the admin API shares: the URL prefix, the timestamp format
and how a versioned resource lists its versions.

Invariant: every versioned path starts with :data:`V1`; timestamps leave the API as ISO 8601
strings (or null), never as database-native values.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

V1 = "/api/v1"


def iso(dt: datetime | None) -> str | None:
    return dt.isoformat() if dt else None


async def version_history(
    s: AsyncSession, version_model: Any, owner_column: Any, owner: Any
) -> list[dict[str, Any]]:
    """Every version of one versioned resource (a policy, a tenant), oldest first:
    ``version``, ``spec``, ``created_at``, ``created_by``."""
    rows = (
        await s.execute(
            select(version_model).where(owner_column == owner).order_by(version_model.version)
        )
    ).scalars()
    return [
        {
            "version": v.version,
            "spec": v.spec,
            "created_at": iso(v.created_at),
            "created_by": v.created_by,
        }
        for v in rows
    ]
