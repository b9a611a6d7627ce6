"""The admin API's routes and handlers (the I/O shell: parse -> Postgres -> publish).

Every mutating handler runs in one transaction that also writes the audit log, and
publishes to the bus only after the commit (the periodic resync covers a NATS outage).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from msgspec import Meta
from sqlalchemy import func, select

from services.api import audit, bodies
from services.api.alerting import (
    alert_dict,
    alert_filters,
    is_silenced,
    open_breakers_query,
    silence_dict,
    to_message,
)
from services.api.canary import machine
from services.api.canary.evaluator import Criteria
from services.api.context import ApiContext
from services.api.framework import ApiError, Req, Route, conflict, not_found
from services.api.models import (
    AlertRow,
    ApiToken,
    AuditEntry,
    Canary,
    CanaryDecision,
    Policy,
    PolicyState,
    PolicyVersion,
    Silence,
    WorkerControlState,
)
from services.api.publisher import lock_state, open_canary
from services.api.tokens import create_token, token_dict
from services.api.workers import publish_control

V1 = "/api/v1"


def _policy_validate(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The router's validator: normalised params, or 400 naming the field."""
    from services.core.policy import PolicyError, validate_policy_spec

    try:
        return {"name": name, "params": validate_policy_spec(name, params)}
    except PolicyError as exc:
        raise ApiError(400, "invalid_policy", exc.message, f"spec.{exc.field}") from None


def _iso(dt: datetime | None) -> str | None:
    return dt.isoformat() if dt else None


def build_routes(ctx: ApiContext) -> list[Route]:
    db = ctx.db

    # ------------------------------------------------------------------ meta
    async def health(_r: Req) -> dict[str, Any]:
        ok = await db.ping()
        return {
            "status": "ok" if ok else "degraded",
            "database": "ok" if ok else "unavailable",
            "bus": "ok" if ctx.bus.is_connected else "disconnected",
        }

    async def openapi(_r: Req) -> dict[str, Any]:
        from services.api.openapi import build_document

        return build_document(routes, ctx.policy_schemas)

    async def policy_schemas(_r: Req) -> dict[str, Any]:
        return {"schemas": ctx.policy_schemas}

    # ------------------------------------------------------------------ policies
    async def _policy(s, name: str, lock: bool = False) -> Policy:
        q = select(Policy).where(Policy.name == name)
        if lock:
            q = q.with_for_update()
        p = (await s.execute(q)).scalar_one_or_none()
        if p is None:
            raise not_found("policy", name)
        return p

    async def _version(s, p: Policy, version: int | None) -> PolicyVersion:
        v = version or p.latest_version
        row = (
            await s.execute(
                select(PolicyVersion).where(
                    PolicyVersion.policy_id == p.id, PolicyVersion.version == v
                )
            )
        ).scalar_one_or_none()
        if row is None:
            raise not_found(f"version of policy {p.name!r}", v)
        return row

    async def _policy_out(s, p: Policy, with_versions: bool = False) -> dict[str, Any]:
        st = (await s.execute(select(PolicyState).where(PolicyState.id == 1))).scalar_one()
        latest = await _version(s, p, None)
        out = {
            "name": p.name,
            "description": p.description,
            "latest_version": p.latest_version,
            "spec": latest.spec,
            "active_version": st.active_version if st.active_name == p.name else None,
            "created_at": _iso(p.created_at),
            "updated_at": _iso(p.updated_at),
            "created_by": p.created_by,
        }
        if with_versions:
            rows = (
                await s.execute(
                    select(PolicyVersion)
                    .where(PolicyVersion.policy_id == p.id)
                    .order_by(PolicyVersion.version)
                )
            ).scalars()
            out["versions"] = [
                {
                    "version": v.version,
                    "spec": v.spec,
                    "created_at": _iso(v.created_at),
                    "created_by": v.created_by,
                }
                for v in rows
            ]
        return out

    async def list_policies(r: Req) -> dict[str, Any]:
        async with db.session() as s:
            rows = (await s.execute(select(Policy).order_by(Policy.name))).scalars().all()
            return {"policies": [await _policy_out(s, p) for p in rows]}

    async def create_policy(r: Req) -> dict[str, Any]:
        b: bodies.PolicyCreate = r.body
        spec = _policy_validate(b.spec.name, b.spec.params)
        async with db.transaction() as s:
            exists = (await s.execute(select(Policy.id).where(Policy.name == b.name))).first()
            if exists:
                raise conflict(f"policy {b.name!r} exists; PUT a new version instead")
            p = Policy(name=b.name, description=b.description, latest_version=1, created_by=r.actor)
            s.add(p)
            await s.flush()
            s.add(PolicyVersion(policy_id=p.id, version=1, spec=spec, created_by=r.actor))
            await s.flush()
            out = await _policy_out(s, p, with_versions=True)
            audit.record(s, r.actor, "policy.create", "policy", b.name, None, out)
        return out

    async def get_policy(r: Req) -> dict[str, Any]:
        async with db.session() as s:
            return await _policy_out(s, await _policy(s, r.path["name"]), with_versions=True)

    async def get_policy_version(r: Req) -> dict[str, Any]:
        async with db.session() as s:
            p = await _policy(s, r.path["name"])
            v = await _version(s, p, r.path["version"])
            return {
                "name": p.name,
                "version": v.version,
                "spec": v.spec,
                "created_at": _iso(v.created_at),
                "created_by": v.created_by,
            }

    async def update_policy(r: Req) -> dict[str, Any]:
        b: bodies.PolicyUpdate = r.body
        if b.spec is None and b.description is None:
            raise ApiError(400, "invalid_body", "give spec and/or description", "spec")
        spec = _policy_validate(b.spec.name, b.spec.params) if b.spec is not None else None
        async with db.transaction() as s:
            p = await _policy(s, r.path["name"], lock=True)
            before = await _policy_out(s, p)
            if b.description is not None:
                p.description = b.description
            if spec is not None:
                if p.latest_version >= 1_000_000:
                    raise conflict("too many versions")
                p.latest_version += 1
                s.add(
                    PolicyVersion(
                        policy_id=p.id, version=p.latest_version, spec=spec, created_by=r.actor
                    )
                )
            p.updated_at = datetime.now(UTC)
            await s.flush()
            out = await _policy_out(s, p, with_versions=True)
            audit.record(
                s,
                r.actor,
                "policy.update",
                "policy",
                p.name,
                before,
                {k: v for k, v in out.items() if k != "versions"},
            )
        return out

    async def delete_policy(r: Req) -> dict[str, Any]:
        name = r.path["name"]
        async with db.transaction() as s:
            st = await lock_state(s)
            p = await _policy(s, name, lock=True)
            if st.active_name == name:
                raise conflict(f"policy {name!r} is active; activate another policy first")
            c = await open_canary(s)
            if c is not None and name in (c.candidate_name, c.control_name):
                raise conflict(f"policy {name!r} is in canary {c.id}; abort it first")
            before = await _policy_out(s, p, with_versions=True)
            await s.delete(p)
            audit.record(s, r.actor, "policy.delete", "policy", name, before, None)
        return {"deleted": name}

    async def validate_policy(r: Req) -> dict[str, Any]:
        b: bodies.PolicySpec = r.body
        return {"valid": True, "spec": _policy_validate(b.name, b.params)}

    async def activate_policy(r: Req) -> dict[str, Any]:
        b: bodies.PolicyActivate = r.body
        async with db.transaction() as s:
            c = await open_canary(s)
            if c is not None:
                raise conflict(f"canary {c.id} is {c.state}; promote or abort it first")
            st = await lock_state(s)
            p = await _policy(s, r.path["name"])
            v = await _version(s, p, b.version)
            before = {"name": st.active_name, "version": st.active_version, "revision": st.revision}
            st.active_name, st.active_version, st.active_spec = p.name, v.version, v.spec
            st.revision += 1
            st.updated_at = datetime.now(UTC)
            after = {"name": p.name, "version": v.version, "revision": st.revision}
            audit.record(s, r.actor, "policy.activate", "policy", p.name, before, after)
        published = await ctx.publisher.publish_current()
        return {**after, "spec": v.spec, "published": published}

    async def active_policy(_r: Req) -> dict[str, Any]:
        async with db.session() as s:
            st = (await s.execute(select(PolicyState).where(PolicyState.id == 1))).scalar_one()
            c = await open_canary(s)
        return {
            "name": st.active_name,
            "version": st.active_version,
            "spec": st.active_spec,
            "revision": st.revision,
            "canary": {
                "id": c.id,
                "state": c.state,
                "fraction": c.steps[c.step_index],
                "candidate": c.candidate_name,
                "candidate_version": c.candidate_version,
            }
            if c
            else None,
        }

    # ------------------------------------------------------------------ canaries
    async def list_canaries(r: Req) -> dict[str, Any]:
        q = select(Canary).order_by(Canary.created_at.desc()).limit(r.query.get("limit", 100))
        if "state" in r.query:
            q = q.where(Canary.state == r.query["state"])
        async with db.session() as s:
            return {"canaries": [machine.canary_dict(c) for c in (await s.execute(q)).scalars()]}

    async def create_canary(r: Req) -> dict[str, Any]:
        b: bodies.CanaryCreate = r.body
        steps = list(b.steps)
        if any(later <= earlier for earlier, later in zip(steps, steps[1:], strict=False)):
            raise ApiError(400, "invalid_body", "steps must increase", "steps")
        async with db.transaction() as s:
            if (c := await open_canary(s)) is not None:
                raise conflict(f"canary {c.id} is already {c.state}")
            st = await lock_state(s)
            if st.active_name is None or st.active_spec is None:
                raise conflict("no active policy to compare with; activate one first")
            p = await _policy(s, b.policy)
            v = await _version(s, p, b.version)
            if p.name == st.active_name and v.version == st.active_version:
                raise conflict("the candidate is the active policy")
            c = await machine.start(
                s,
                candidate=(p.name, v.version, v.spec),
                control=(st.active_name, int(st.active_version or 0), st.active_spec),
                steps=steps,
                step_duration_s=b.step_duration_s,
                criteria=Criteria(
                    **{f: getattr(b.criteria, f) for f in b.criteria.__struct_fields__}
                ),
                actor=r.actor,
            )
            out = machine.canary_dict(c)
        out["published"] = await ctx.publisher.publish_current()
        return out

    async def get_canary(r: Req) -> dict[str, Any]:
        async with db.session() as s:
            c = (
                await s.execute(select(Canary).where(Canary.id == r.path["id"]))
            ).scalar_one_or_none()
            if c is None:
                raise not_found("canary", r.path["id"])
            out = machine.canary_dict(c)
            control, candidate, extra = await machine.evaluation_inputs(s, c)
            out["current"] = {
                **extra,
                "elapsed_s": round(time.time() - c.window_started_at, 3),
                "control": control.summary(),
                "candidate": candidate.summary(),
            }
            decisions = (
                await s.execute(
                    select(CanaryDecision)
                    .where(CanaryDecision.canary_id == c.id)
                    .order_by(CanaryDecision.id)
                )
            ).scalars()
            out["decisions"] = [machine.decision_dict(d) for d in decisions]
        return out

    def canary_action(action: str):
        async def handler(r: Req) -> dict[str, Any]:
            reason = getattr(r.body, "reason", "") or f"{action} by {r.actor}"
            async with db.transaction() as s:
                c = await machine.lock_canary(s, r.path["id"])
                if c is None:
                    raise not_found("canary", r.path["id"])
                allowed = {
                    "pause": ("running",),
                    "resume": ("paused",),
                    "promote": ("running", "paused"),
                    "abort": ("running", "paused"),
                }[action]
                if c.state not in allowed:
                    raise conflict(f"cannot {action} a canary that is {c.state}")
                control, candidate, extra = await machine.evaluation_inputs(s, c)
                numbers = {
                    **extra,
                    "elapsed_s": round(time.time() - c.window_started_at, 3),
                    "control": control.summary(),
                    "candidate": candidate.summary(),
                }
                step = action
                if action == "promote":
                    step = "complete" if r.body.to == "full" else "advance"
                    if c.state == "paused" and step == "advance":
                        c.state = "running"
                changed = await machine.apply(s, c, step, reason, numbers, r.actor)
                out = machine.canary_dict(c)
            if changed:
                out["published"] = await ctx.publisher.publish_current()
            return out

        handler.__name__ = f"{action}_canary"
        return handler

    # ------------------------------------------------------------------ workers
    async def _workers(ids: list[str] | None = None) -> list[dict[str, Any]]:
        async with db.session() as s:
            controls = {
                w.worker_id: w.action
                for w in (await s.execute(select(WorkerControlState))).scalars()
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
                if action == "uncordon":
                    if row is not None:
                        await s.delete(row)
                elif row is None:
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

    # ------------------------------------------------------------------ alerts
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

    async def _alert(s, alert_id: str, lock: bool = False) -> AlertRow:
        q = select(AlertRow).where(AlertRow.id == alert_id)
        if lock:
            q = q.with_for_update()
        a = (await s.execute(q)).scalar_one_or_none()
        if a is None:
            raise not_found("alert", alert_id)
        return a

    async def get_alert(r: Req) -> dict[str, Any]:
        async with db.session() as s:
            return alert_dict(await _alert(s, r.path["id"]))

    async def ack_alert(r: Req) -> dict[str, Any]:
        async with db.transaction() as s:
            a = await _alert(s, r.path["id"], lock=True)
            if a.state != "firing":
                raise conflict(f"alert is {a.state}; only firing alerts can be acknowledged")
            before = alert_dict(a)
            a.state, a.acked_by, a.acked_at = "acknowledged", r.actor, datetime.now(UTC)
            out = alert_dict(a)
            audit.record(s, r.actor, "alert.ack", "alert", a.id, before, out)
        return out

    async def resolve_alert(r: Req) -> dict[str, Any]:
        async with db.transaction() as s:
            a = await _alert(s, r.path["id"], lock=True)
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

    async def _create_silence(
        s, actor: str, duration_s: float, comment: str, **match: Any
    ) -> dict[str, Any]:
        import uuid

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

    async def silence_alert(r: Req) -> dict[str, Any]:
        b: bodies.AlertSilence = r.body
        async with db.transaction() as s:
            a = await _alert(s, r.path["id"], lock=True)
            out = await _create_silence(
                s, r.actor, b.duration_s, b.comment, fingerprint=a.fingerprint
            )
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
            return await _create_silence(
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

    # ------------------------------------------------------------------ audit & tokens
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

    async def list_tokens(_r: Req) -> dict[str, Any]:
        async with db.session() as s:
            rows = (await s.execute(select(ApiToken).order_by(ApiToken.id))).scalars()
            return {"tokens": [token_dict(t) for t in rows]}

    async def create_api_token(r: Req) -> dict[str, Any]:
        b: bodies.TokenCreate = r.body
        token, record = await create_token(db, b.role, b.name)
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

    # ------------------------------------------------------------------ table
    name_p = {"name": bodies.Name}
    canary_p = {"id": bodies.Uuid}
    alert_p = {"id": bodies.Uuid}
    worker_p = {"worker_id": bodies.WorkerId}
    routes: list[Route] = [
        Route("GET", "/health", health, "liveness and dependencies", "meta", role="public"),
        Route("GET", f"{V1}/health", health, "liveness and dependencies", "meta", role="public"),
        Route("GET", f"{V1}/openapi.json", openapi, "this document", "meta", role="public"),
        Route(
            "GET",
            f"{V1}/policy-schemas",
            policy_schemas,
            "JSON Schema of each routing algorithm's params",
            "policies",
        ),
        Route("GET", f"{V1}/policies", list_policies, "list policies", "policies"),
        Route(
            "POST",
            f"{V1}/policies",
            create_policy,
            "create a policy (version 1)",
            "policies",
            role="admin",
            body=bodies.PolicyCreate,
            status=201,
        ),
        Route(
            "POST",
            f"{V1}/policies/validate",
            validate_policy,
            "validate a spec without saving it",
            "policies",
            body=bodies.PolicySpec,
        ),
        Route(
            "GET",
            f"{V1}/policies/{{name}}",
            get_policy,
            "a policy with all versions",
            "policies",
            path_params=name_p,
        ),
        Route(
            "PUT",
            f"{V1}/policies/{{name}}",
            update_policy,
            "update: a new spec makes a new version",
            "policies",
            role="admin",
            body=bodies.PolicyUpdate,
            path_params=name_p,
        ),
        Route(
            "DELETE",
            f"{V1}/policies/{{name}}",
            delete_policy,
            "delete a policy that is neither active nor in a canary",
            "policies",
            role="admin",
            path_params=name_p,
        ),
        Route(
            "GET",
            f"{V1}/policies/{{name}}/versions/{{version}}",
            get_policy_version,
            "one version of a policy",
            "policies",
            path_params={**name_p, "version": bodies.Version},
        ),
        Route(
            "POST",
            f"{V1}/policies/{{name}}/activate",
            activate_policy,
            "make a version active (routers apply it within 1 s)",
            "policies",
            role="admin",
            body=bodies.PolicyActivate,
            body_required=False,
            path_params=name_p,
        ),
        Route(
            "GET", f"{V1}/active-policy", active_policy, "the active policy and canary", "policies"
        ),
        Route(
            "GET",
            f"{V1}/canaries",
            list_canaries,
            "list canaries",
            "canaries",
            query={"state": bodies.CanaryState, "limit": bodies.Limit},
        ),
        Route(
            "POST",
            f"{V1}/canaries",
            create_canary,
            "start a canary of a candidate policy against the active one",
            "canaries",
            role="admin",
            body=bodies.CanaryCreate,
            status=201,
        ),
        Route(
            "GET",
            f"{V1}/canaries/{{id}}",
            get_canary,
            "a canary with its current numbers and every decision",
            "canaries",
            path_params=canary_p,
        ),
        Route(
            "POST",
            f"{V1}/canaries/{{id}}/pause",
            canary_action("pause"),
            "hold the current traffic split; the evaluator stops deciding",
            "canaries",
            role="admin",
            body=bodies.ActionBody,
            body_required=False,
            path_params=canary_p,
        ),
        Route(
            "POST",
            f"{V1}/canaries/{{id}}/resume",
            canary_action("resume"),
            "resume evaluation (a new window starts)",
            "canaries",
            role="admin",
            body=bodies.ActionBody,
            body_required=False,
            path_params=canary_p,
        ),
        Route(
            "POST",
            f"{V1}/canaries/{{id}}/promote",
            canary_action("promote"),
            "promote by hand: to 100 % and done (to=full) or one step (to=next)",
            "canaries",
            role="admin",
            body=bodies.CanaryPromote,
            body_required=False,
            path_params=canary_p,
        ),
        Route(
            "POST",
            f"{V1}/canaries/{{id}}/abort",
            canary_action("abort"),
            "abort: all traffic back to the active policy",
            "canaries",
            role="admin",
            body=bodies.ActionBody,
            body_required=False,
            path_params=canary_p,
        ),
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
        Route(
            "GET",
            f"{V1}/audit",
            list_audit,
            "audit log, newest first",
            "audit",
            query={
                "target_type": Annotated[str, Meta(max_length=32)],
                "target_id": Annotated[str, Meta(max_length=256)],
                "actor": Annotated[str, Meta(max_length=128)],
                "limit": bodies.Limit,
            },
        ),
        Route(
            "GET",
            f"{V1}/tokens",
            list_tokens,
            "API tokens (digests are never shown)",
            "tokens",
            role="admin",
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
        ),
        Route(
            "DELETE",
            f"{V1}/tokens/{{id}}",
            revoke_token,
            "revoke a token",
            "tokens",
            role="admin",
            path_params={"id": Annotated[int, Meta(ge=1, le=2_000_000_000)]},
        ),
    ]
    return routes
