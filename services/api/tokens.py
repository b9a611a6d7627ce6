"""API tokens: random secrets handed out once, stored only as sha256 digests, each with a
role (``viewer`` reads, ``admin`` also changes). An optional bootstrap admin token comes from
the environment (KVGATE_API_ADMIN_TOKEN) for compose deployments; it is never stored.

Invariant: a revoked token stops working within ``CACHE_S`` seconds on every replica.
"""

from __future__ import annotations

import hmac
import secrets
import time
from typing import Any

from sqlalchemy import select

from services.api.db import Database
from services.api.framework import Principal, hash_token
from services.api.models import ApiToken

TOKEN_PREFIX = "kvg_"
CACHE_S = 10.0


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_dict(row: ApiToken) -> dict[str, Any]:
    return {
        "id": row.id,
        "name": row.name,
        "role": row.role,
        "created_at": row.created_at.isoformat() if row.created_at else None,
        "revoked_at": row.revoked_at.isoformat() if row.revoked_at else None,
    }


async def create_token(db: Database, role: str, name: str = "") -> tuple[str, dict[str, Any]]:
    """Store a new token's digest; returns (the token, its record). The token is not kept."""
    if role not in ("viewer", "admin"):
        raise ValueError(f"role must be viewer or admin, not {role!r}")
    token = new_token()
    async with db.transaction() as s:
        row = ApiToken(name=name, token_hash=hash_token(token), role=role)
        s.add(row)
        await s.flush()
        await s.refresh(row)
        record = token_dict(row)
    return token, record


class TokenAuth:
    """Looks up bearer tokens (bootstrap token first, then Postgres, cached briefly)."""

    def __init__(self, db: Database, bootstrap_admin_token: str = "") -> None:
        self.db = db
        self._bootstrap = hash_token(bootstrap_admin_token) if bootstrap_admin_token else ""
        self._cache: dict[str, tuple[Principal | None, float]] = {}

    async def lookup(self, token: str) -> Principal | None:
        if len(token) > 512:
            return None
        digest = hash_token(token)
        if self._bootstrap and hmac.compare_digest(digest, self._bootstrap):
            return Principal("bootstrap-admin", "admin")
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and now - hit[1] < CACHE_S:
            return hit[0]
        async with self.db.session() as s:
            row = (
                await s.execute(
                    select(ApiToken).where(
                        ApiToken.token_hash == digest, ApiToken.revoked_at.is_(None)
                    )
                )
            ).scalar_one_or_none()
        principal = (
            Principal(f"token:{row.id}" + (f":{row.name}" if row.name else ""), row.role)
            if row is not None
            else None
        )
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[digest] = (principal, now)
        return principal

    def forget(self) -> None:
        self._cache.clear()
