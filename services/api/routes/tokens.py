"""API token routes: ``/api/v1/tokens[...]`` (list, create, revoke), admin only.

Invariants: a token's secret is returned once, by the call that creates it; only its
digest is stored and no route ever shows it. A token lives at most ``ttl_s`` (and at most the
server's ``token_max_ttl_s`` when set). Revoking is idempotent and audited, works on the
bootstrap token's row (``bootstrap-admin``) as on any other, and drops this replica's token
cache at once (other replicas follow within ``tokens.CACHE_S``).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from msgspec import Meta
from sqlalchemy import select

from services.api import audit, bodies
from services.api.context import ApiContext
from services.api.framework import ApiError, Req, Route, not_found
from services.api.models import ApiToken
from services.api.routes.common import V1
from services.api.tokens import create_token, token_dict


def routes(ctx: ApiContext) -> list[Route]:
    db = ctx.db

    async def list_tokens(_r: Req) -> dict[str, Any]:
        async with db.session() as s:
            rows = (await s.execute(select(ApiToken).order_by(ApiToken.id))).scalars()
            return {"tokens": [token_dict(t) for t in rows]}

    async def create_api_token(r: Req) -> dict[str, Any]:
        b: bodies.TokenCreate = r.body
        try:
            token, record = await create_token(db, b.role, b.name, b.ttl_s, ctx.token_max_ttl_s)
        except ValueError as exc:
            raise ApiError(400, "invalid_body", str(exc), "ttl_s") from None
        async with db.transaction() as s:
            audit.record(s, r.actor, "token.create", "token", str(record["id"]), None, record)
        return {**record, "token": token}

    async def revoke_token(r: Req) -> dict[str, Any]:
        async with db.transaction() as s:
            row = (
                await s.execute(select(ApiToken).where(ApiToken.id == r.path["id"]))
            ).scalar_one_or_none()
            if row is None:
                raise not_found("token", r.path["id"])
            before = token_dict(row)
            if row.revoked_at is None:
                row.revoked_at = datetime.now(UTC)
            out = token_dict(row)
            audit.record(s, r.actor, "token.revoke", "token", str(row.id), before, out)
        ctx.auth.forget()
        return out

    return [
        Route(
            "GET",
            f"{V1}/tokens",
            list_tokens,
            "API tokens (digests are never shown)",
            "tokens",
            role="admin",
            description="Each token with its role, state (active, revoked, expired), "
            "expires_at, and whether it is the environment's bootstrap token "
            "(`bootstrap-admin`, revocable like any other).",
        ),
        Route(
            "POST",
            f"{V1}/tokens",
            create_api_token,
            "create a token (shown once)",
            "tokens",
            role="admin",
            body=bodies.TokenCreate,
            status=201,
            description="`ttl_s` makes the token expire (refused with 401 `token expired` "
            "afterwards). Over the server's maximum TTL, when it has one: 400.",
        ),
        Route(
            "DELETE",
            f"{V1}/tokens/{{id}}",
            revoke_token,
            "revoke a token",
            "tokens",
            role="admin",
            description="Also revokes the bootstrap admin token (`bootstrap-admin`): it stays "
            "revoked across restarts while the environment still holds it. Rotate it by "
            "creating another admin token, revoking `bootstrap-admin`, then changing or "
            "removing KVGATE_API_ADMIN_TOKEN.",
            path_params={"id": Annotated[int, Meta(ge=1, le=2_000_000_000)]},
        ),
    ]
