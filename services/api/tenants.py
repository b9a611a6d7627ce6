"""Tenants, from Postgres to the bus: the tenant directory routers hold.

Invariants:
- The published ``TenantsUpdated`` is always derived from Postgres (tenants, their keys that are
  neither revoked nor expired, and the ``tenant_state`` revision), never from a handler's local
  variables, so any replica can (re)publish it.
- ``revision`` is bumped in the same transaction as every change to tenants or keys; routers
  apply only a newer one.
- A notice lost while NATS was down, or a stream whose newest notice is not the api's own at
  the stored revision (older, newer, unsigned or signed by another key), is re-published by
  :meth:`TenantPublisher.resync` (run with the policy resync).
- Key secrets never leave :func:`new_key`'s caller: only their sha256 digests are stored and
  published.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from datetime import UTC, datetime
from typing import Any

from prometheus_client import Counter
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncSession

from services.api.db import Database
from services.api.models import TenantKey, TenantRow, TenantState
from services.common.bus import Bus
from services.common.logging import RateLimiter, get_logger
from services.common.schemas import (
    SchemaError,
    TenantKeyRecord,
    TenantRecord,
    TenantsUpdated,
    decode,
)
from services.common.signing import Verifier
from services.common.streams import require_tenants_stream

log = get_logger("api.tenants")

KEY_PREFIX = "kvt_"  # tenant keys; admin API tokens are kvg_

TENANT_STREAM_REPAIRS = Counter(
    "kvgate_api_tenant_stream_repairs_total",
    "Tenant directories the api re-published because the TENANTS stream's newest was not its"
    " own current one",
    ["problem"],
)


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def new_salt() -> str:
    return secrets.token_hex(16)


def key_state(row: TenantKey, now: datetime | None = None) -> str:
    """``active``, ``revoked`` or ``expired`` (revoked wins)."""
    if row.revoked_at is not None:
        return "revoked"
    if row.expires_at is not None and row.expires_at <= (now or datetime.now(UTC)):
        return "expired"
    return "active"


def key_dict(row: TenantKey) -> dict[str, Any]:
    return {
        "id": row.id,
        "tenant_id": row.tenant_id,
        "name": row.name,
        "priority": row.priority,
        "allow_priority_header": bool(row.allow_priority_header),
        "created_at": row.created_at.isoformat() if row.created_at else None,
        "created_by": row.created_by,
        "revoked_at": row.revoked_at.isoformat() if row.revoked_at else None,
        "expires_at": row.expires_at.isoformat() if row.expires_at else None,
        "state": key_state(row),
    }


async def bump_revision(session: AsyncSession) -> int:
    """Increment the directory revision (row-locks tenant_state until the transaction ends)."""
    return int(
        (
            await session.execute(
                text(
                    "UPDATE tenant_state SET revision = revision + 1, updated_at = now() "
                    "WHERE id = 1 RETURNING revision"
                )
            )
        ).scalar_one()
    )


def tenant_record(row: TenantRow) -> TenantRecord:
    spec = row.spec
    quota = spec.get("quota") or {}
    return TenantRecord(
        tenant_id=row.id,
        weight=float(spec.get("weight", 1.0)),
        default_priority=spec.get("default_priority", "standard"),
        requests_per_min=quota.get("requests_per_min"),
        input_tokens_per_min=quota.get("input_tokens_per_min"),
        output_tokens_per_min=quota.get("output_tokens_per_min"),
        concurrent_requests=quota.get("concurrent_requests"),
        cache_budget_blocks=quota.get("cache_budget_blocks"),
        cache_isolation=bool(spec.get("cache_isolation", False)),
        # the secret leaves the api only for a tenant that uses it
        cache_salt=row.cache_salt if spec.get("cache_isolation") else "",
        version=row.version,
    )


async def desired(session: AsyncSession) -> TenantsUpdated | None:
    """The directory routers should hold now (None: no tenant was ever created)."""
    st = (await session.execute(select(TenantState).where(TenantState.id == 1))).scalar_one()
    if st.revision == 0:
        return None
    tenants = (await session.execute(select(TenantRow).order_by(TenantRow.id))).scalars().all()
    now = datetime.now(UTC)
    keys = (
        (
            await session.execute(
                select(TenantKey).where(TenantKey.revoked_at.is_(None)).order_by(TenantKey.id)
            )
        )
        .scalars()
        .all()
    )
    return TenantsUpdated(
        revision=int(st.revision),
        tenants=[tenant_record(t) for t in tenants],
        keys=[
            TenantKeyRecord(
                key_id=k.id,
                tenant_id=k.tenant_id,
                digest=k.key_hash,
                priority=k.priority,  # type: ignore[arg-type]
                allow_priority_header=bool(k.allow_priority_header),
                expires_at=k.expires_at.timestamp() if k.expires_at is not None else None,
            )
            for k in keys
            if key_state(k, now) == "active"
        ],
        ts=time.time(),
    )


class TenantPublisher:
    def __init__(self, db: Database, bus: Bus) -> None:
        self.db = db
        self.bus = bus
        self._lock = asyncio.Lock()  # one publish at a time per process keeps them in order
        self._log = RateLimiter(30.0)

    async def publish_current(self) -> bool:
        """Publish the database's current directory; False if NATS did not take it (the
        resync will)."""
        async with self._lock:
            async with self.db.session() as s:
                notice = await desired(s)
            if notice is None:
                return True
            try:
                await require_tenants_stream(self.bus)
                await self.bus.js_publish(self.bus.subjects.tenants_updated, notice)
            except Exception as exc:
                if self._log.allow("publish"):
                    log.warning("tenant directory publish failed; will resync", error=repr(exc))
                return False
            log.info(
                "tenant directory published",
                revision=notice.revision,
                tenants=len(notice.tenants),
                keys=len(notice.keys),
            )
            return True

    async def stream_problem(self, db_revision: int) -> str:
        """ "" when the TENANTS stream's newest notice is the api's own at ``db_revision``."""
        s = self.bus.subjects
        try:
            msg = await self.bus.js.get_last_msg(s.tenants_stream, s.tenants_updated)
        except Exception:
            return "missing"
        try:
            revision = int(decode(TenantsUpdated, msg.data).revision)
        except SchemaError:
            return "invalid"
        signer = self.bus.signer
        own = Verifier([signer.public_key] if signer is not None else [])
        reason = own.reject_reason(msg.subject, msg.data, msg.headers)
        if reason:
            return reason
        if revision != db_revision:
            return "behind" if revision < db_revision else "ahead"
        return ""

    async def resync(self) -> bool:
        async with self.db.session() as s:
            st = (await s.execute(select(TenantState).where(TenantState.id == 1))).scalar_one()
        if st.revision == 0:
            return False
        problem = await self.stream_problem(int(st.revision))
        if not problem:
            return False
        TENANT_STREAM_REPAIRS.labels(problem).inc()
        if problem not in ("missing", "behind"):
            log.warning("tenants stream's newest notice is not the api's; republishing",
                        problem=problem, stored_revision=int(st.revision))  # fmt: skip
        return await self.publish_current()
