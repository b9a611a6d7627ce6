"""Worker routes: ``/api/v1/workers[...]`` (list, inspect, cordon, drain, uncordon, repin).

Invariants:
- A worker's view joins three sources: the live registry (heartbeats, load), the persisted
  admin action (``worker_control``) and the open breaker alerts; a worker the API has never
  heard of and holds no action for is a 404.
- ``uncordon`` stores the action too (active is the default): the republisher re-sends it for
  the routers' freshness window, then deletes the row (services.api.workers). The action is
  committed with its audit entry before it is published to the routers.
- ``repin`` (a worker's URL, services.core.url_pin) is audited, then published once; it
  changes no stored state.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import select

from services.api import audit, bodies
from services.api.alerting import open_breakers_query
from services.api.context import ApiContext
from services.api.framework import ApiError, Req, Route, not_found
from services.api.models import WorkerControlState
from services.api.routes.common import V1
from services.api.workers import publish_control
from services.common.redact import redact_url
from services.core.url_pin import url_host


def routes(ctx: ApiContext) -> list[Route]:
    db = ctx.db

    async def _workers(ids: list[str] | None = None) -> list[dict[str, Any]]:
        async with db.session() as s:
            controls = {  # an uncordon row is "active" (the default), kept only to be re-sent
                w.worker_id: w.action
                for w in (await s.execute(select(WorkerControlState))).scalars()
                if w.action != "uncordon"
            }
            breakers = {w for (w,) in (await s.execute(open_breakers_query())).all()}
        known = ids if ids is not None else sorted(set(ctx.registry.ids()) | set(controls))
        return [ctx.registry.view(w, controls.get(w), w in breakers) for w in known]

    async def list_workers(r: Req) -> dict[str, Any]:
        workers = await _workers()
        if "health" in r.query:
            workers = [w for w in workers if w["health"] == r.query["health"]]
        return {"workers": workers}

    async def get_worker(r: Req) -> dict[str, Any]:
        wid = r.path["worker_id"]
        out = (await _workers([wid]))[0]
        if out["health"] == "unknown" and out["admin_state"] == "active":
            raise not_found("worker", wid)
        return out

    def worker_action(action: str):
        async def handler(r: Req) -> dict[str, Any]:
            wid = r.path["worker_id"]
            async with db.transaction() as s:
                row = (
                    await s.execute(
                        select(WorkerControlState)
                        .where(WorkerControlState.worker_id == wid)
                        .with_for_update()
                    )
                ).scalar_one_or_none()
                before = {"action": row.action} if row else {"action": "uncordon"}
                if row is None:
                    s.add(WorkerControlState(worker_id=wid, action=action, by=r.actor))
                else:
                    row.action, row.by, row.updated_at = action, r.actor, datetime.now(UTC)
                audit.record(
                    s,
                    r.actor,
                    f"worker.{action}",
                    "worker",
                    wid,
                    before,
                    {"action": action, "reason": r.body.reason},
                )
            published = await publish_control(ctx.bus, wid, action, r.actor)
            out = (await _workers([wid]))[0]
            out["published"] = published
            return out

        handler.__name__ = f"{action}_worker"
        return handler

    async def repin_worker(r: Req) -> dict[str, Any]:
        wid = r.path["worker_id"]
        body: bodies.RepinBody = r.body or bodies.RepinBody()
        if body.url and url_host(body.url) is None:
            raise ApiError(400, "invalid_body", "url must be an http(s) URL with a host", "url")
        async with db.transaction() as s:
            audit.record(
                s,
                r.actor,
                "worker.repin",
                "worker",
                wid,
                None,
                {"url": redact_url(body.url) if body.url else None, "reason": body.reason},
            )
        published = await publish_control(ctx.bus, wid, "repin", r.actor, body.url)
        out = (await _workers([wid]))[0]
        out["published"] = published
        return out

    worker_p = {"worker_id": bodies.WorkerId}
    return [
        Route(
            "GET",
            f"{V1}/workers",
            list_workers,
            "workers with health, load, KV usage, admin and breaker state",
            "workers",
            query={"health": Literal["healthy", "stale", "down", "unregistered"]},
        ),
        Route(
            "GET",
            f"{V1}/workers/{{worker_id}}",
            get_worker,
            "one worker",
            "workers",
            path_params=worker_p,
        ),
        Route(
            "POST",
            f"{V1}/workers/{{worker_id}}/cordon",
            worker_action("cordon"),
            "stop routing new requests to the worker",
            "workers",
            role="admin",
            body=bodies.ActionBody,
            body_required=False,
            path_params=worker_p,
        ),
        Route(
            "POST",
            f"{V1}/workers/{{worker_id}}/drain",
            worker_action("drain"),
            "cordon and let in-flight requests finish",
            "workers",
            role="admin",
            body=bodies.ActionBody,
            body_required=False,
            path_params=worker_p,
        ),
        Route(
            "POST",
            f"{V1}/workers/{{worker_id}}/uncordon",
            worker_action("uncordon"),
            "route to the worker again",
            "workers",
            role="admin",
            body=bodies.ActionBody,
            body_required=False,
            path_params=worker_p,
        ),
        Route(
            "POST",
            f"{V1}/workers/{{worker_id}}/repin",
            repin_worker,
            "let the worker's URL change on every router: to the given url, or to the one its "
            "next heartbeat names",
            "workers",
            role="admin",
            body=bodies.RepinBody,
            body_required=False,
            path_params=worker_p,
        ),
    ]
