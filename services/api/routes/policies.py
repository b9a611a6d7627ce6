"""Policy routes: ``/api/v1/policy-schemas``, ``/policies[...]`` and ``/active-policy``.

Invariants:
- A spec is stored only after the core's validator accepted and normalised it
  (:func:`services.core.policy.validate_policy_spec`); a bad spec is a 400 naming the field
  as ``spec.<field>``.
- Versions only grow: a PUT with a spec adds version ``latest + 1``; stored versions never
  change. A policy that is active or in an open canary cannot be deleted.
- Activation bumps the policy-state revision in the same transaction as its audit entry and
  publishes only after the commit.
- A policy's ETag is its latest version (:func:`services.api.framework.etag`). A PUT, DELETE
  or activation with ``If-Match`` checks it under the policy row's lock, in the transaction
  that writes: a stale tag is a 412 and nothing changes.
- The active policy's ETag (``/active-policy``) is the policy-state revision, which every
  change of what routers run bumps (activation, canary steps). ``PUT /active-policy`` with
  ``If-Match`` checks it under the state row's lock, in the transaction that writes: of two
  activations over one revision read, one wins and the other is a 412.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select

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
from services.api.models import Policy, PolicyState, PolicyVersion
from services.api.publisher import lock_state, open_canary
from services.api.routes.common import V1, iso, version_history

VERSION_TAG = 'the policy\'s latest version, quoted (`"7"`); a description-only update keeps it'
REVISION_TAG = (
    'the policy-state revision, quoted (`"12"`): it moves with every change of what routers run '
    "(an activation, a canary's start, steps and end; not a pause or resume)"
)


def validate_spec(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The core's validator: normalised params, or 400 naming the field."""
    from services.core.policy import PolicyError, validate_policy_spec

    try:
        return {"name": name, "params": validate_policy_spec(name, params)}
    except PolicyError as exc:
        raise ApiError(400, "invalid_policy", exc.message, f"spec.{exc.field}") from None


async def policy_row(s, name: str, lock: bool = False) -> Policy:
    q = select(Policy).where(Policy.name == name)
    if lock:
        q = q.with_for_update()
    p = (await s.execute(q)).scalar_one_or_none()
    if p is None:
        raise not_found("policy", name)
    return p


async def policy_version(s, p: Policy, version: int | None) -> PolicyVersion:
    """Version ``version`` of ``p`` (its latest when None), or 404."""
    v = version or p.latest_version
    row = (
        await s.execute(
            select(PolicyVersion).where(PolicyVersion.policy_id == p.id, PolicyVersion.version == v)
        )
    ).scalar_one_or_none()
    if row is None:
        raise not_found(f"version of policy {p.name!r}", v)
    return row


async def policy_out(s, p: Policy, with_versions: bool = False) -> dict[str, Any]:
    st = (await s.execute(select(PolicyState).where(PolicyState.id == 1))).scalar_one()
    latest = await policy_version(s, p, None)
    out = {
        "name": p.name,
        "description": p.description,
        "latest_version": p.latest_version,
        "spec": latest.spec,
        "active_version": st.active_version if st.active_name == p.name else None,
        "created_at": iso(p.created_at),
        "updated_at": iso(p.updated_at),
        "created_by": p.created_by,
    }
    if with_versions:
        out["versions"] = await version_history(s, PolicyVersion, PolicyVersion.policy_id, p.id)
    return out


def routes(ctx: ApiContext) -> list[Route]:
    db = ctx.db

    async def policy_schemas(_r: Req) -> dict[str, Any]:
        return {"schemas": ctx.policy_schemas}

    async def list_policies(r: Req) -> dict[str, Any]:
        async with db.session() as s:
            rows = (await s.execute(select(Policy).order_by(Policy.name))).scalars().all()
            return {"policies": [await policy_out(s, p) for p in rows]}

    async def create_policy(r: Req) -> dict[str, Any]:
        b: bodies.PolicyCreate = r.body
        if b.name in bodies.RESERVED_POLICY_NAMES:
            raise ApiError(400, "invalid_body", f"policy name {b.name!r} is reserved", "name")
        spec = validate_spec(b.spec.name, b.spec.params)
        async with db.transaction() as s:
            exists = (await s.execute(select(Policy.id).where(Policy.name == b.name))).first()
            if exists:
                raise conflict(f"policy {b.name!r} exists; PUT a new version instead")
            p = Policy(name=b.name, description=b.description, latest_version=1, created_by=r.actor)
            s.add(p)
            await s.flush()
            s.add(PolicyVersion(policy_id=p.id, version=1, spec=spec, created_by=r.actor))
            await s.flush()
            out = await policy_out(s, p, with_versions=True)
            audit.record(s, r.actor, "policy.create", "policy", b.name, None, out)
        return out

    async def get_policy(r: Req) -> Reply:
        async with db.session() as s:
            out = await policy_out(s, await policy_row(s, r.path["name"]), with_versions=True)
        return Reply(out, {"ETag": etag(out["latest_version"])})

    async def get_policy_version(r: Req) -> dict[str, Any]:
        async with db.session() as s:
            p = await policy_row(s, r.path["name"])
            v = await policy_version(s, p, r.path["version"])
            return {
                "name": p.name,
                "version": v.version,
                "spec": v.spec,
                "created_at": iso(v.created_at),
                "created_by": v.created_by,
            }

    async def update_policy(r: Req) -> Reply:
        b: bodies.PolicyUpdate = r.body
        if b.spec is None and b.description is None:
            raise ApiError(400, "invalid_body", "give spec and/or description", "spec")
        spec = validate_spec(b.spec.name, b.spec.params) if b.spec is not None else None
        expected = if_match(r.request)
        async with db.transaction() as s:
            # the row lock orders writers: the version checked is the one this write replaces
            p = await policy_row(s, r.path["name"], lock=True)
            check_precondition(expected, f"policy {p.name!r}", p.latest_version)
            before = await policy_out(s, p)
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
            out = await policy_out(s, p, with_versions=True)
            audit.record(
                s,
                r.actor,
                "policy.update",
                "policy",
                p.name,
                before,
                {k: v for k, v in out.items() if k != "versions"},
            )
        return Reply(out, {"ETag": etag(out["latest_version"])})

    async def delete_policy(r: Req) -> dict[str, Any]:
        name = r.path["name"]
        expected = if_match(r.request)
        async with db.transaction() as s:
            st = await lock_state(s)
            p = await policy_row(s, name, lock=True)
            check_precondition(expected, f"policy {name!r}", p.latest_version)
            if st.active_name == name:
                raise conflict(f"policy {name!r} is active; activate another policy first")
            c = await open_canary(s)
            if c is not None and name in (c.candidate_name, c.control_name):
                raise conflict(f"policy {name!r} is in canary {c.id}; abort it first")
            before = await policy_out(s, p, with_versions=True)
            await s.delete(p)
            audit.record(s, r.actor, "policy.delete", "policy", name, before, None)
        return {"deleted": name}

    async def validate_policy(r: Req) -> dict[str, Any]:
        b: bodies.PolicySpec = r.body
        return {"valid": True, "spec": validate_spec(b.name, b.params)}

    async def activate(
        r: Req,
        name: str,
        version: int | None,
        policy_tags: list[str] | None,
        state_tags: list[str] | None,
    ) -> dict[str, Any]:
        """Activate ``version`` (None: the latest) of policy ``name``: with ``policy_tags``
        only over the policy's latest version read, with ``state_tags`` only over the
        policy-state revision read (each a 412 when stale, nothing changed)."""
        async with db.transaction() as s:
            c = await open_canary(s)
            if c is not None:
                raise conflict(f"canary {c.id} is {c.state}; promote or abort it first")
            st = await lock_state(s)
            check_precondition(state_tags, "the active policy", st.revision, "revision")
            # locked as DELETE locks it (state, then policy): a PUT cannot add the version
            # "latest" means between the check and the activation
            p = await policy_row(s, name, lock=policy_tags is not None)
            check_precondition(policy_tags, f"policy {p.name!r}", p.latest_version)
            v = await policy_version(s, p, version)
            before = {"name": st.active_name, "version": st.active_version, "revision": st.revision}
            st.active_name, st.active_version, st.active_spec = p.name, v.version, v.spec
            st.revision += 1
            st.updated_at = datetime.now(UTC)
            after = {"name": p.name, "version": v.version, "revision": st.revision}
            audit.record(s, r.actor, "policy.activate", "policy", p.name, before, after)
        published = await ctx.publisher.publish_current()
        return {**after, "spec": v.spec, "published": published}

    async def activate_policy(r: Req) -> dict[str, Any]:
        b: bodies.PolicyActivate = r.body
        return await activate(r, r.path["name"], b.version, if_match(r.request), None)

    async def set_active_policy(r: Req) -> Reply:
        b: bodies.ActivePolicySet = r.body
        out = await activate(r, b.name, b.version, None, if_match(r.request))
        return Reply(out, {"ETag": etag(out["revision"])})

    async def active_policy(_r: Req) -> Reply:
        async with db.session() as s:
            st = (await s.execute(select(PolicyState).where(PolicyState.id == 1))).scalar_one()
            c = await open_canary(s)
        out = {
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
        return Reply(out, {"ETag": etag(st.revision)})

    name_p = {"name": bodies.Name}
    return [
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
            etag=VERSION_TAG,
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
            etag=VERSION_TAG,
            if_match=VERSION_TAG,
            description="With `If-Match` (the ETag of a GET) the update is made only if the "
            "policy's latest version is still that one, else 412 and nothing changes: a "
            "read-modify-write cannot lose another writer's version. Without it, the update "
            "is unconditional.",
        ),
        Route(
            "DELETE",
            f"{V1}/policies/{{name}}",
            delete_policy,
            "delete a policy that is neither active nor in a canary",
            "policies",
            role="admin",
            path_params=name_p,
            if_match=VERSION_TAG,
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
            if_match=VERSION_TAG,
            description="`version` defaults to the latest. With `If-Match` (the ETag of a "
            "GET) the activation is made only if the policy's latest version is still that "
            'one, else 412 and nothing changes: activating "the latest" cannot pick up a '
            "version written since it was reviewed. A named `version` never changes (stored "
            "versions are immutable).",
        ),
        Route(
            "GET",
            f"{V1}/active-policy",
            active_policy,
            "the active policy and canary",
            "policies",
            etag=REVISION_TAG,
        ),
        Route(
            "PUT",
            f"{V1}/active-policy",
            set_active_policy,
            "make a policy's version active (routers apply it within 1 s)",
            "policies",
            role="admin",
            body=bodies.ActivePolicySet,
            etag=REVISION_TAG,
            if_match=REVISION_TAG,
            description="`version` defaults to the policy's latest. With `If-Match` (the ETag "
            "of `GET /api/v1/active-policy`) the activation is made only if what routers run "
            "is still what was read, else 412 and nothing changes: of two operators who read "
            "the same state and activate at once, one wins and the other is told. Without it, "
            "the activation is unconditional. (`POST /api/v1/policies/{name}/activate` is the "
            "same activation; its `If-Match` names the policy's latest version instead.)",
        ),
    ]
