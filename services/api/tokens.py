"""API tokens: random secrets handed out once, stored only as sha256 digests, each with a
role (``viewer`` reads, ``admin`` also changes) and an optional expiry. The bootstrap admin
token from the environment (KVGATE_API_ADMIN_TOKEN, set by compose or ``kvgate up``) is
recorded by its digest in a ``bootstrap`` row named ``bootstrap-admin``, so it is listed and
revoked like any token; the secret itself is never stored.

Invariants:
- A token is accepted only while its row is neither revoked nor expired. A revoked or expired
  token stops working within ``CACHE_S`` seconds on every replica (at once on the replica
  that revoked it); an expired one at its ``expires_at`` exactly, cached or not.
- The bootstrap token is accepted only by a replica whose environment holds it, and only
  while its row is not revoked. A revocation is kept by digest, so it survives restarts even
  though the environment still holds the token; a new value in the environment makes a new
  row. Rows of earlier environment values work nowhere that is not configured with them.
- While Postgres is unreachable, the bootstrap token keeps the state this replica last read
  (none read yet: the request fails as the database's, 503).
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert

from services.api import audit
from services.api.db import Database, is_unavailable
from services.api.framework import Principal, Refusal, hash_token
from services.api.models import ApiToken
from services.common.logging import RateLimiter, get_logger

log = get_logger("api.tokens")

TOKEN_PREFIX = "kvg_"
CACHE_S = 10.0
MAX_TOKEN_CHARS = 512
BOOTSTRAP_NAME = "bootstrap-admin"  # its row's name and the actor of what it does
REGISTER_RETRY_S = 2.0


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_dict(row: ApiToken) -> dict[str, Any]:
    return {
        "id": row.id,
        "name": row.name,
        "role": row.role,
        "created_at": row.created_at.isoformat() if row.created_at else None,
        "revoked_at": row.revoked_at.isoformat() if row.revoked_at else None,
        "expires_at": row.expires_at.isoformat() if row.expires_at else None,
        "state": token_state(row),
        "bootstrap": bool(row.bootstrap),
    }


def token_state(row: ApiToken, now: datetime | None = None) -> str:
    """``active``, ``revoked`` or ``expired`` (revoked wins: it is the deliberate act)."""
    if row.revoked_at is not None:
        return "revoked"
    if row.expires_at is not None and row.expires_at <= (now or datetime.now(UTC)):
        return "expired"
    return "active"


def effective_ttl(ttl_s: float | None, max_ttl_s: float = 0.0) -> float | None:
    """The lifetime a new token gets: ``ttl_s`` (None: no expiry) within ``max_ttl_s``
    (> 0: the longest allowed, and the default when no TTL is asked for)."""
    if max_ttl_s > 0:
        if ttl_s is None:
            return max_ttl_s
        if ttl_s > max_ttl_s:
            raise ValueError(f"ttl_s may be at most {max_ttl_s:g} s (the server's maximum)")
    return ttl_s


async def create_token(
    db: Database,
    role: str,
    name: str = "",
    ttl_s: float | None = None,
    max_ttl_s: float = 0.0,
) -> tuple[str, dict[str, Any]]:
    """Store a new token's digest; returns (the token, its record). The token is not kept."""
    if role not in ("viewer", "admin"):
        raise ValueError(f"role must be viewer or admin, not {role!r}")
    ttl = effective_ttl(ttl_s, max_ttl_s)
    expires_at = datetime.now(UTC) + timedelta(seconds=ttl) if ttl is not None else None
    token = new_token()
    async with db.transaction() as s:
        row = ApiToken(name=name, token_hash=hash_token(token), role=role, expires_at=expires_at)
        s.add(row)
        await s.flush()
        await s.refresh(row)
        record = token_dict(row)
    return token, record


@dataclass(frozen=True)
class _Verdict:
    """What a digest's row said when it was read (cached for ``CACHE_S``)."""

    principal: Principal | None
    reason: str  # why refused (principal None): unknown | revoked | expired | not_configured
    expires_at: float | None = None  # wall-clock seconds; checked on every use


_REFUSALS = {
    "malformed": "invalid or revoked token",
    "unknown": "invalid or revoked token",
    "revoked": "invalid or revoked token",
    "not_configured": "invalid or revoked token",
    "expired": "token expired",
}


def refusal(reason: str) -> Refusal:
    # the client learns "expired" (it held the token, so it knows it existed), nothing more
    return Refusal(reason, _REFUSALS[reason])


class TokenAuth:
    """Looks up bearer tokens in Postgres (cached briefly), the bootstrap token included."""

    def __init__(self, db: Database, bootstrap_admin_token: str = "") -> None:
        self.db = db
        self._bootstrap = hash_token(bootstrap_admin_token) if bootstrap_admin_token else ""
        self._bootstrap_known: _Verdict | None = None  # last read from Postgres
        self._cache: dict[str, tuple[_Verdict, float]] = {}
        self._register_task: asyncio.Task[None] | None = None
        self._log_limit = RateLimiter(60.0)

    # ------------------------------------------------------------------ bootstrap row
    def start(self) -> None:
        """Record the bootstrap token's row in the background (Postgres may be down now)."""
        if self._bootstrap and self._register_task is None:
            self._register_task = asyncio.create_task(self._register_until_done())

    async def stop(self) -> None:
        if self._register_task is not None and not self._register_task.done():
            self._register_task.cancel()
            try:
                await self._register_task
            except asyncio.CancelledError:
                pass

    async def _register_until_done(self) -> None:
        while True:
            try:
                await self._ensure_bootstrap_row()
                return
            except Exception as exc:  # Postgres down or not migrated yet: try again later
                if self._log_limit.allow("register"):
                    log.warning("bootstrap token not recorded yet", error=repr(exc)[:200])
            await asyncio.sleep(REGISTER_RETRY_S)

    async def _ensure_bootstrap_row(self) -> None:
        """Insert the bootstrap token's row unless its digest has one (revoked ones too).
        Looked for first: an insert that conflicts would still use up a sequence number."""
        async with self.db.transaction() as s:
            found = await s.execute(
                select(ApiToken.id).where(ApiToken.token_hash == self._bootstrap)
            )
            if found.first() is not None:
                return
            new_id = (
                await s.execute(
                    insert(ApiToken)
                    .values(
                        name=BOOTSTRAP_NAME,
                        token_hash=self._bootstrap,
                        role="admin",
                        bootstrap=True,
                    )
                    .on_conflict_do_nothing(index_elements=[ApiToken.token_hash])
                    .returning(ApiToken.id)
                )
            ).scalar_one_or_none()
            if new_id is not None:
                row = (await s.execute(select(ApiToken).where(ApiToken.id == new_id))).scalar_one()
                audit.record(
                    s, BOOTSTRAP_NAME, "token.create", "token", str(new_id), None, token_dict(row)
                )
                log.info("bootstrap admin token recorded", token_id=new_id)

    # ------------------------------------------------------------------ lookup
    async def check(self, token: str) -> Principal | Refusal:
        """Who ``token`` is, or why it is refused."""
        if len(token) > MAX_TOKEN_CHARS:
            return refusal("malformed")
        digest = hash_token(token)
        is_bootstrap = bool(self._bootstrap) and hmac.compare_digest(digest, self._bootstrap)
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and now - hit[1] < CACHE_S:
            verdict = hit[0]
        else:
            try:
                verdict = await self._read(digest, is_bootstrap)
            except Exception as exc:
                if is_bootstrap and is_unavailable(exc) and self._bootstrap_known is not None:
                    verdict = self._bootstrap_known
                else:
                    raise
            if is_bootstrap:
                self._bootstrap_known = verdict
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[digest] = (verdict, now)
        if verdict.principal is None:
            return refusal(verdict.reason)
        if verdict.expires_at is not None and time.time() >= verdict.expires_at:
            return refusal("expired")
        return verdict.principal

    async def lookup(self, token: str) -> Principal | None:
        found = await self.check(token)
        return found if isinstance(found, Principal) else None

    async def _read(self, digest: str, is_bootstrap: bool) -> _Verdict:
        row = await self._row(digest)
        if row is None and is_bootstrap:  # used before the background task recorded it
            await self._ensure_bootstrap_row()
            row = await self._row(digest)
        if row is None:
            return _Verdict(None, "unknown")
        state = token_state(row)
        if state != "active":
            return _Verdict(None, state)
        if is_bootstrap:
            return _Verdict(Principal(BOOTSTRAP_NAME, "admin"), "")
        if row.bootstrap:  # an earlier value of the environment's token: not this replica's
            return _Verdict(None, "not_configured")
        actor = f"token:{row.id}" + (f":{row.name}" if row.name else "")
        expires = row.expires_at.timestamp() if row.expires_at is not None else None
        return _Verdict(Principal(actor, row.role), "", expires)

    async def _row(self, digest: str) -> ApiToken | None:
        async with self.db.session() as s:
            return (
                await s.execute(select(ApiToken).where(ApiToken.token_hash == digest))
            ).scalar_one_or_none()

    def forget(self) -> None:
        self._cache.clear()
        self._bootstrap_known = None
