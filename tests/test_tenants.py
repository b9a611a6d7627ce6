"""Tenants: identity (tenant keys, trusted gateway header, priority), the admin API's tenants,
keys and usage on a real Postgres, their hot reload into routers over a real NATS (signed),
and per-tenant usage equal to what the engines reported.

The directory tests at the top are pure (services.router.tenant_identity); the rest runs the
admin API, a simulated worker and routers in this event loop.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import msgspec
import pytest
from multidict import CIMultiDict

from services.api.testing import start_api
from services.common.schemas import (
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    TenantKeyRecord,
    TenantRecord,
    TenantsUpdated,
)
from services.common.signing import Signer, new_seed
from services.common.tenancy import NO_TENANT, Priority
from services.router.tenant_cache import TenantCacheLedger
from services.router.tenant_identity import TenancyError, TenantDirectory, key_digest
from services.router.tenant_reload import TENANT_UPDATES
from tests.test_router_e2e_sim import SimCluster
from tests.test_router_support import RouterProc, wait_until


# --------------------------------------------------------------------------- pure directory
def _directory(trust_header: bool = False, now: float = 1000.0) -> TenantDirectory:
    d = TenantDirectory(trust_header=trust_header, clock=lambda: now)
    d.apply(
        TenantsUpdated(
            revision=3,
            tenants=[
                TenantRecord(tenant_id="alpha", weight=2.0, default_priority="critical"),
                TenantRecord(
                    tenant_id="beta",
                    requests_per_min=60,
                    cache_isolation=True,
                    cache_salt="s3cret",
                ),
            ],
            keys=[
                TenantKeyRecord(key_id=1, tenant_id="alpha", digest=key_digest("ka").hex()),
                TenantKeyRecord(
                    key_id=2,
                    tenant_id="beta",
                    digest=key_digest("kb").hex(),
                    allow_priority_header=True,
                    expires_at=2000.0,
                ),
                TenantKeyRecord(
                    key_id=3, tenant_id="beta", digest=key_digest("old").hex(), expires_at=999.0
                ),
                # a key of a tenant the message does not hold is no key
                TenantKeyRecord(key_id=4, tenant_id="gone", digest=key_digest("kg").hex()),
            ],
        )
    )
    return d


def test_key_resolves_to_its_tenant_with_its_defaults() -> None:
    d = _directory()
    t = d.request_tenancy({"x-kvgate-priority": "sheddable"}, "ka")
    # alpha's key may not choose its band: the header is ignored, the tenant's default holds
    assert (t.tenant_id, t.priority, t.weight, t.cache_salt) == (
        "alpha",
        Priority.CRITICAL,
        2.0,
        None,
    )
    b = d.request_tenancy({"x-kvgate-priority": "critical"}, "kb")
    assert (b.tenant_id, b.priority, b.cache_salt) == ("beta", Priority.CRITICAL, "s3cret")
    assert d.request_tenancy({}, "kb").priority is Priority.STANDARD
    assert d.get("beta").quota.requests_per_min == 60
    assert d.get("nobody") is None and d.tenant("nobody").weight == 1.0
    assert d.resolve_key("kg") is None and d.key_refusal("kg") == "unknown"
    with pytest.raises(TenancyError) as bad:
        d.request_tenancy({"x-kvgate-priority": "urgent"}, "kb")
    assert (bad.value.status, bad.value.param) == (400, "x-kvgate-priority")


def test_expired_key_is_refused_at_its_expiry() -> None:
    assert _directory(now=1000.0).key_refusal("old") == "expired"
    assert _directory(now=1999.9).key_refusal("kb") == ""
    late = _directory(now=2000.0)
    assert late.key_refusal("kb") == "expired"
    with pytest.raises(TenancyError) as exc:
        late.request_tenancy({}, "kb")
    assert exc.value.status == 401


def test_tenant_header_is_trusted_only_when_configured() -> None:
    headers = {"x-kvgate-tenant": "beta", "x-kvgate-priority": "sheddable"}
    assert _directory(trust_header=False).request_tenancy(headers, None) == NO_TENANT
    t = _directory(trust_header=True).request_tenancy(headers, None)
    assert (t.tenant_id, t.priority, t.cache_salt) == ("beta", Priority.SHEDDABLE, "s3cret")
    llmd = _directory(trust_header=True).request_tenancy(
        {"x-gateway-inference-fairness-id": "team-x"}, None
    )
    assert (llmd.tenant_id, llmd.weight) == ("team-x", 1.0)  # unregistered: the defaults
    # a key is stronger than a header, trusted or not
    keyed = _directory(trust_header=True).request_tenancy(headers, "ka")
    assert keyed.tenant_id == "alpha"


def test_only_a_newer_directory_replaces_the_held_one() -> None:
    d = _directory()
    assert not d.apply(TenantsUpdated(revision=3))
    assert d.resolve_key("ka") is not None
    assert d.apply(TenantsUpdated(revision=4))  # every tenant deleted
    assert d.resolve_key("ka") is None and not d.has_keys


# --------------------------------------------------------------------------- cache ledger
def _batch(seq: int, *events, instance: str = "i1") -> KvEventBatch:
    return KvEventBatch(worker_id="w", instance_id=instance, seq=seq, ts=0.0, events=list(events))


def test_cache_ledger_owner_held_evicted_and_who_caused_it() -> None:
    led = TenantCacheLedger()
    led.claim("w", "a", [1, 2, 3])  # claimed before the engine reports them
    led.apply(_batch(1, BlockStored(keys=[1, 2, 3], block_size=16)))
    assert led.held == {"a": 3}
    # b reuses a's prefix (served from cache: not charged) and computes block 4; storing it
    # made the engine evict a's block 3
    led.claim("w", "b", [4])
    led.apply(_batch(2, BlockRemoved(keys=[3]), BlockStored(keys=[4], block_size=16)))
    assert (led.held["a"], led.held["b"]) == (2, 1)
    assert (led.evicted["a"], led.caused["b"], led.caused["a"]) == (1, 1, 0)
    # reported stored before claimed (claims come after the reply): owned once claimed, and
    # the eviction that batch made is charged then
    led.apply(_batch(3, BlockStored(keys=[5, 6], block_size=16), BlockRemoved(keys=[1])))
    assert led.held["b"] == 1 and led.caused["b"] == 1
    led.claim("w", "b", [5, 6])
    assert (led.held["b"], led.caused["b"], led.evicted["a"]) == (3, 2, 2)
    # a evicting its own block is no eviction caused to another tenant
    led.claim("w", "a", [7])
    led.apply(_batch(4, BlockStored(keys=[7], block_size=16), BlockRemoved(keys=[2])))
    assert (led.evicted["a"], led.caused["a"]) == (3, 0)
    # never claimed (another router's request) and offload tiers count for nobody
    led.apply(
        _batch(
            5,
            BlockStored(keys=[9], block_size=16),
            BlockStored(keys=[5], block_size=16, tier="cpu"),
        )
    )
    assert sum(led.held.values()) == 4
    # a restarted worker's blocks are gone, not evicted
    led.apply(_batch(1, BlockStored(keys=[], block_size=16), instance="i2"))
    assert sum(led.held.values()) == 0 and led.evicted["a"] == 3
    # bounded: the older generation of waiting claims is dropped whole
    small = TenantCacheLedger(max_recent=4)
    for k in range(10):
        small.claim("w", "a", [k])
    assert len(small.pending["w"]) <= 8 and small.pending["w"].pop(9) == "a"


# --------------------------------------------------------------------------- live
PROMPT = "You are a careful assistant. " * 40  # several full blocks


async def _ask(s: aiohttp.ClientSession, url: str, key: str | None, **headers: str):
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4}
    async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
        return r.status, msgspec.json.decode(await r.read())


async def test_tenant_keys_reload_usage_and_isolation(
    database_url: str, nats_url: str, subject_prefix: str, subjects, tmp_path
) -> None:
    seed = tmp_path / "api.nk"
    seed.write_bytes(new_seed())
    signer = Signer(seed.read_bytes())
    api = await start_api(database_url, nats_url, subject_prefix, signing_seed=str(seed))
    sims = await SimCluster(nats_url, subjects, 1).start()
    router = await RouterProc(
        nats_url, subjects, api_keys="static-key", trusted_signers=signer.public_key
    ).start()
    # behind a gateway: it trusts the gateway's header for the tenant, and the gateway
    # authenticates to it with its own (static) key; started once the directory exists, so it
    # reads it from the TENANTS stream
    gateway = RouterProc(
        nats_url,
        subjects,
        api_keys="gateway-key",
        trust_tenant_header=True,
        trusted_signers=signer.public_key,
    )
    r = router.router
    assert r is not None
    try:
        await router.wait_workers(1)
        st, alpha = await api.call(
            "POST",
            "/api/v1/tenants",
            {"tenant_id": "alpha", "spec": {"weight": 2, "quota": {"requests_per_min": 600}}},
        )
        assert st == 201 and alpha["version"] == 1 and alpha["published"], alpha
        st, _ = await api.call(
            "POST", "/api/v1/tenants", {"tenant_id": "beta", "spec": {"cache_isolation": True}}
        )
        assert st == 201
        st, ka = await api.call("POST", "/api/v1/tenants/alpha/keys", {"name": "ci"})
        assert st == 201 and ka["key"].startswith("kvt_")
        st, kb = await api.call("POST", "/api/v1/tenants/beta/keys", {})
        assert st == 201
        await wait_until(lambda: r.tenants.revision >= kb["revision"], 5, "directory applied")
        # the router holds the tenant's quota and weight
        assert r.tenants.get("alpha").quota.requests_per_min == 600
        assert r.tenants.get("alpha").weight == 2.0
        assert r.flow.quota_of("alpha").requests_per_min == 600  # what flow control reads
        await gateway.start()
        assert gateway.router is not None
        assert gateway.router.tenants.revision == kb["revision"]  # read at start
        await gateway.wait_workers(1)

        # a directory the api did not sign (anyone who can publish on the bus) changes nothing
        forged = TenantsUpdated(
            revision=10**9,
            tenants=[TenantRecord(tenant_id="alpha")],
            keys=[TenantKeyRecord(key_id=9, tenant_id="alpha", digest=key_digest("evil").hex())],
        )
        before = TENANT_UPDATES.labels("rejected")._value.get()
        await router.bus.publish(subjects.tenants_updated, forged)
        await wait_until(
            lambda: TENANT_UPDATES.labels("rejected")._value.get() >= before + 2,  # both routers
            5,
            "forged directory rejected",
        )
        assert r.tenants.revision == kb["revision"] and r.tenants.resolve_key("evil") is None

        # the secret is shown once: never listed, never audited
        _, keys = await api.call("GET", "/api/v1/tenants/alpha/keys")
        assert ka["key"] not in str(keys) and keys["keys"][0]["state"] == "active"
        _, log = await api.call("GET", "/api/v1/audit?limit=50")
        assert ka["key"] not in str(log)
        assert {"tenant.create", "tenant_key.create"} <= {e["action"] for e in log["entries"]}

        cached = {"alpha": 0, "beta": 0}
        async with aiohttp.ClientSession() as s:
            # keys: tenant keys and the static one pass; none, or a wrong one: 401
            for _ in range(3):
                status, body = await _ask(s, router.url, ka["key"])
                assert status == 200, body
                cached["alpha"] += body["usage"]["prompt_tokens_details"]["cached_tokens"]
            # beta sends alpha's prompt: its own cache namespace, so nothing of alpha's is hit
            status, body = await _ask(s, router.url, kb["key"])
            assert status == 200
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            status, body = await _ask(s, router.url, kb["key"])
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # its own prefix
            cached["beta"] += body["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached["alpha"] > 0
            # the cache ledger: each tenant holds the prompt's full blocks it had computed
            # (beta's are its own, in its namespace), from the worker's KV events
            bs = next(iter(r.state.block_sizes))
            blocks = body["usage"]["prompt_tokens"] // bs
            led = r.tenant_cache.ledger
            await wait_until(
                lambda: led.held["alpha"] == blocks and led.held["beta"] == blocks,
                5,
                f"{blocks} blocks held by each tenant, got {dict(led.held)}",
            )
            assert (await _ask(s, router.url, "static-key"))[0] == 200
            for key in (None, "kvt_wrong"):
                status, body = await _ask(s, router.url, key)
                assert status == 401 and body["error"]["type"] == "invalid_request_error"

            # the gateway header names the tenant only where it is trusted, and never stands
            # in for a key
            status, _ = await _ask(s, router.url, None, **{"x-kvgate-tenant": "alpha"})
            assert status == 401
            status, _ = await _ask(s, gateway.url, None, **{"x-kvgate-tenant": "gw-team"})
            assert status == 401
            status, _ = await _ask(s, router.url, "static-key", **{"x-kvgate-tenant": "gw-x"})
            assert status == 200  # tenant-less: the header is not believed here
            status, _ = await _ask(s, gateway.url, "gateway-key", **{"x-kvgate-tenant": "gw-team"})
            assert status == 200

            # revocation reaches the router over the bus: 401 in OpenAI's shape
            st, revoked = await api.call("DELETE", f"/api/v1/tenants/beta/keys/{kb['id']}")
            assert st == 200 and revoked["state"] == "revoked"
            await wait_until(lambda: r.tenants.revision >= revoked["revision"], 5, "revoked")
            status, body = await _ask(s, router.url, kb["key"])
            assert status == 401 and set(body["error"]) == {"message", "type", "param", "code"}

            # expiry: a key with a lifetime, refused once the router's clock passes it
            st, short = await api.call("POST", "/api/v1/tenants/alpha/keys", {"ttl_s": 3600})
            await wait_until(lambda: r.tenants.revision >= short["revision"], 5, "key applied")
            status, body = await _ask(s, router.url, short["key"])
            assert status == 200
            cached["alpha"] += body["usage"]["prompt_tokens_details"]["cached_tokens"]
            r.tenants.clock = lambda: time.time() + 7200
            status, body = await _ask(s, router.url, short["key"])
            assert status == 401 and body["error"]["message"] == "API key expired"
            r.tenants.clock = time.time

        # usage: what the engines reported, per tenant, summed by the api from the outcomes
        want = {"alpha": 4, "beta": 2, "gw-team": 1}

        async def usage(t: str) -> dict:
            _, u = await api.call("GET", f"/api/v1/tenants/{t}/usage")
            return u

        for tenant, n in want.items():
            await wait_until_async(lambda t=tenant, n=n: _has(usage, t, n), 10, f"{tenant} usage")
        ua = await usage("alpha")
        ub = await usage("beta")
        assert ub["cached_tokens"] == cached["beta"]
        assert ua["cached_tokens"] == cached["alpha"]
        assert ua["requests"] == 4 and ub["requests"] == 2
        assert ua["prompt_tokens"] == ua["cached_tokens"] + ua["computed_prompt_tokens"]
        # the router's per-tenant metric counts the same engine figure
        from services.router.tenant_metrics import TENANT_CACHED_TOKENS

        assert TENANT_CACHED_TOKENS.labels("beta").value >= cached["beta"]
        # the untrusted header named no tenant; an unknown tenant has no usage
        assert (await api.call("GET", "/api/v1/tenants/gw-x/usage"))[0] == 404
    finally:
        if gateway.router is not None:
            await gateway.stop()
        await router.stop()
        await sims.stop()
        await api.close()


async def _has(usage, tenant: str, n: int) -> bool:
    u = await usage(tenant)
    return isinstance(u, dict) and u.get("requests", 0) >= n


async def wait_until_async(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_usage_counts_each_outcomes_message_once(database_url: str) -> None:
    """A message redelivered (the api crashed between its commit and its ack) adds nothing;
    failed requests count as requests and errors, not tokens; a prompt whose engine reported
    no cache figure is neither cached nor computed."""
    from sqlalchemy import select

    from services.api.db import Database
    from services.api.models import TenantUsage
    from services.api.testing import migrate
    from services.api.usage import UsageCollector, add_outcome, new_sums
    from services.common.schemas import RouterOutcome

    await migrate(database_url)
    minute = 29_000_000  # a minute no other test writes
    ts = minute * 60 + 5.0

    def outcome(**kw) -> RouterOutcome:
        return RouterOutcome(
            request_id="r", router_id="r1", ts=ts, policy="p", tenant_id="once", **kw
        )

    sums = new_sums()
    for o in (
        outcome(prompt_tokens=100, completion_tokens=7, cached_tokens=64),
        outcome(prompt_tokens=50, completion_tokens=3, cached_tokens=None),
        outcome(status="error", http_status=502, prompt_tokens=80),
        RouterOutcome(request_id="x", router_id="r1", ts=ts, policy="p", prompt_tokens=9),
    ):
        add_outcome(sums, o)
    assert list(sums) == [("once", minute)]  # the tenant-less one is not recorded
    db = Database(database_url)
    try:
        collector = UsageCollector(db, bus=None)  # type: ignore[arg-type]
        assert await collector.write(7, 1234, sums)
        assert not await collector.write(7, 1234, sums)  # redelivered: skipped
        assert await collector.write(7, 9999, sums)  # a re-created stream's seq 7: counted
        async with db.session() as s:
            row = (
                await s.execute(
                    select(TenantUsage).where(
                        TenantUsage.tenant_id == "once", TenantUsage.minute == minute
                    )
                )
            ).scalar_one()
        got = {f: getattr(row, f) for f in ("requests", "errors", "prompt_tokens")}
        assert got == {"requests": 6, "errors": 2, "prompt_tokens": 300}
        assert (row.cached_tokens, row.unreported_prompt_tokens) == (128, 100)
        assert row.completion_tokens == 20
    finally:
        await db.close()


async def test_epp_takes_the_tenant_from_its_directory(nats_url, subjects, bus) -> None:
    """The EPP holds the same directory (hot-reloaded from the bus): behind the gateway it
    takes the tenant from the client's key or, trusted, the gateway's header; an expired key
    is refused; the outcome names the tenant."""
    from services.common.schemas import RouterOutcome
    from tests.test_epp import Beats, EppProc, FakeWorker, immediate, pick_once, picked
    from tests.test_epp import shutdown as epp_shutdown

    w0 = await FakeWorker("w0").start(bus)
    beats = Beats(bus, [w0]).start()
    outcomes: asyncio.Queue[RouterOutcome] = asyncio.Queue()

    async def on_outcome(o: RouterOutcome, _raw) -> None:
        await outcomes.put(o)

    sub = await bus.subscribe(bus.subjects.router_outcomes, RouterOutcome, on_outcome)
    epp = await EppProc(nats_url, subjects, trust_tenant_header=True).start()
    try:
        await epp.wait_workers(1)
        r = epp.router
        assert r is not None
        await bus.publish(
            bus.subjects.tenants_updated,
            TenantsUpdated(
                revision=1,
                tenants=[TenantRecord(tenant_id="team", default_priority="critical")],
                keys=[
                    TenantKeyRecord(key_id=1, tenant_id="team", digest=key_digest("k").hex()),
                    TenantKeyRecord(
                        key_id=2, tenant_id="team", digest=key_digest("old").hex(), expires_at=1.0
                    ),
                ],
            ),
        )
        await wait_until(lambda: r.tenants.revision == 1, 5, "directory applied")
        body = {"model": "m", "prompt": "hello " * 20, "max_tokens": 2}
        for headers in ({"authorization": "Bearer k"}, {"x-kvgate-tenant": "team"}):
            first = await pick_once(epp, body, extra=headers)
            picked(first, len(json.dumps(body)))
        status, err = immediate(await pick_once(epp, body, extra={"authorization": "Bearer old"}))
        assert status == 401 and err["error"]["message"] == "API key expired"
        seen = [await asyncio.wait_for(outcomes.get(), 5) for _ in range(2)]
        assert {(o.tenant_id, o.priority) for o in seen} == {("team", "critical")}
    finally:
        await sub.unsubscribe()
        await epp_shutdown(("epp", epp.stop()), ("beats", beats.stop()))
        await w0.stop()


# --------------------------------------------------------------------------- If-Match
async def test_tenant_etag_and_if_match(database_url, nats_url, subject_prefix) -> None:
    """GET names the version in ETag; PUT and DELETE with If-Match write only over that
    version (else 412, nothing changed); without If-Match they write as before."""
    api = await start_api(database_url, nats_url, subject_prefix)
    assert api.session is not None
    auth = {"Authorization": f"Bearer {api.admin}"}
    url = f"{api.url}/api/v1/tenants/im"

    async def req(method: str, body=None, **headers: str) -> tuple[int, dict, CIMultiDict]:
        async with api.session.request(method, url, json=body, headers={**auth, **headers}) as r:
            return r.status, await r.json(content_type=None), CIMultiDict(r.headers)

    try:
        st, _ = await api.call("POST", "/api/v1/tenants", {"tenant_id": "im", "spec": {}})
        assert st == 201
        st, t, h = await req("GET")
        assert (st, h.get("ETag"), t["version"]) == (200, '"1"', 1)

        # the right version: written, and the ETag moves with the new version
        st, t, h = await req("PUT", {"spec": {"weight": 2}}, **{"If-Match": '"1"'})
        assert (st, t["version"], h.get("ETag")) == (200, 2, '"2"'), t
        st, _, h = await req("GET")
        assert h.get("ETag") == '"2"'

        # a stale version (another writer came between): 412 in the API's error shape, the
        # current ETag named, and nothing changed (no version, no spec, no audit entry)
        _, audit_before = await api.call("GET", "/api/v1/audit?target_type=tenant&target_id=im")
        st, err, h = await req("PUT", {"spec": {"weight": 5}}, **{"If-Match": '"1"'})
        assert st == 412 and err["error"]["code"] == "precondition_failed", err
        assert err["error"]["field"] == "If-Match" and h.get("ETag") == '"2"'
        assert "version 2" in err["error"]["message"]
        st, t, _ = await req("PUT", {"description": "x"}, **{"If-Match": 'W/"2"'})
        assert st == 412, t  # a weak tag never matches (strong comparison)
        _, t, h = await req("GET")
        assert (t["version"], t["spec"]["weight"], t["description"]) == (2, 2, "")
        assert len(t["versions"]) == 2 and h.get("ETag") == '"2"'
        _, audit_after = await api.call("GET", "/api/v1/audit?target_type=tenant&target_id=im")
        assert audit_after == audit_before

        # any of a list, and *, match; a malformed header is a 400 naming it
        st, t, _ = await req("PUT", {"spec": {"weight": 3}}, **{"If-Match": '"9", "2"'})
        assert (st, t["version"]) == (200, 3), t
        st, t, _ = await req("PUT", {"spec": {"weight": 4}}, **{"If-Match": "*"})
        assert (st, t["version"]) == (200, 4), t
        st, err, _ = await req("PUT", {"spec": {"weight": 1}}, **{"If-Match": "4"})
        assert st == 400 and err["error"]["field"] == "If-Match", err

        # without If-Match: unconditional, as before
        st, t, h = await req("PUT", {"spec": {"weight": 6}})
        assert (st, t["version"], t["spec"]["weight"], h.get("ETag")) == (200, 5, 6, '"5"')

        # DELETE: a stale version keeps the tenant, the current one deletes it
        st, err, _ = await req("DELETE", **{"If-Match": '"4"'})
        assert st == 412 and err["error"]["code"] == "precondition_failed", err
        assert (await api.call("GET", "/api/v1/tenants/im"))[0] == 200
        # two writers over the same version at once: the row lock orders them, one wins and
        # the other's check sees the winner's version
        both = await asyncio.gather(
            *(req("PUT", {"spec": {"weight": w}}, **{"If-Match": '"5"'}) for w in (7, 8))
        )
        assert sorted(st for st, _, _ in both) == [200, 412], both
        (won,) = [t for st, t, _ in both if st == 200]
        _, t, _ = await req("GET")
        assert (t["version"], t["spec"]["weight"]) == (6, won["spec"]["weight"])

        st, out, _ = await req("DELETE", **{"If-Match": '"6"'})
        assert (st, out["deleted"]) == (200, "im"), out
        assert (await api.call("GET", "/api/v1/tenants/im"))[0] == 404

        # the OpenAPI document says so
        _, doc = await api.call("GET", "/api/v1/openapi.json", token=None)
        ops = doc["paths"]["/api/v1/tenants/{id}"]
        assert "ETag" in ops["get"]["responses"]["200"]["headers"]
        assert "ETag" in ops["put"]["responses"]["200"]["headers"]
        for method in ("put", "delete"):
            assert "412" in ops[method]["responses"], method
            (p,) = [p for p in ops[method]["parameters"] if p["in"] == "header"]
            assert (p["name"], p["required"]) == ("If-Match", False)
    finally:
        await api.close()


@pytest.mark.parametrize(
    "value",
    [
        '"7"',
        '"6", "7"',
        ' "7" ,',
        "*",
        'W/"7"',
        '""',
        "7",
        '"7" "8"',
        '"7",,"8"',
        '*, "7"',
        '"a\\"b"',
        "",
    ],
)
def test_if_match_parser_accepts_what_the_documented_pattern_does(value: str) -> None:
    """The OpenAPI document's If-Match pattern is the parser's grammar: a value the document
    calls valid is never a 400, and one it calls invalid always is."""
    import re

    from aiohttp.test_utils import make_mocked_request

    from services.api.framework import IF_MATCH_PATTERN, ApiError, if_match

    request = make_mocked_request("PUT", "/", headers={"If-Match": value})
    try:
        if_match(request)
        accepted = True
    except ApiError as exc:
        assert (exc.status, exc.field) == (400, "If-Match")
        accepted = False
    assert accepted == bool(value and re.search(IF_MATCH_PATTERN, value)), value
