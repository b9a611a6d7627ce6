"""Alert and silence routes: ``/api/v1/alerts[...]`` and ``/api/v1/silences[...]``.

Invariants:
- An alert moves firing -> acknowledged -> resolved (or straight to resolved) and never
  back by hand; each move is one locked transaction with its audit entry.
- A manual resolution is published on the alert subject after the commit, unless the alert
  is silenced; a failed publish is reported as ``published: false``, never as an error
  (the resolution is stored).
- Silencing an alert silences its fingerprint for a period; a silence matches alerts by the
  fields it names and ends at ``ends_at`` or when deleted.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import func, select

from services.api import audit, bodies
from services.api.alerting import alert_dict, alert_filters, is_silenced, silence_dict, to_message
from services.api.context import ApiContext
from services.api.framework import Req, Route, conflict, not_found
from services.api.models import AlertRow, Silence
from services.api.routes.common import V1


async def alert_row(s, alert_id: str, lock: bool = False) -> AlertRow:
    q = select(AlertRow).where(AlertRow.id == alert_id)
    if lock:
        q = q.with_for_update()
    a = (await s.execute(q)).scalar_one_or_none()
    if a is None:
        raise not_found("alert", alert_id)
    return a


async def add_silence(
    s, actor: str, duration_s: float, comment: str, **match: Any
) -> dict[str, Any]:
    """Store a silence matching ``match`` for ``duration_s`` from now, audited."""
    row = Silence(
        id=str(uuid.uuid4()),
        comment=comment,
        created_by=actor,
        ends_at=datetime.now(UTC) + timedelta(seconds=duration_s),
        **match,
    )
    s.add(row)
    await s.flush()
    await s.refresh(row)
    out = silence_dict(row)
    audit.record(s, actor, "silence.create", "silence", row.id, None, out)
    return out


def routes(ctx: ApiContext) -> list[Route]:
    db = ctx.db

    async def list_alerts(r: Req) -> dict[str, Any]:
        conds = alert_filters(r.query)
        q = (
            select(AlertRow)
            .where(*conds)
            .order_by(AlertRow.last_seen.desc(), AlertRow.id)
            .limit(r.query.get("limit", 100))
            .offset(r.query.get("offset", 0))
        )
        async with db.session() as s:
            rows = (await s.execute(q)).scalars().all()
            total = (
                await s.execute(select(func.count()).select_from(AlertRow).where(*conds))
            ).scalar_one()
        return {"alerts": [alert_dict(a) for a in rows], "total": total}

    async def get_alert(r: Req) -> dict[str, Any]:
        async with db.session() as s:
            return alert_dict(await alert_row(s, r.path["id"]))

    async def ack_alert(r: Req) -> dict[str, Any]:
        async with db.transaction() as s:
            a = await alert_row(s, r.path["id"], lock=True)
            if a.state != "firing":
                raise conflict(f"alert is {a.state}; only firing alerts can be acknowledged")
            before = alert_dict(a)
            a.state, a.acked_by, a.acked_at = "acknowledged", r.actor, datetime.now(UTC)
            out = alert_dict(a)
            audit.record(s, r.actor, "alert.ack", "alert", a.id, before, out)
        return out

    async def resolve_alert(r: Req) -> dict[str, Any]:
        async with db.transaction() as s:
            a = await alert_row(s, r.path["id"], lock=True)
            if a.state == "resolved":
                raise conflict("alert is already resolved")
            before = alert_dict(a)
            a.state, a.resolved_by, a.resolved_at = "resolved", r.actor, datetime.now(UTC)
            out = alert_dict(a)
            audit.record(s, r.actor, "alert.resolve", "alert", a.id, before, out)
            publish = not a.silenced and not await is_silenced(s, a)
            msg = to_message(a)
        if publish:
            try:
                await ctx.bus.js_publish(ctx.bus.subjects.alert(a.severity, a.kind), msg)
            except Exception:
                out["published"] = False
        return out

    async def silence_alert(r: Req) -> dict[str, Any]:
        b: bodies.AlertSilence = r.body
        async with db.transaction() as s:
            a = await alert_row(s, r.path["id"], lock=True)
            out = await add_silence(s, r.actor, b.duration_s, b.comment, fingerprint=a.fingerprint)
            if a.state != "resolved":
                a.silenced = True
        return out

    async def list_silences(r: Req) -> dict[str, Any]:
        q = select(Silence).order_by(Silence.ends_at.desc()).limit(500)
        if not r.query.get("expired", False):
            q = q.where(Silence.ends_at > datetime.now(UTC))
        async with db.session() as s:
            return {"silences": [silence_dict(x) for x in (await s.execute(q)).scalars()]}

    async def create_silence(r: Req) -> dict[str, Any]:
        b: bodies.SilenceCreate = r.body
        async with db.transaction() as s:
            return await add_silence(
                s,
                r.actor,
                b.duration_s,
                b.comment,
                fingerprint=b.fingerprint,
                kind=b.kind,
                worker_id=b.worker_id,
                severity=b.severity,
            )

    async def delete_silence(r: Req) -> dict[str, Any]:
        async with db.transaction() as s:
            row = (
                await s.execute(select(Silence).where(Silence.id == r.path["id"]))
            ).scalar_one_or_none()
            if row is None:
                raise not_found("silence", r.path["id"])
            before = silence_dict(row)
            await s.delete(row)
            audit.record(s, r.actor, "silence.delete", "silence", r.path["id"], before, None)
        return {"deleted": r.path["id"]}

    alert_p = {"id": bodies.Uuid}
    return [
        Route(
            "GET",
            f"{V1}/alerts",
            list_alerts,
            "list and filter alerts",
            "alerts",
            query={
                "severity": bodies.Severity,
                "kind": bodies.Kind,
                "worker": bodies.WorkerId,
                "state": bodies.AlertState,
                "limit": bodies.Limit,
                "offset": bodies.Offset,
            },
        ),
        Route("GET", f"{V1}/alerts/{{id}}", get_alert, "one alert", "alerts", path_params=alert_p),
        Route(
            "POST",
            f"{V1}/alerts/{{id}}/ack",
            ack_alert,
            "acknowledge a firing alert",
            "alerts",
            role="admin",
            body=bodies.ActionBody,
            body_required=False,
            path_params=alert_p,
        ),
        Route(
            "POST",
            f"{V1}/alerts/{{id}}/resolve",
            resolve_alert,
            "resolve by hand (publishes the resolution)",
            "alerts",
            role="admin",
            body=bodies.ActionBody,
            body_required=False,
            path_params=alert_p,
        ),
        Route(
            "POST",
            f"{V1}/alerts/{{id}}/silence",
            silence_alert,
            "silence this alert's fingerprint for a period",
            "alerts",
            role="admin",
            body=bodies.AlertSilence,
            path_params=alert_p,
            status=201,
        ),
        Route(
            "GET",
            f"{V1}/silences",
            list_silences,
            "active (or all) silences",
            "alerts",
            query={"expired": bool},
        ),
        Route(
            "POST",
            f"{V1}/silences",
            create_silence,
            "silence matching alerts",
            "alerts",
            role="admin",
            body=bodies.SilenceCreate,
            status=201,
        ),
        Route(
            "DELETE",
            f"{V1}/silences/{{id}}",
            delete_silence,
            "end a silence",
            "alerts",
            role="admin",
            path_params={"id": bodies.Uuid},
        ),
    ]
