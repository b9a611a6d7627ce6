"""Tenant routes: ``/api/v1/tenants[...]``, their client API keys and their usage.

Invariants:
- Versions only grow: a PUT with a spec adds version ``latest + 1``; stored versions never
  change. Every change (tenant or key) bumps the directory revision and writes its audit entry
  in one transaction, and is published to the routers only after the commit (the periodic
  resync covers a NATS outage).
- A key's secret is returned once, by the call that creates it; only its sha256 digest is
  stored, audited (never the key) and sent to routers. Revoking is idempotent.
- Usage is what routers reported (services.api.usage): per-minute sums of their outcomes,
  with the engine's own cached-token figures, and the blocks the tenant holds now against its
  cache budget (services.api.tenant_cache: the routers' current reports).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import msgspec
from msgspec import Meta
from sqlalchemy import func, select

from services.api import audit, bodies
from services.api.context import ApiContext
from services.api.framework import (
    ApiError,
    Reply,
    Req,
    Route,
    check_precondition,
    conflict,
    etag,
    if_match,
    not_found,
)
from services.api.framework import hash_token as key_digest
from services.api.models import TenantKey, TenantRow, TenantUsage, TenantVersion
from services.api.routes.common import V1, iso, version_history
from services.api.tenant_cache import budget_of
from services.api.tenants import bump_revision, key_dict, new_key, new_salt
from services.core.flow.cache_budget import over_budget

VERSION_TAG = 'the tenant\'s version, quoted (`"7"`); a description-only update keeps it'


def spec_dict(spec: bodies.TenantSpec) -> dict[str, Any]:
    return msgspec.to_builtins(spec)


async def tenant_row(s, tenant_id: str, lock: bool = False) -> TenantRow:
    q = select(TenantRow).where(TenantRow.id == tenant_id)
    if lock:
        q = q.with_for_update()
    row = (await s.execute(q)).scalar_one_or_none()
    if row is None:
        raise not_found("tenant", tenant_id)
    return row


async def tenant_out(s, t: TenantRow, with_versions: bool = False) -> dict[str, Any]:
    keys = (
        await s.execute(
            select(func.count())
            .select_from(TenantKey)
            .where(TenantKey.tenant_id == t.id, TenantKey.revoked_at.is_(None))
        )
    ).scalar_one()
    out: dict[str, Any] = {
        "tenant_id": t.id,
        "description": t.description,
        "version": t.version,
        "spec": t.spec,
        "keys": int(keys),  # not revoked (expired ones included)
        "created_at": iso(t.created_at),
        "updated_at": iso(t.updated_at),
        "created_by": t.created_by,
    }
    if with_versions:
        out["versions"] = await version_history(s, TenantVersion, TenantVersion.tenant_id, t.id)
    return out


def usage_totals(rows: list[TenantUsage]) -> dict[str, Any]:
    fields = (
        "requests",
        "errors",
        "prompt_tokens",
        "cached_tokens",
        "unreported_prompt_tokens",
        "completion_tokens",
    )
    out = {f: sum(getattr(r, f) for r in rows) for f in fields}
    reported = out["prompt_tokens"] - out["unreported_prompt_tokens"]
    out["computed_prompt_tokens"] = reported - out["cached_tokens"]
    out["cache_hit_ratio"] = round(out["cached_tokens"] / reported, 6) if reported > 0 else None
    return out


def routes(ctx: ApiContext) -> list[Route]:
    db = ctx.db

    async def publish() -> bool:
        return await ctx.tenants.publish_current()

    async def list_tenants(_r: Req) -> dict[str, Any]:
        async with db.session() as s:
            rows = (await s.execute(select(TenantRow).order_by(TenantRow.id))).scalars().all()
            return {"tenants": [await tenant_out(s, t) for t in rows]}

    async def create_tenant(r: Req) -> dict[str, Any]:
        b: bodies.TenantCreate = r.body
        spec = spec_dict(b.spec)
        async with db.transaction() as s:
            exists = (
                await s.execute(select(TenantRow.id).where(TenantRow.id == b.tenant_id))
            ).first()
            if exists:
                raise conflict(f"tenant {b.tenant_id!r} exists; PUT a new version instead")
            t = TenantRow(
                id=b.tenant_id,
                description=b.description,
                version=1,
                spec=spec,
                cache_salt=new_salt(),
                created_by=r.actor,
            )
            s.add(t)
            await s.flush()
            s.add(TenantVersion(tenant_id=t.id, version=1, spec=spec, created_by=r.actor))
            revision = await bump_revision(s)
            await s.flush()
            await s.refresh(t)
            out = await tenant_out(s, t, with_versions=True)
            audit.record(s, r.actor, "tenant.create", "tenant", t.id, None, out)
        return {**out, "revision": revision, "published": await publish()}

    async def get_tenant(r: Req) -> Reply:
        async with db.session() as s:
            t = await tenant_row(s, r.path["id"])
            out = await tenant_out(s, t, with_versions=True)
        return Reply(out, {"ETag": etag(out["version"])})

    async def update_tenant(r: Req) -> Reply:
        b: bodies.TenantUpdate = r.body
        if b.spec is None and b.description is None:
            raise ApiError(400, "invalid_body", "give spec and/or description", "spec")
        expected = if_match(r.request)
        async with db.transaction() as s:
            # the row lock orders writers: the version checked is the one this write replaces
            t = await tenant_row(s, r.path["id"], lock=True)
            check_precondition(expected, f"tenant {t.id!r}", t.version)
            before = await tenant_out(s, t)
            if b.description is not None:
                t.description = b.description
            if b.spec is not None:
                if t.version >= 1_000_000:
                    raise conflict("too many versions")
                t.version += 1
                t.spec = spec_dict(b.spec)
                s.add(
                    TenantVersion(
                        tenant_id=t.id, version=t.version, spec=t.spec, created_by=r.actor
                    )
                )
            t.updated_at = datetime.now(UTC)
            revision = await bump_revision(s)
            await s.flush()
            out = await tenant_out(s, t, with_versions=True)
            audit.record(
                s,
                r.actor,
                "tenant.update",
                "tenant",
                t.id,
                before,
                {k: v for k, v in out.items() if k != "versions"},
            )
        published = await publish()
        return Reply(
            {**out, "revision": revision, "published": published}, {"ETag": etag(out["version"])}
        )

    async def delete_tenant(r: Req) -> dict[str, Any]:
        expected = if_match(r.request)
        async with db.transaction() as s:
            t = await tenant_row(s, r.path["id"], lock=True)
            check_precondition(expected, f"tenant {t.id!r}", t.version)
            before = await tenant_out(s, t, with_versions=True)
            await s.delete(t)  # its keys and versions go with it (ON DELETE CASCADE)
            revision = await bump_revision(s)
            audit.record(s, r.actor, "tenant.delete", "tenant", t.id, before, None)
        return {"deleted": r.path["id"], "revision": revision, "published": await publish()}

    async def list_keys(r: Req) -> dict[str, Any]:
        async with db.session() as s:
            await tenant_row(s, r.path["id"])
            rows = (
                await s.execute(
                    select(TenantKey)
                    .where(TenantKey.tenant_id == r.path["id"])
                    .order_by(TenantKey.id)
                )
            ).scalars()
            return {"keys": [key_dict(k) for k in rows]}

    async def create_key(r: Req) -> dict[str, Any]:
        b: bodies.TenantKeyCreate = r.body
        key = new_key()
        expires = datetime.now(UTC) + timedelta(seconds=b.ttl_s) if b.ttl_s is not None else None
        async with db.transaction() as s:
            t = await tenant_row(s, r.path["id"], lock=True)
            row = TenantKey(
                tenant_id=t.id,
                name=b.name,
                key_hash=key_digest(key),
                priority=b.priority,
                allow_priority_header=b.allow_priority_header,
                created_by=r.actor,
                expires_at=expires,
            )
            s.add(row)
            revision = await bump_revision(s)
            await s.flush()
            await s.refresh(row)
            record = key_dict(row)
            audit.record(s, r.actor, "tenant_key.create", "tenant_key", str(row.id), None, record)
        published = await publish()
        return {**record, "key": key, "revision": revision, "published": published}

    async def revoke_key(r: Req) -> dict[str, Any]:
        async with db.transaction() as s:
            row = (
                await s.execute(
                    select(TenantKey)
                    .where(TenantKey.id == r.path["key_id"], TenantKey.tenant_id == r.path["id"])
                    .with_for_update()
                )
            ).scalar_one_or_none()
            if row is None:
                raise not_found(f"key of tenant {r.path['id']!r}", r.path["key_id"])
            before = key_dict(row)
            if row.revoked_at is None:
                row.revoked_at = datetime.now(UTC)
            revision = await bump_revision(s)
            out = key_dict(row)
            audit.record(s, r.actor, "tenant_key.revoke", "tenant_key", str(row.id), before, out)
        return {**out, "revision": revision, "published": await publish()}

    def cache_now(tenant: str, budget: int | None) -> dict[str, Any]:
        held = ctx.tenant_cache.held(tenant) if ctx.tenant_cache is not None else None
        return {
            "cache_blocks_held": held,
            "cache_budget_blocks": budget,
            "over_cache_budget": held is not None and over_budget(held, budget),
        }

    async def usage(r: Req) -> dict[str, Any]:
        now = time.time()
        since = float(r.query.get("since", now - 86400.0))
        until = float(r.query.get("until", now))
        async with db.session() as s:
            exists = (
                await s.execute(select(TenantRow.spec).where(TenantRow.id == r.path["id"]))
            ).first()
            rows = (
                (
                    await s.execute(
                        select(TenantUsage)
                        .where(
                            TenantUsage.tenant_id == r.path["id"],
                            TenantUsage.minute >= int(since // 60),
                            TenantUsage.minute <= int(until // 60),
                        )
                        .order_by(TenantUsage.minute)
                    )
                )
                .scalars()
                .all()
            )
        if exists is None and not rows:
            raise not_found("tenant", r.path["id"])
        out: dict[str, Any] = {
            "tenant_id": r.path["id"],
            "since": int(since // 60) * 60,
            "until": int(until // 60) * 60 + 60,
            **usage_totals(list(rows)),
            **cache_now(r.path["id"], budget_of(exists[0]) if exists is not None else None),
        }
        if r.query.get("per_minute", False):
            out["minutes"] = [{"minute": row.minute * 60, **usage_totals([row])} for row in rows]
        return out

    id_p = {"id": bodies.TenantId}
    key_p = {**id_p, "key_id": Annotated[int, Meta(ge=1, le=2_000_000_000)]}
    epoch = Annotated[float, Meta(ge=0.0, le=1e11, description="unix seconds")]
    return [
        Route("GET", f"{V1}/tenants", list_tenants, "list tenants", "tenants"),
        Route(
            "POST",
            f"{V1}/tenants",
            create_tenant,
            "create a tenant (version 1)",
            "tenants",
            role="admin",
            body=bodies.TenantCreate,
            status=201,
            description="Routers receive the tenant within a second (`tenants.updated`). "
            "`spec.weight` is its share of a saturated fleet, `spec.quota` its limits, "
            "`spec.cache_isolation` gives its prompts a cache namespace of their own.",
        ),
        Route(
            "GET",
            f"{V1}/tenants/{{id}}",
            get_tenant,
            "a tenant with all versions",
            "tenants",
            path_params=id_p,
            etag=VERSION_TAG,
        ),
        Route(
            "PUT",
            f"{V1}/tenants/{{id}}",
            update_tenant,
            "update: a new spec makes a new version",
            "tenants",
            role="admin",
            body=bodies.TenantUpdate,
            path_params=id_p,
            etag=VERSION_TAG,
            if_match=VERSION_TAG,
            description="With `If-Match` (the ETag of a GET) the update is made only if the "
            "tenant is still at that version, else 412 and nothing changes: a read-modify-write "
            "cannot lose another writer's change. Without it, the update is unconditional.",
        ),
        Route(
            "DELETE",
            f"{V1}/tenants/{{id}}",
            delete_tenant,
            "delete a tenant and its keys (its usage is kept)",
            "tenants",
            role="admin",
            path_params=id_p,
            if_match=VERSION_TAG,
        ),
        Route(
            "GET",
            f"{V1}/tenants/{{id}}/keys",
            list_keys,
            "a tenant's client API keys (secrets are never shown)",
            "tenants",
            role="admin",
            path_params=id_p,
        ),
        Route(
            "POST",
            f"{V1}/tenants/{{id}}/keys",
            create_key,
            "issue a client API key for the OpenAI port (shown once)",
            "tenants",
            role="admin",
            body=bodies.TenantKeyCreate,
            body_required=False,
            status=201,
            path_params=id_p,
            description="The key (`key`, `kvt_...`) is in this response only; the api stores "
            "its sha256 digest. Clients send it as `Authorization: Bearer <key>` to any "
            "router; `ttl_s` makes it expire (401 `API key expired` afterwards).",
        ),
        Route(
            "DELETE",
            f"{V1}/tenants/{{id}}/keys/{{key_id}}",
            revoke_key,
            "revoke a key (routers refuse it within a second)",
            "tenants",
            role="admin",
            path_params=key_p,
        ),
        Route(
            "GET",
            f"{V1}/tenants/{{id}}/usage",
            usage,
            "what the tenant used (chargeback): requests, tokens, cached tokens",
            "tenants",
            path_params=id_p,
            query={"since": epoch, "until": epoch, "per_minute": bool},
            description="Sums of the routers' outcomes for this tenant by whole minutes "
            "(default: the last 24 h). `cached_tokens` is what the engines reported served "
            "from their prefix cache; `computed_prompt_tokens` the rest of the prompts whose "
            "engine reported; `unreported_prompt_tokens` prompts of engines that did not. "
            "`cache_blocks_held` is the KV blocks the tenant holds now (the routers' cache "
            "ledgers, summed; null while no router reports), `over_cache_budget` whether that "
            "exceeds `cache_budget_blocks` (its new requests are then in the sheddable band).",
        ),
    ]
