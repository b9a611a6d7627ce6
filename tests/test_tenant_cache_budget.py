"""Tenant cache budgets (``quota.cache_budget_blocks``): the pure model
(services.core.flow.cache_budget), then end to end on a real NATS and Postgres: a budget set
through the admin API, an over-budget tenant reported in its usage, alerted through the alert
manager and demoted to the sheddable band by the router, a tenant within its budget
unaffected, and bad budgets refused in the API's error shape; the EPP's ledger shared with a
router's and its picks demoted the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import aiohttp
import msgspec

from services.api.testing import start_api
from services.common.schemas import TenantRecord, TenantsUpdated
from services.common.tenancy import Priority, RequestTenancy
from services.core.flow.cache_budget import (
    ALERT_KIND,
    CacheHoldings,
    changes,
    demote,
    over_budget,
    over_tenants,
)
from services.router.tenant_identity import TenantDirectory
from services.router.tenant_metrics import TENANT_REQUESTS
from tests.test_router_e2e_sim import SimCluster
from tests.test_router_flow import one_worker_router, queue_in_order
from tests.test_router_support import RouterProc, post, wait_until
from tests.test_tenants import wait_until_async


# --------------------------------------------------------------------------- pure
def test_over_budget_is_strictly_more_than_the_budget() -> None:
    assert not over_budget(10, None)  # no budget
    assert not over_budget(10, 10)
    assert over_budget(11, 10)
    assert over_tenants({"a": 5, "b": 5, "c": 99}, {"a": 4, "b": 5}) == {"a"}


def test_demote_lowers_only_an_over_budget_tenants_band() -> None:
    crit = RequestTenancy("a", Priority.CRITICAL, 2.0, "salt")
    out = demote(crit, frozenset({"a"}))
    assert out.priority is Priority.SHEDDABLE
    assert (out.tenant_id, out.weight, out.cache_salt) == ("a", 2.0, "salt")
    assert demote(crit, frozenset({"b"})) is crit
    assert demote(RequestTenancy(), frozenset({"a"})).priority is Priority.STANDARD


def test_holdings_sum_own_and_current_peer_reports() -> None:
    h = CacheHoldings(peer_ttl_s=10.0)
    h.on_peer("r2", {"a": 3, "b": 1}, now=100.0)
    h.on_peer("r3", {"a": 4}, now=105.0)
    assert h.totals({"a": 1, "c": 0}, now=106.0) == {"a": 8, "b": 1}
    assert h.reporters(111.0) == 1  # r2's report is older than the TTL: forgotten
    assert h.totals({}, now=111.0) == {"a": 4}
    h.on_peer("r3", {"a": 2}, now=112.0)  # a newer report replaces the older
    assert h.totals({}, now=112.0) == {"a": 2}


def test_changes_between_two_looks() -> None:
    assert changes(frozenset(), frozenset({"a"})) == ({"a"}, set())
    assert changes(frozenset({"a"}), frozenset({"a"})) == (set(), set())
    assert changes(frozenset({"a"}), frozenset({"b"})) == ({"b"}, {"a"})


def test_directory_holds_the_budgets() -> None:
    d = TenantDirectory()
    d.apply(
        TenantsUpdated(
            revision=1,
            tenants=[
                TenantRecord(tenant_id="a", cache_budget_blocks=7),
                TenantRecord(tenant_id="b"),
            ],
        )
    )
    assert d.cache_budgets() == {"a": 7}


# --------------------------------------------------------------------------- live
OVER_PROMPT = "The over-budget tenant asks a long question about caches. " * 30
UNDER_PROMPT = "Another tenant, well within its budget, asks something else. " * 30


async def _ask(s: aiohttp.ClientSession, url: str, key: str, prompt: str) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": 2}
    headers = {"Authorization": f"Bearer {key}"}
    async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
        out = msgspec.json.decode(await r.read())
        assert r.status == 200, out
        return out


def _served(tenant: str, band: str) -> float:
    return TENANT_REQUESTS.labels(tenant, band, "ok").value


async def test_bad_cache_budgets_are_refused(database_url, nats_url, subject_prefix) -> None:
    api = await start_api(database_url, nats_url, subject_prefix)
    try:
        for bad in (0, -3, 1.5, "many", 10**13):
            st, err = await api.call(
                "POST",
                "/api/v1/tenants",
                {"tenant_id": "cb-bad", "spec": {"quota": {"cache_budget_blocks": bad}}},
            )
            assert st == 400, (bad, err)
            assert set(err["error"]) >= {"code", "message", "field"}, err
            assert err["error"]["code"] == "invalid_body"
            assert "cache_budget_blocks" in err["error"]["field"], err
        assert (await api.call("GET", "/api/v1/tenants/cb-bad"))[0] == 404  # none was made
    finally:
        await api.close()


async def test_over_budget_tenant_is_reported_alerted_and_demoted(
    database_url: str, nats_url: str, subject_prefix: str, subjects
) -> None:
    api = await start_api(database_url, nats_url, subject_prefix, cache_budget_tick_s=0.2)
    sims = await SimCluster(nats_url, subjects, 1).start()
    router = await RouterProc(nats_url, subjects, load_interval=0.2).start()
    other = await RouterProc(nats_url, subjects, load_interval=0.2).start()  # a replica
    r, r2 = router.router, other.router
    assert r is not None and r2 is not None
    over, under = "cb-over", "cb-under"
    try:
        await router.wait_workers(1)
        for tenant, budget in ((over, 1), (under, 10**6)):
            st, _ = await api.call(
                "POST",
                "/api/v1/tenants",
                {"tenant_id": tenant, "spec": {"quota": {"cache_budget_blocks": budget}}},
            )
            assert st == 201
        _, ko = await api.call("POST", f"/api/v1/tenants/{over}/keys", {})
        _, ku = await api.call("POST", f"/api/v1/tenants/{under}/keys", {})
        await wait_until(lambda: r.tenants.revision >= ku["revision"], 5, "directory applied")
        await wait_until(lambda: r.tenant_cache.active, 5, "cache ledger fed")

        async with aiohttp.ClientSession() as s:
            first = await _ask(s, router.url, ko["key"], OVER_PROMPT)
            await _ask(s, router.url, ku["key"], UNDER_PROMPT)
            bs = next(iter(r.state.block_sizes))
            blocks = first["usage"]["prompt_tokens"] // bs
            assert blocks > 1  # more than the budget of 1
            led = r.tenant_cache.ledger
            await wait_until(
                lambda: led.held[over] == blocks and led.held[under] > 0, 5, "blocks held"
            )
            # the router: over budget is the over tenant only; the replica, whose own ledger
            # holds none of its blocks, knows it from the first one's load-share reports
            await wait_until(lambda: r.cache_budget.over == {over}, 5, "router sees over")
            await wait_until(lambda: r2.cache_budget.over == {over}, 5, "replica sees over")
            assert r2.tenant_cache.ledger.held[over] == 0

            # the usage shows it (blocks held, the budget, over)
            async def usage(t: str) -> dict:
                return (await api.call("GET", f"/api/v1/tenants/{t}/usage"))[1]

            async def reported() -> bool:
                return (await usage(over))["over_cache_budget"] is True

            await wait_until_async(reported, 5, "usage reports over budget")

            # the under tenant's blocks may ride a later report than the over tenant's
            async def under_reported() -> bool:
                return (await usage(under))["cache_blocks_held"] == led.held[under]

            await wait_until_async(under_reported, 5, "usage reports the under tenant's blocks")
            uo, uu = await usage(over), await usage(under)
            assert (uo["cache_blocks_held"], uo["cache_budget_blocks"]) == (blocks, 1)
            assert uu["over_cache_budget"] is False and uu["cache_budget_blocks"] == 10**6
            assert uu["cache_blocks_held"] == led.held[under]

            # the alert: one firing for the over tenant, none for the other
            async def alerts(state: str) -> list[dict]:
                st, out = await api.call("GET", f"/api/v1/alerts?kind={ALERT_KIND}&state={state}")
                if st != 200:  # a busy shared Postgres (503): none known yet
                    return []
                return [a for a in out["alerts"] if a["details"].get("tenant_id") in (over, under)]

            async def fired() -> bool:
                return bool(await alerts("firing"))

            await wait_until_async(fired, 5, "over-budget alert fired")
            (alert,) = await alerts("firing")
            assert alert["details"] == {
                "tenant_id": over,
                "blocks_held": blocks,
                "cache_budget_blocks": 1,
            }
            assert alert["severity"] == "warning" and alert["fingerprint"].endswith(over)

            # enforced: the over tenant's next request is in the sheddable band, the other's
            # stays in its own
            before = (_served(over, "sheddable"), _served(under, "standard"))
            await _ask(s, router.url, ko["key"], OVER_PROMPT)
            await _ask(s, other.url, ko["key"], OVER_PROMPT)  # through the replica too
            await _ask(s, router.url, ku["key"], UNDER_PROMPT)
            assert _served(over, "sheddable") == before[0] + 2
            assert _served(under, "standard") == before[1] + 1
            assert _served(under, "sheddable") == 0

            # the API restarts (a new replica, which looks only when told here): its first
            # look, made once the tenant is back within, closes the alert opened before
            await api.stop()
            api.cfg = dataclasses.replace(api.cfg, cache_budget_tick_s=3600.0)
            await api.start()

            # the budget raised through the admin API: back in its band, the alert resolved
            st, _ = await api.call(
                "PUT",
                f"/api/v1/tenants/{over}",
                {"spec": {"quota": {"cache_budget_blocks": 10**6}}},
            )
            assert st == 200
            await wait_until(lambda: not r.cache_budget.over, 5, "router sees within budget")
            await wait_until(lambda: not r2.cache_budget.over, 5, "replica sees within budget")
            assert api.service is not None and api.service.ctx is not None
            view = api.service.ctx.tenant_cache
            assert view is not None
            await wait_until(lambda: view.held(over) is not None, 5, "the api hears routers")
            await view.check()

            async def resolved() -> bool:
                return bool(await alerts("resolved")) and not await alerts("firing")

            await wait_until_async(resolved, 5, "over-budget alert resolved")
            assert (await usage(over))["over_cache_budget"] is False
            before_std = _served(over, "standard")
            await _ask(s, router.url, ko["key"], OVER_PROMPT)
            assert _served(over, "standard") == before_std + 1
    finally:
        await other.stop()
        await router.stop()
        await sims.stop()
        await api.close()


async def test_over_budget_tenant_is_shed_first_on_a_saturated_fleet(
    nats_url, subjects, bus
) -> None:
    """One worker taking one request at a time, held busy: the fleet is saturated. The
    over-budget tenant's request (standard by its header) is shed at once instead of waiting
    for capacity; another tenant's standard request waits and is served."""
    w, hold, beats, router = await one_worker_router(bus, nats_url, subjects, retry_after=2)
    r = router.router
    assert r is not None
    r.tenants.apply(
        TenantsUpdated(
            revision=1,
            tenants=[
                TenantRecord(tenant_id="hog", cache_budget_blocks=10),
                TenantRecord(tenant_id="light", cache_budget_blocks=10),
            ],
        )
    )
    # the ledger (tested above and end to end): hog holds 11 blocks, light 10 (within)
    r.tenant_cache.ledger.held.update({"hog": 11, "light": 10})
    try:
        await wait_until(lambda: r.cache_budget.over == {"hog"}, 5, "hog over budget")
        async with aiohttp.ClientSession() as s:
            url = router.url + "/v1/completions"
            first = asyncio.create_task(post(s, url, {"model": "m", "prompt": "0"}))
            await asyncio.wait_for(w.started.wait(), 10)
            (light,) = await queue_in_order(s, router, url, [("l1", "light", "standard")])
            st, h, body = await post(
                s,
                url,
                {"model": "m", "prompt": "h1", "max_tokens": 4},
                {"x-kvgate-tenant": "hog", "x-kvgate-priority": "standard"},
            )
            assert st == 429 and h["Retry-After"] == "2"
            assert "sheddable requests are shed" in json.loads(body)["error"]["message"]
            hold.set()
            assert [t[0] for t in await asyncio.gather(first, light)] == [200, 200]
            assert [x["body"]["prompt"] for x in w.served] == ["0", "l1"]
    finally:
        await router.stop()
        await beats.stop()
        await w.stop()


# --------------------------------------------------------------------------- the EPP
async def _through_epp(epp, s: aiohttp.ClientSession, key: str, prompt: str) -> dict:
    """One request as the gateway carries it: the EPP picks, the request goes to the pick,
    its answer passes through the EPP's stream, which then ends."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from tests.test_epp import body_chunk, picked, request_headers

    raw = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 2}).encode()
    e = epp.envoy()
    await e.send(request_headers(extra={"authorization": f"Bearer {key}"}))
    await e.send(body_chunk(raw, True))
    endpoint = picked(await e.recv(), len(raw))
    await e.recv()  # the body, sent on
    async with s.post(
        f"http://{endpoint}/v1/completions",
        data=raw,
        headers={"content-type": "application/json"},
    ) as r:
        answer = await r.read()
        assert r.status == 200, answer
    hv = base_pb2.HeaderValue
    headers = [hv(key=":status", raw_value=b"200"), hv(key="content-type", raw_value=b"json")]
    await e.send(
        pb.ProcessingRequest(
            response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=headers))
        )
    )
    await e.recv()
    await e.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=answer, end_of_stream=True)))
    await e.recv()
    await e.close()
    return msgspec.json.decode(answer)


async def test_epp_enforces_cache_budgets_and_shares_its_ledger(
    nats_url: str, subjects, bus
) -> None:
    """``kvgate epp`` enforces cache budgets as a router does (the same guard): the blocks
    its picks made are its ledger's and ride its load-share reports (a router whose own ledger
    holds none of them demotes that tenant), a tenant over its budget by a router's blocks is
    demoted by the EPP, and a tenant within its budget keeps its band."""
    from services.common.schemas import RouterOutcome, TenantKeyRecord
    from services.router.tenant_identity import key_digest
    from tests.test_epp import EppProc

    sims = await SimCluster(nats_url, subjects, 1).start()
    epp = await EppProc(nats_url, subjects, load_interval=0.2).start()
    router = await RouterProc(nats_url, subjects, load_interval=0.2).start()
    e, r = epp.router, router.router
    assert e is not None and r is not None
    bands: asyncio.Queue[RouterOutcome] = asyncio.Queue()

    async def on_outcome(o: RouterOutcome, _raw) -> None:
        await bands.put(o)

    sub = await bus.subscribe(bus.subjects.router_outcomes, RouterOutcome, on_outcome)

    async def band_of(via: str) -> tuple[str | None, str | None]:
        o = await asyncio.wait_for(bands.get(), 5)
        assert o.router_id == via, o
        return o.tenant_id, o.priority

    # "epp-hog" fills the cache through the EPP, "router-hog" through the router; both have a
    # budget of one block; "light" (through the EPP) a large one
    budgets = {"epp-hog": 1, "router-hog": 1, "light": 10**6}
    prompts = {
        t: f"{t} asks its own long question about caches, number {t}. " * 30 for t in budgets
    }
    try:
        await epp.wait_workers(1)
        await router.wait_workers(1)
        await bus.publish(
            bus.subjects.tenants_updated,
            TenantsUpdated(
                revision=1,
                tenants=[
                    TenantRecord(tenant_id=t, cache_budget_blocks=b) for t, b in budgets.items()
                ],
                keys=[
                    TenantKeyRecord(key_id=i, tenant_id=t, digest=key_digest(t).hex())
                    for i, t in enumerate(budgets, 1)
                ],
            ),
        )
        for x in (e, r):
            await wait_until(lambda x=x: x.tenants.revision == 1, 5, "directory applied")
            await wait_until(lambda x=x: x.tenant_cache.active, 5, "cache ledger fed")

        async with aiohttp.ClientSession() as s:
            served = {"epp-hog": await _through_epp(epp, s, "epp-hog", prompts["epp-hog"])}
            assert await band_of(e.router_id) == ("epp-hog", "standard")  # within, so far
            served["light"] = await _through_epp(epp, s, "light", prompts["light"])
            assert await band_of(e.router_id) == ("light", "standard")
            served["router-hog"] = await _ask(s, router.url, "router-hog", prompts["router-hog"])
            assert await band_of(r.router_id) == ("router-hog", "standard")
            bs = next(iter(e.state.block_sizes))
            blocks = {t: a["usage"]["prompt_tokens"] // bs for t, a in served.items()}
            assert min(blocks.values()) > 1  # more than the hogs' budget of 1

            # the EPP's ledger holds the blocks its picks made (the router's holds none of them)
            led = e.tenant_cache.ledger
            await wait_until(
                lambda: (
                    (led.held["epp-hog"], led.held["light"]) == (blocks["epp-hog"], blocks["light"])
                ),
                5,
                "EPP's blocks",
            )
            await wait_until(
                lambda: r.tenant_cache.ledger.held["router-hog"] == blocks["router-hog"],
                5,
                "router's blocks",
            )
            assert r.tenant_cache.ledger.held["epp-hog"] == 0
            assert led.held["router-hog"] == 0
            # each sees both over from its own ledger and the other's load-share reports
            hogs = {"epp-hog", "router-hog"}
            await wait_until(lambda: e.cache_budget.over == hogs, 5, "EPP sees both over")
            await wait_until(lambda: r.cache_budget.over == hogs, 5, "router sees both over")

            # enforced by the EPP: both hogs' picks are in the sheddable band, light's not
            for t in budgets:
                await _through_epp(epp, s, t, prompts[t])
                want = "standard" if t == "light" else "sheddable"
                assert await band_of(e.router_id) == (t, want)
            # and by the router, for the tenant whose blocks only the EPP counted
            await _ask(s, router.url, "epp-hog", prompts["epp-hog"])
            assert await band_of(r.router_id) == ("epp-hog", "sheddable")
    finally:
        await sub.unsubscribe()
        await router.stop()
        await epp.stop()
        await sims.stop()
