"""Canary routes: ``/api/v1/canaries[...]`` (start, inspect, pause, resume, promote, abort).

Invariants:
- At most one canary is open (running or paused) at a time, and it compares a candidate
  policy version against the active one; a canary of the active version itself is refused.
- Steps strictly increase. State changes go through :mod:`services.api.canary.machine` in
  one locked transaction with their decision record; the new split is published only after
  the commit, and only when the state changed.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import select

from services.api import bodies
from services.api.canary import machine
from services.api.canary.evaluator import Criteria
from services.api.context import ApiContext
from services.api.framework import ApiError, Req, Route, conflict, not_found
from services.api.models import Canary, CanaryDecision
from services.api.publisher import lock_state, open_canary
from services.api.routes.common import V1
from services.api.routes.policies import policy_row, policy_version

# which states each manual action may start from
ALLOWED_FROM: dict[str, tuple[str, ...]] = {
    "pause": ("running",),
    "resume": ("paused",),
    "promote": ("running", "paused"),
    "abort": ("running", "paused"),
}


def routes(ctx: ApiContext) -> list[Route]:
    db = ctx.db

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
            p = await policy_row(s, b.policy)
            v = await policy_version(s, p, b.version)
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
                if c.state not in ALLOWED_FROM[action]:
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

    canary_p = {"id": bodies.Uuid}
    return [
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
    ]
