"""The admin API over HTTP with real Postgres and real NATS: auth, policies, workers, alerts,
audit, tokens, and the OpenAPI document."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from services.api.testing import ApiHarness, start_api
from services.common.bus import Bus
from services.common.schemas import (
    Alert,
    PolicyUpdated,
    WorkerCapacity,
    WorkerControl,
    WorkerHeartbeat,
    WorkerLoad,
    decode,
)
from services.common.streams import raise_alert, require_alert_streams, require_policy_stream

BOOT = "bootstrap-secret-token-for-tests"


@pytest.fixture
async def api(
    fresh_database_url: str, nats_url: str, subject_prefix: str, bus: Bus
) -> AsyncIterator[ApiHarness]:
    h = await start_api(fresh_database_url, nats_url, subject_prefix, admin_token=BOOT)
    try:
        yield h
    finally:
        await h.close()


async def until(pred: Callable[[], Awaitable[Any]], timeout: float = 10.0) -> Any:
    """Poll an HTTP-visible condition (no event exists for it) until true, with a deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = await pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


async def collect(bus: Bus, subject: str, msg_type: type) -> asyncio.Queue:
    q: asyncio.Queue = asyncio.Queue()

    async def on(obj, _raw) -> None:
        await q.put(obj)

    await bus.subscribe(subject, msg_type, on)
    return q


# ----------------------------------------------------------------------------- auth
async def test_auth_roles_and_errors(api: ApiHarness) -> None:
    assert (await api.call("GET", "/api/v1/health", token=None))[0] == 200
    status, body = await api.call("GET", "/api/v1/policies", token=None)
    assert status == 401 and body["error"]["code"] == "unauthorized"
    assert (await api.call("GET", "/api/v1/policies", token="kvg_wrong"))[0] == 401
    assert (await api.call("GET", "/api/v1/policies", token="viewer"))[0] == 200
    status, body = await api.call(
        "POST", "/api/v1/policies", {"name": "a", "spec": {"name": "random"}}, token="viewer"
    )
    assert status == 403 and body["error"]["code"] == "forbidden"
    status, _ = await api.call(
        "POST", "/api/v1/policies", {"name": "a", "spec": {"name": "random"}}, token=BOOT
    )
    assert status == 201
    # a revoked token stops working
    status, tok = await api.call("POST", "/api/v1/tokens", {"role": "viewer", "name": "tmp"})
    assert status == 201 and tok["token"].startswith("kvg_")
    assert (await api.call("GET", "/api/v1/policies", token=tok["token"]))[0] == 200
    assert (await api.call("DELETE", f"/api/v1/tokens/{tok['id']}"))[0] == 200
    assert (await api.call("GET", "/api/v1/policies", token=tok["token"]))[0] == 401
    status, listed = await api.call("GET", "/api/v1/tokens")
    assert all("hash" not in str(t) for t in listed["tokens"])


async def test_query_and_path_values_are_checked_as_text(api: ApiHarness) -> None:
    """What travels as text (query and path values) is read by its declared type and limits;
    anything else is a 400 naming the parameter (the schema fuzz leaves these to this test:
    an invalid value there may read as a valid one on the wire)."""
    for query, field in (
        ("limit=0", "limit"),  # below its minimum
        ("limit=1001", "limit"),  # above its maximum
        ("limit=ten", "limit"),  # not an integer
        ("limit=", "limit"),  # empty
        ("limit=5&limit=6", "limit"),  # given twice
        ("page=2", "page"),  # unknown
    ):
        st, err = await api.call("GET", f"/api/v1/audit?{query}")
        assert st == 400 and err["error"]["field"] == field, (query, st, err)
    st, err = await api.call("GET", "/api/v1/decisions?after=-1")
    assert st == 400 and err["error"]["field"] == "after", err
    assert (await api.call("GET", "/api/v1/decisions?after=0&limit=500"))[0] == 200
    st, err = await api.call("GET", "/api/v1/alerts/not-a-number")
    assert st == 400 and err["error"]["field"] == "id", err


async def test_every_mutating_route_needs_admin(api: ApiHarness) -> None:
    _, doc = await api.call("GET", "/api/v1/openapi.json", token=None)
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if method != "get" and not path.endswith("/validate"):  # validate changes nothing
                assert op.get("x-required-role") == "admin", (method, path)
                concrete = path.replace("{name}", "x").replace("{worker_id}", "w1")
                concrete = concrete.replace("{version}", "1").replace("{id}", "1")
                concrete = concrete.replace("{key_id}", "1")
                status, _ = await api.call(method.upper(), concrete, {}, token="viewer")
                assert status == 403, (method, path, status)


async def test_openapi_document_matches_the_routes(api: ApiHarness) -> None:
    from services.api.routes import build_routes

    assert api.service is not None and api.service.ctx is not None
    routes = build_routes(api.service.ctx)
    _, doc = await api.call("GET", "/api/v1/openapi.json", token=None)
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert documented == {(r.method, r.path) for r in routes}
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids))
    spec = doc["components"]["schemas"]["PolicySpec"]
    from services.core.policy import POLICY_SCHEMAS

    assert {v["title"] for v in spec["oneOf"]} == set(POLICY_SCHEMAS)
    assert doc["components"]["schemas"]["PolicyCreate"]["additionalProperties"] is False
    # every $ref names a schema the document has (the repin body's was missing)
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(doc)))
    assert refs <= set(doc["components"]["schemas"]), refs - set(doc["components"]["schemas"])


# ----------------------------------------------------------------------------- policies
async def test_policy_lifecycle_versions_activation_and_audit(api: ApiHarness, bus: Bus) -> None:
    status, body = await api.call(
        "POST",
        "/api/v1/policies",
        {"name": "kv", "spec": {"name": "kv_aware", "params": {"decode_weight": 8}}},
    )
    assert status == 201 and body["latest_version"] == 1
    assert body["spec"]["params"]["decode_weight"] == 8
    status, body = await api.call(
        "POST", "/api/v1/policies", {"name": "kv", "spec": {"name": "kv_aware"}}
    )
    assert status == 409
    status, body = await api.call(
        "POST",
        "/api/v1/policies",
        {"name": "bad", "spec": {"name": "kv_aware", "params": {"decode_weight": "x"}}},
    )
    assert status == 400 and body["error"]["field"] == "spec.params.decode_weight"
    status, body = await api.call(
        "POST", "/api/v1/policies", {"name": "bad", "spec": {"name": "nope"}}
    )
    assert status == 400 and body["error"]["field"] == "spec.name"
    status, body = await api.call(
        "POST", "/api/v1/policies", {"name": "bad", "spec": {"name": "random"}, "extra": 1}
    )
    assert status == 400 and body["error"]["field"] == "extra"
    status, body = await api.call(
        "POST", "/api/v1/policies", {"name": "B A D", "spec": {"name": "random"}}
    )
    assert status == 400 and body["error"]["field"] == "name"
    # validate without saving
    status, body = await api.call(
        "POST", "/api/v1/policies/validate", {"name": "prefix", "params": {}}, token="viewer"
    )
    assert status == 200 and body["spec"]["name"] == "prefix"
    status, body = await api.call(
        "POST", "/api/v1/policies/validate", {"name": "prefix", "params": {"zz": 1}}
    )
    assert status == 400 and body["error"]["field"] == "spec.params.zz"
    assert [p["name"] for p in (await api.call("GET", "/api/v1/policies"))[1]["policies"]] == ["kv"]
    # update -> version 2, version 1 kept
    status, body = await api.call(
        "PUT",
        "/api/v1/policies/kv",
        {"spec": {"name": "kv_aware", "params": {"decode_weight": 4}}, "description": "v2"},
    )
    assert status == 200 and body["latest_version"] == 2
    assert [v["version"] for v in body["versions"]] == [1, 2]
    status, v1 = await api.call("GET", "/api/v1/policies/kv/versions/1")
    assert v1["spec"]["params"]["decode_weight"] == 8
    # activate version 1: published to the POLICY stream for routers
    await require_policy_stream(bus)
    status, body = await api.call("POST", "/api/v1/policies/kv/activate", {"version": 1})
    assert status == 200 and body["published"] is True
    last = await bus.js.get_last_msg(bus.subjects.policy_stream, bus.subjects.policy_updated)
    notice = decode(PolicyUpdated, last.data)
    assert (notice.name, notice.version, notice.revision) == ("kv", 1, body["revision"])
    assert notice.spec["params"]["decode_weight"] == 8 and notice.canary is None
    # a second activation has a higher revision
    _, body2 = await api.call("POST", "/api/v1/policies/kv/activate")
    assert body2["version"] == 2 and body2["revision"] > body["revision"]
    # delete: active -> 409; unused -> gone
    assert (await api.call("DELETE", "/api/v1/policies/kv"))[0] == 409
    await api.call("POST", "/api/v1/policies", {"name": "spare", "spec": {"name": "random"}})
    assert (await api.call("DELETE", "/api/v1/policies/spare"))[0] == 200
    assert (await api.call("GET", "/api/v1/policies/spare"))[0] == 404
    # audit: who, what, before, after
    _, audit = await api.call("GET", "/api/v1/audit?target_type=policy")
    actions = [e["action"] for e in audit["entries"]]
    assert actions.count("policy.activate") == 2 and "policy.delete" in actions
    upd = next(e for e in audit["entries"] if e["action"] == "policy.update")
    assert upd["actor"].endswith("test-admin")
    assert upd["before"]["latest_version"] == 1 and upd["after"]["latest_version"] == 2
    deleted = next(e for e in audit["entries"] if e["action"] == "policy.delete")
    assert deleted["before"]["name"] == "spare" and deleted["after"] is None
    # an empty filter is refused (the OpenAPI document allows no empty query values), not
    # read as "actor is the empty string"
    st, err = await api.call("GET", "/api/v1/audit?actor=")
    assert st == 400 and err["error"]["field"] == "actor", err


async def test_slo_aware_refuses_kv_aware_cost_terms(api: ApiHarness) -> None:
    """A parameter slo_aware would ignore (kv_aware's stall_tpot_weight) is a 400 naming it,
    on create, update and validate, and nothing is stored; kv_aware takes it."""
    params = {"stall_tpot_weight": 10}
    kv = {"name": "kv_aware", "params": params}
    assert (await api.call("POST", "/api/v1/policies", {"name": "kv", "spec": kv}))[0] == 201
    slo = {"name": "slo_aware", "params": params}
    for method, path, body in (
        ("POST", "/api/v1/policies", {"name": "slo", "spec": slo}),
        ("PUT", "/api/v1/policies/kv", {"spec": slo}),
        ("POST", "/api/v1/policies/validate", slo),
    ):
        st, err = await api.call(method, path, body)
        assert st == 400, (path, st, err)
        assert set(err["error"]) == {"message", "code", "field"}, err
        assert err["error"]["code"] == "invalid_policy", err
        assert err["error"]["field"] == "spec.params.stall_tpot_weight", err
        assert "slo_aware does not take it" in err["error"]["message"], err
    _, listed = await api.call("GET", "/api/v1/policies")
    assert [(p["name"], p["latest_version"]) for p in listed["policies"]] == [("kv", 1)]
    _, schemas = await api.call("GET", "/api/v1/policy-schemas")
    assert "stall_tpot_weight" not in schemas["schemas"]["slo_aware"]["properties"]
    assert "stall_tpot_weight" in schemas["schemas"]["kv_aware"]["properties"]


async def test_policy_etag_and_if_match(api: ApiHarness, bus: Bus) -> None:
    """As a tenant's: GET names the latest version in ETag; PUT, DELETE and activation with
    If-Match write only over that version (else 412 in the error shape, nothing changed);
    two writers over one version: one wins, the other is a 412; without If-Match, as before."""
    from multidict import CIMultiDict

    assert api.session is not None
    auth = {"Authorization": f"Bearer {api.admin}"}
    url = f"{api.url}/api/v1/policies/im"
    spec = {"name": "kv_aware", "params": {"decode_weight": 8}}

    async def req(method: str, body=None, path: str = "", **headers: str):
        async with api.session.request(
            method, url + path, json=body, headers={**auth, **headers}
        ) as r:
            return r.status, await r.json(content_type=None), CIMultiDict(r.headers)

    def weight(p: dict) -> int:
        return p["spec"]["params"]["decode_weight"]

    st, _ = await api.call("POST", "/api/v1/policies", {"name": "im", "spec": spec})
    assert st == 201
    st, p, h = await req("GET")
    assert (st, h.get("ETag"), p["latest_version"]) == (200, '"1"', 1)

    # the version read: written, the ETag moves with the new version
    put = {"spec": {**spec, "params": {"decode_weight": 4}}}
    st, p, h = await req("PUT", put, **{"If-Match": '"1"'})
    assert (st, p["latest_version"], h.get("ETag")) == (200, 2, '"2"'), p

    # stale: 412 naming the current ETag, and nothing changed (no version, no audit entry)
    _, audit_before = await api.call("GET", "/api/v1/audit?target_type=policy&target_id=im")
    stale = {"spec": {**spec, "params": {"decode_weight": 2}}, "description": "lost"}
    st, err, h = await req("PUT", stale, **{"If-Match": '"1"'})
    assert st == 412 and err["error"]["code"] == "precondition_failed", err
    assert set(err["error"]) == {"message", "code", "field"}, err
    assert err["error"]["field"] == "If-Match" and h.get("ETag") == '"2"'
    assert "version 2" in err["error"]["message"]
    st, _, _ = await req("PUT", {"description": "weak"}, **{"If-Match": 'W/"2"'})
    assert st == 412  # a weak tag never matches
    st, err, _ = await req("PUT", {"description": "bad"}, **{"If-Match": "2"})
    assert st == 400 and err["error"]["field"] == "If-Match", err
    _, p, h = await req("GET")
    assert (p["latest_version"], weight(p), p["description"], h.get("ETag")) == (2, 4, "", '"2"')
    assert len(p["versions"]) == 2
    _, audit_after = await api.call("GET", "/api/v1/audit?target_type=policy&target_id=im")
    assert audit_after == audit_before

    # a list and * match; without If-Match the write is unconditional
    st, p, _ = await req("PUT", {"spec": spec}, **{"If-Match": '"9", "2"'})
    assert (st, p["latest_version"]) == (200, 3), p
    st, p, h = await req("PUT", {"spec": {**spec, "params": {"decode_weight": 5}}})
    assert (st, p["latest_version"], h.get("ETag")) == (200, 4, '"4"'), p

    # two writers over the same version at once: the row lock orders them, one wins and the
    # other's check sees the winner's version
    both = await asyncio.gather(
        *(
            req("PUT", {"spec": {**spec, "params": {"decode_weight": w}}}, **{"If-Match": '"4"'})
            for w in (6, 7)
        )
    )
    assert sorted(st for st, _, _ in both) == [200, 412], both
    (won,) = [p for st, p, _ in both if st == 200]
    _, p, _ = await req("GET")
    assert (p["latest_version"], weight(p)) == (5, weight(won))

    # activation: "the latest" only while it is still the version read
    st, err, h = await req("POST", {}, "/activate", **{"If-Match": '"4"'})
    assert st == 412 and err["error"]["code"] == "precondition_failed", err
    assert h.get("ETag") == '"5"'
    _, active = await api.call("GET", "/api/v1/active-policy")
    assert active["name"] != "im"  # nothing activated
    st, act, _ = await req("POST", {}, "/activate", **{"If-Match": '"5"'})
    assert (st, act["name"], act["version"]) == (200, "im", 5), act

    # DELETE: a stale version keeps it; the current one deletes it (once it is not active)
    await api.call("POST", "/api/v1/policies", {"name": "im2", "spec": spec})
    assert (await api.call("POST", "/api/v1/policies/im2/activate"))[0] == 200
    st, err, _ = await req("DELETE", **{"If-Match": '"4"'})
    assert st == 412 and err["error"]["code"] == "precondition_failed", err
    assert (await api.call("GET", "/api/v1/policies/im"))[0] == 200
    st, out, _ = await req("DELETE", **{"If-Match": '"5"'})
    assert (st, out["deleted"]) == (200, "im"), out
    assert (await api.call("GET", "/api/v1/policies/im"))[0] == 404

    # the OpenAPI document says so
    _, doc = await api.call("GET", "/api/v1/openapi.json", token=None)
    ops = doc["paths"]["/api/v1/policies/{name}"]
    assert "ETag" in ops["get"]["responses"]["200"]["headers"]
    assert "ETag" in ops["put"]["responses"]["200"]["headers"]
    activate = doc["paths"]["/api/v1/policies/{name}/activate"]["post"]
    for op in (ops["put"], ops["delete"], activate):
        assert "412" in op["responses"], op["operationId"]
        (hp,) = [x for x in op["parameters"] if x["in"] == "header"]
        assert (hp["name"], hp["required"]) == ("If-Match", False)


async def test_active_policy_etag_and_conditional_activation(api: ApiHarness, bus: Bus) -> None:
    """GET /active-policy names the active state's revision in ETag; PUT /active-policy with
    If-Match activates only over that revision (checked under the state row's lock): two
    operators who read the same revision activate at once, one wins and the other is a 412
    with the winner active; a stale revision is a 412 and changes nothing; without If-Match
    it activates as before."""
    from multidict import CIMultiDict

    assert api.session is not None
    auth = {"Authorization": f"Bearer {api.admin}"}
    url = f"{api.url}/api/v1/active-policy"

    async def req(method: str, body=None, **headers: str):
        async with api.session.request(method, url, json=body, headers={**auth, **headers}) as r:
            return r.status, await r.json(content_type=None), CIMultiDict(r.headers)

    for name in ("a", "b", "c"):
        spec = {"name": "kv_aware", "params": {"decode_weight": 8}}
        assert (await api.call("POST", "/api/v1/policies", {"name": name, "spec": spec}))[0] == 201
    await require_policy_stream(bus)
    st, active, h = await req("GET")
    assert (st, active["name"], h.get("ETag")) == (200, None, f'"{active["revision"]}"')
    first = h["ETag"]

    # the revision read: activated; the answer names the new revision
    st, act, h = await req("PUT", {"name": "a"}, **{"If-Match": first})
    assert (st, act["name"], act["version"]) == (200, "a", 1), act
    assert h.get("ETag") == f'"{act["revision"]}"' and h["ETag"] != first
    read = h["ETag"]

    # two operators read the same revision and activate different policies at once
    both = await asyncio.gather(
        req("PUT", {"name": "b"}, **{"If-Match": read}),
        req("PUT", {"name": "c"}, **{"If-Match": read}),
    )
    assert sorted(st for st, _, _ in both) == [200, 412], both
    (won,) = [p for st, p, _ in both if st == 200]
    (lost,) = [(p, h) for st, p, h in both if st == 412]
    assert lost[0]["error"]["code"] == "precondition_failed" and lost[0]["error"]["field"] == (
        "If-Match"
    ), lost
    assert lost[1].get("ETag") == f'"{won["revision"]}"'
    _, active, h = await req("GET")
    assert (active["name"], h["ETag"]) == (won["name"], f'"{won["revision"]}"')

    # stale: 412, nothing changed (state, audit, the notice routers read)
    _, audit_before = await api.call("GET", "/api/v1/audit?target_type=policy")
    notice = await bus.js.get_last_msg(bus.subjects.policy_stream, bus.subjects.policy_updated)
    loser = "c" if won["name"] == "b" else "b"
    st, err, h = await req("PUT", {"name": loser}, **{"If-Match": read})
    assert st == 412 and err["error"]["code"] == "precondition_failed", err
    assert set(err["error"]) == {"message", "code", "field"}, err
    assert h.get("ETag") == f'"{won["revision"]}"' and "revision" in err["error"]["message"]
    _, after, _ = await req("GET")
    assert after == active
    assert (await api.call("GET", "/api/v1/audit?target_type=policy"))[1] == audit_before
    again = await bus.js.get_last_msg(bus.subjects.policy_stream, bus.subjects.policy_updated)
    assert again.seq == notice.seq

    # the policy's own If-Match on POST .../activate keeps its meaning (its latest version)
    st, _ = await api.call("POST", f"/api/v1/policies/{loser}/activate")
    assert st == 200  # no If-Match: unconditional, as before
    st, act, _ = await req("PUT", {"name": "a", "version": 1})  # and so is PUT without it
    assert (st, act["name"], act["version"]) == (200, "a", 1), act
    st, err, _ = await req("PUT", {"name": "nope"}, **{"If-Match": "*"})
    assert st == 404, err
    st, err, _ = await req("PUT", {"name": "a", "version": 9})
    assert st == 404, err

    # the OpenAPI document says so
    _, doc = await api.call("GET", "/api/v1/openapi.json", token=None)
    ops = doc["paths"]["/api/v1/active-policy"]
    assert "ETag" in ops["get"]["responses"]["200"]["headers"]
    assert "412" in ops["put"]["responses"]
    (hp,) = [x for x in ops["put"]["parameters"] if x["in"] == "header"]
    assert (hp["name"], hp["required"]) == ("If-Match", False)


async def test_policy_resync_republishes_a_lost_notice(api: ApiHarness, bus: Bus) -> None:
    await api.call("POST", "/api/v1/policies", {"name": "rr", "spec": {"name": "round_robin"}})
    _, act = await api.call("POST", "/api/v1/policies/rr/activate")
    s = bus.subjects
    await bus.js.purge_stream(s.policy_stream)  # as if the notice had been lost
    assert api.service is not None and api.service.ctx is not None
    assert await api.service.ctx.publisher.resync() is True
    last = await bus.js.get_last_msg(s.policy_stream, s.policy_updated)
    assert decode(PolicyUpdated, last.data).revision == act["revision"]
    assert await api.service.ctx.publisher.resync() is False  # up to date: nothing sent


# ----------------------------------------------------------------------------- workers
def _hb(worker: str) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker,
        instance_id="i1",
        url="http://127.0.0.1:1",
        model="m",
        capacity=WorkerCapacity(
            block_size=16, num_gpu_blocks=1000, max_num_seqs=8, max_model_len=4096
        ),
        ts=time.time(),
    )


async def test_workers_health_load_controls_and_breaker(api: ApiHarness, bus: Bus) -> None:
    s = bus.subjects
    await bus.publish(s.heartbeat("w1"), _hb("w1"))
    await bus.publish(
        s.telemetry("w1"),
        WorkerLoad(
            worker_id="w1",
            ts=time.time(),
            running=3,
            waiting=1,
            kv_usage=0.42,
            kv_blocks_total=1000,
            kv_blocks_free=580,
        ),
    )

    async def listed() -> Any:
        _, body = await api.call("GET", "/api/v1/workers", token="viewer")
        w = [x for x in body["workers"] if x["worker_id"] == "w1"]
        return w[0] if w and w[0]["load"] else None

    w = await until(listed)
    assert w["health"] == "healthy" and w["kv"]["usage"] == 0.42 and w["load"]["running"] == 3
    assert w["admin_state"] == "active" and w["breaker"] == "closed"
    # cordon: published at once and re-published periodically (for late routers)
    controls = await collect(bus, s.worker_control("w1"), WorkerControl)
    status, body = await api.call("POST", "/api/v1/workers/w1/cordon", {"reason": "maint"})
    assert status == 200 and body["admin_state"] == "cordoned" and body["published"]
    first = await asyncio.wait_for(controls.get(), 5)
    again = await asyncio.wait_for(controls.get(), 5)
    assert first.action == again.action == "cordon"
    await api.call("POST", "/api/v1/workers/w1/drain")
    assert (await api.call("GET", "/api/v1/workers/w1"))[1]["admin_state"] == "draining"
    status, body = await api.call("POST", "/api/v1/workers/w1/uncordon")
    assert body["admin_state"] == "active"
    # breaker state comes from open circuit_open alerts
    await require_alert_streams(bus)
    await raise_alert(
        bus,
        Alert(
            fingerprint="circuit_open:w1",
            kind="circuit_open",
            severity="critical",
            source="router",
            worker_id="w1",
        ),
    )

    async def breaker_open() -> bool:
        return (await api.call("GET", "/api/v1/workers/w1"))[1]["breaker"] == "open"

    await until(breaker_open)
    assert (await api.call("GET", "/api/v1/workers/nope"))[0] == 404
    assert (await api.call("POST", "/api/v1/workers/bad.id/cordon"))[0] == 400
    _, audit = await api.call("GET", "/api/v1/audit?target_type=worker")
    assert [e["action"] for e in audit["entries"]][:3] == [
        "worker.uncordon",
        "worker.drain",
        "worker.cordon",
    ]


# ----------------------------------------------------------------------------- alerts
async def test_alert_flow_dedup_resolve_ack_silence(api: ApiHarness, bus: Bus) -> None:
    s = bus.subjects
    await require_alert_streams(bus)
    published: asyncio.Queue = asyncio.Queue()

    async def on(msg) -> None:
        await published.put((msg.subject, decode(Alert, msg.data)))

    await bus.js.subscribe(s.alerts_all, cb=on, stream=s.alerts_stream, ordered_consumer=True)

    def sig(state: str = "firing", sev: str = "warning", fp: str = "kv_starved:w2") -> Alert:
        return Alert(
            fingerprint=fp,
            kind="kv_starved",
            severity=sev,
            state=state,
            source="telemetry",
            worker_id="w2",
            summary="batch starved",
            remedy="raise max_tokens_in_paged_kv_cache",
            details={"active": 8},
        )

    await raise_alert(bus, sig())
    subject, first = await asyncio.wait_for(published.get(), 5)
    assert subject == s.alert("warning", "kv_starved") and first.state == "firing"
    assert first.alert_id
    await raise_alert(bus, sig())  # duplicate: counted, not re-published

    async def counted() -> Any:
        _, body = await api.call("GET", "/api/v1/alerts?kind=kv_starved", token="viewer")
        return body if body["alerts"] and body["alerts"][0]["count"] == 2 else None

    body = await until(counted)
    assert body["total"] == 1 and body["alerts"][0]["remedy"].startswith("raise")
    assert published.empty()
    # resolution from the source is published too
    done = sig("resolved")
    done.summary = "w2: kv_starved resolved (condition cleared)"
    await raise_alert(bus, done)
    subject, resolved = await asyncio.wait_for(published.get(), 5)
    assert resolved.state == "resolved" and resolved.alert_id == first.alert_id
    # the resolution says so, not the opening text again
    assert resolved.summary == "w2: kv_starved resolved (condition cleared)"
    _, a = await api.call("GET", f"/api/v1/alerts/{first.alert_id}")
    assert a["state"] == "resolved" and a["resolved_by"] == "source:telemetry"
    # it fires again: a new alert; ack it, then resolve by hand (published)
    await raise_alert(bus, sig(sev="critical"))
    _, again = await asyncio.wait_for(published.get(), 5)
    assert again.alert_id != first.alert_id and again.severity == "critical"
    status, acked = await api.call("POST", f"/api/v1/alerts/{again.alert_id}/ack")
    assert status == 200 and acked["state"] == "acknowledged"
    assert (await api.call("POST", f"/api/v1/alerts/{again.alert_id}/ack"))[0] == 409
    _, filtered = await api.call("GET", "/api/v1/alerts?state=acknowledged&severity=critical")
    assert [x["id"] for x in filtered["alerts"]] == [again.alert_id]
    _, none = await api.call("GET", "/api/v1/alerts?worker=w9")
    assert none["total"] == 0
    await api.call("POST", f"/api/v1/alerts/{again.alert_id}/resolve", {"reason": "fixed"})
    _, by_hand = await asyncio.wait_for(published.get(), 5)
    assert by_hand.state == "resolved" and by_hand.alert_id == again.alert_id
    assert by_hand.summary.startswith("resolved by ") and "was: batch starved" in by_hand.summary
    # silence the fingerprint: the next firing is stored (silenced) but not published
    status, sil = await api.call(
        "POST", f"/api/v1/alerts/{again.alert_id}/silence", {"duration_s": 600}
    )
    assert status == 201 and sil["fingerprint"] == "kv_starved:w2"
    await raise_alert(bus, sig())
    await raise_alert(bus, sig(fp="other:w3"))  # not silenced: published
    subject, other = await asyncio.wait_for(published.get(), 5)
    assert other.fingerprint == "other:w3"
    _, firing = await api.call("GET", "/api/v1/alerts?state=firing&kind=kv_starved")
    assert firing["total"] == 2
    silenced = {a["fingerprint"]: a["silenced"] for a in firing["alerts"]}
    assert silenced == {"kv_starved:w2": True, "other:w3": False}
    assert published.empty()
    _, sils = await api.call("GET", "/api/v1/silences")
    assert [x["id"] for x in sils["silences"]] == [sil["id"]]
    assert (await api.call("DELETE", f"/api/v1/silences/{sil['id']}"))[0] == 200
    assert (await api.call("GET", "/api/v1/silences"))[1]["silences"] == []
    # invalid signals are dropped, the manager keeps going
    await bus.client.publish(s.alert_signal("junk"), b"\x93\x01\x02")
    await bus.js.publish(s.alert_signal("junk"), b"not msgpack")
    await raise_alert(bus, sig(fp="after-junk"))
    _, after = await asyncio.wait_for(published.get(), 5)
    assert after.fingerprint == "after-junk"


# ----------------------------------------------------------------------------- CLI
def test_token_cli_creates_a_working_token(fresh_database_url: str) -> None:
    from services.api.migrate import upgrade

    upgrade(fresh_database_url)
    env = {**os.environ, "KVGATE_DATABASE_URL": fresh_database_url}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "api",
            "token",
            "create",
            "--role",
            "viewer",
            "--name",
            "ops",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    token = out.stdout.strip()
    assert token.startswith("kvg_") and "\n" not in token
    listed = subprocess.run(
        [sys.executable, "-m", "services.cli", "api", "token", "list"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    ).stdout
    assert "viewer" in listed and "ops" in listed and token not in listed

    async def check() -> Any:
        from services.api.db import Database
        from services.api.tokens import TokenAuth

        db = Database(fresh_database_url)
        try:
            return await TokenAuth(db).lookup(token)
        finally:
            await db.close()

    principal = asyncio.run(check())
    assert principal is not None and principal.role == "viewer"
    helped = subprocess.run(
        [sys.executable, "-m", "services.cli", "api", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert helped.returncode == 0 and "token" in helped.stdout


async def test_policy_named_validate_cannot_shadow_the_validate_action(api: ApiHarness) -> None:
    status, body = await api.call(
        "POST", "/api/v1/policies", {"name": "validate", "spec": {"name": "random"}}
    )
    assert status == 400 and body["error"]["field"] == "name", body
    status, body = await api.call("POST", "/api/v1/policies/validate", {"name": "random"})
    assert status == 200 and body["valid"] is True, body
    _, doc = await api.call("GET", "/api/v1/openapi.json", token=None)
    name_schema = doc["components"]["schemas"]["PolicyCreate"]["properties"]["name"]
    assert name_schema["not"] == {"enum": ["validate"]}
