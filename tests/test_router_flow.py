"""Flow control in the live router on real NATS (services/router/admission.py over
services/core/flow): priority order, fair order across tenants, shed order, and quota
refusals summed across router replicas over the load-share channel."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from services.common.bus import Bus
from services.common.schemas import TenantRecord, TenantsUpdated
from tests.test_router_support import Beats, FakeWorker, RouterProc, post, wait_until

ONE_AT_A_TIME = dict(block_size=16, num_gpu_blocks=1000, max_num_seqs=1, max_model_len=8192)


def trust_tenant_headers(rp: RouterProc) -> None:
    """The router behind a trusted gateway (``--trust-tenant-header``): x-kvgate-tenant names
    the tenant, x-kvgate-priority its band (services/router/tenant_identity.py)."""
    rp.router.tenants.trust_header = True


async def one_worker_router(bus: Bus, nats_url, subjects, **kw):
    from services.common.schemas import WorkerCapacity

    hold = asyncio.Event()
    w = await FakeWorker("w0", hold=hold, capacity=WorkerCapacity(**ONE_AT_A_TIME)).start(bus)
    beats = Beats(bus, [w]).start()
    router = await RouterProc(nats_url, subjects, **kw).start()
    trust_tenant_headers(router)
    await router.wait_workers(1)
    return w, hold, beats, router


def order_served(w: FakeWorker) -> list[str]:
    return [x["body"]["prompt"] for x in w.served]


async def queue_in_order(s, router, url, items: list[tuple[str, str, str]]) -> list[asyncio.Task]:
    """Send (prompt, tenant, priority) one by one, each waiting in the line before the next."""
    r = router.router
    tasks = []
    for prompt, tenant, prio in items:
        n = r.queue_len
        tasks.append(
            asyncio.create_task(
                post(
                    s,
                    url,
                    {"model": "m", "prompt": prompt, "max_tokens": 4},
                    {"x-kvgate-tenant": tenant, "x-kvgate-priority": prio},
                )
            )
        )
        await wait_until(lambda n=n: r.queue_len == n + 1, what=f"{prompt} waiting")
    return tasks


async def test_priority_order_and_sheddable_shed_when_saturated(nats_url, subjects, bus) -> None:
    w, hold, beats, router = await one_worker_router(bus, nats_url, subjects, retry_after=2)
    try:
        async with aiohttp.ClientSession() as s:
            url = router.url + "/v1/completions"
            first = asyncio.create_task(
                post(s, url, {"model": "m", "prompt": "0", "max_tokens": 4})
            )
            await asyncio.wait_for(w.started.wait(), 10)
            tasks = await queue_in_order(
                s,
                router,
                url,
                [
                    ("s1", "a", "standard"),
                    ("c1", "a", "critical"),
                    ("s2", "b", "standard"),
                    ("c2", "b", "critical"),
                ],
            )
            # saturated: a sheddable request is shed at once, OpenAI error shape + Retry-After
            st, h, body = await post(
                s,
                url,
                {"model": "m", "prompt": "x1", "max_tokens": 4},
                {"x-kvgate-tenant": "a", "x-kvgate-priority": "sheddable"},
            )
            assert st == 429 and h["Retry-After"] == "2"
            err = json.loads(body)["error"]
            assert (
                err["type"] == "rate_limit_error"
                and "sheddable requests are shed" in err["message"]
            )
            hold.set()
            assert [t[0] for t in await asyncio.gather(first, *tasks)] == [200] * 5
            # critical first (a's then b's: equal counters, a's came first), then standard
            assert order_served(w) == ["0", "c1", "c2", "s1", "s2"]
            # nothing waits now: a sheddable request is served
            st, _, _ = await post(
                s,
                url,
                {"model": "m", "prompt": "x2", "max_tokens": 4},
                {"x-kvgate-tenant": "a", "x-kvgate-priority": "sheddable"},
            )
            assert st == 200
    finally:
        await router.stop()
        await beats.stop()
        await w.stop()


async def test_fair_order_across_tenants(nats_url, subjects, bus) -> None:
    """a queues three requests before b's one: b's is served second, not last (FIFO: last).
    Counters in prompt tokens (every prompt is 10): x is dispatched first (x = 10, the lift
    floor); a joins lifted to 10, b to 10 (the least backlogged counter, a's); a tie goes to
    the flow whose head came first: a1 (a = 20); then b1 (10 < 20); then a2, a3."""
    w, hold, beats, router = await one_worker_router(bus, nats_url, subjects)
    try:
        async with aiohttp.ClientSession() as s:
            url = router.url + "/v1/completions"
            first = asyncio.create_task(
                post(
                    s,
                    url,
                    {"model": "m", "prompt": "x" * 10, "max_tokens": 4},
                    {"x-kvgate-tenant": "x"},
                )
            )
            await asyncio.wait_for(w.started.wait(), 10)
            items = [(f"a{i}" + "." * 8, "a", "standard") for i in (1, 2, 3)]
            items.append(("b1" + "." * 8, "b", "standard"))
            tasks = await queue_in_order(s, router, url, items)
            hold.set()
            assert [t[0] for t in await asyncio.gather(first, *tasks)] == [200] * 5
            assert [p[:2] for p in order_served(w)] == ["xx", "a1", "b1", "a2", "a3"]
    finally:
        await router.stop()
        await beats.stop()
        await w.stop()


async def test_a_full_line_sheds_the_lower_band_first(nats_url, subjects, bus) -> None:
    w, hold, beats, router = await one_worker_router(bus, nats_url, subjects, queue_size=2)
    try:
        async with aiohttp.ClientSession() as s:
            url = router.url + "/v1/completions"
            first = asyncio.create_task(
                post(s, url, {"model": "m", "prompt": "0", "max_tokens": 4})
            )
            await asyncio.wait_for(w.started.wait(), 10)
            s1, s2 = await queue_in_order(
                s, router, url, [("s1", "a", "standard"), ("s2", "b", "standard")]
            )
            # the line is full: a critical request takes the youngest standard one's place
            c1 = asyncio.create_task(
                post(
                    s,
                    url,
                    {"model": "m", "prompt": "c1", "max_tokens": 4},
                    {"x-kvgate-tenant": "a", "x-kvgate-priority": "critical"},
                )
            )
            st, h, body = await s2
            assert st == 429 and "Retry-After" in h and b"higher priority" in body
            # full of requests of its band or above: a standard one is refused
            st, _, body = await post(
                s, url, {"model": "m", "prompt": "s3", "max_tokens": 4}, {"x-kvgate-tenant": "a"}
            )
            assert st == 429 and b"queue full" in body
            hold.set()
            assert [t[0] for t in await asyncio.gather(first, c1, s1)] == [200] * 3
            assert order_served(w) == ["0", "c1", "s1"]
    finally:
        await router.stop()
        await beats.stop()
        await w.stop()


async def test_quota_refused_across_three_routers(nats_url, subjects, bus) -> None:
    """Tenant t may send 3 requests a minute: one on each of three routers, then the fourth
    is refused wherever it lands, because each router counts the others' reports."""
    w = await FakeWorker("w0").start(bus)
    beats = Beats(bus, [w]).start()
    routers = [await RouterProc(nats_url, subjects, load_interval=0.2).start() for _ in range(3)]
    # the admin API's directory (as services.router.tenant_reload applies it off the bus)
    directory = TenantsUpdated(
        revision=1,
        tenants=[TenantRecord(tenant_id="t", requests_per_min=3, input_tokens_per_min=10_000)],
    )
    for rp in routers:
        trust_tenant_headers(rp)
        assert rp.router.tenants.apply(directory)
    try:
        for rp in routers:
            await rp.wait_workers(1)
        await wait_until(
            lambda: all(len(rp.router.state.remote_routers) == 2 for rp in routers),
            what="every router hears the other two",
        )
        hdr = {"x-kvgate-tenant": "t"}
        async with aiohttp.ClientSession() as s:
            for i, rp in enumerate(routers):
                st, _, _ = await post(
                    s,
                    rp.url + "/v1/completions",
                    {"model": "m", "prompt": f"p{i}", "max_tokens": 4},
                    hdr,
                )
                assert st == 200
            await wait_until(
                lambda: all(
                    rp.router.flow.quotas.usage("t", _now()).requests == 3 for rp in routers
                ),
                what="every router knows t's 3 requests",
            )
            for rp in routers:
                st, h, body = await post(
                    s,
                    rp.url + "/v1/completions",
                    {"model": "m", "prompt": "q", "max_tokens": 4},
                    hdr,
                )
                err = json.loads(body)["error"]
                assert st == 429 and int(h["Retry-After"]) >= 1, body
                assert (
                    err["type"] == "rate_limit_error" and "3 requests per minute" in err["message"]
                )
            # another tenant is not limited
            st, _, _ = await post(
                s,
                routers[0].url + "/v1/completions",
                {"model": "m", "prompt": "u", "max_tokens": 4},
                {"x-kvgate-tenant": "u"},
            )
            assert st == 200
        assert len(w.served) == 4
    finally:
        for rp in routers:
            await rp.stop()
        await beats.stop()
        await w.stop()


def _now() -> float:
    return time.monotonic()


async def test_epp_picks_count_against_the_tenants_concurrency(nats_url, subjects, bus) -> None:
    """Behind the EPP a request's end frees its place in its tenant's concurrency quota (a
    pick the data plane finished is settled like a proxied request)."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from tests.test_epp import (
        EppProc,
        body_chunk,
        immediate,
        picked,
        request_headers,
        response_headers,
    )

    w = await FakeWorker("w0").start(bus)
    beats = Beats(bus, [w]).start()
    epp = await EppProc(nats_url, subjects).start()
    r = epp.router
    r.tenants.trust_header = True
    assert r.tenants.apply(
        TenantsUpdated(revision=1, tenants=[TenantRecord(tenant_id="t", concurrent_requests=1)])
    )
    hdr = {"x-kvgate-tenant": "t"}
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 4}).encode()
    try:
        await epp.wait_workers(1)
        e = epp.envoy()
        await e.send(request_headers(extra=hdr))
        await e.send(body_chunk(body, True))
        endpoint = picked(await e.recv(), len(body))
        await e.recv()  # the body, sent back
        # its one concurrent request is in flight: a second is refused
        e2 = epp.envoy()
        await e2.send(request_headers(extra=hdr))
        await e2.send(body_chunk(body, True))
        status, err = immediate(await e2.recv())
        assert status == 429 and "concurrent requests" in err["error"]["message"]
        await e2.close()
        # the first ends
        await e.send(response_headers(200, endpoint))
        await e.recv()
        await e.send(
            pb.ProcessingRequest(
                response_body=pb.HttpBody(body=b'{"choices": []}', end_of_stream=True)
            )
        )
        await e.recv()
        await e.close()
        await wait_until(
            lambda: r.flow.quotas.usage("t", time.monotonic()).concurrent == 0,
            what="the pick's end frees the tenant's concurrency",
        )
        e3 = epp.envoy()
        await e3.send(request_headers(extra=hdr))
        await e3.send(body_chunk(body, True))
        picked(await e3.recv(), len(body))
        await e3.recv()  # the body, sent back
        await e3.close()
    finally:
        await epp.stop()
        await beats.stop()
        await w.stop()


async def test_protect_prefill_a_protected_request_passes_a_held_best_effort_one(
    nats_url, subjects, bus
) -> None:
    """--protect-prefill (services/core/flow/prefill_room.py) on two workers whose answers are
    held (their prompts stay queued): once critical requests arrive the room is 1, so an
    over-share tenant's request is held at the head of the line; a light tenant's request
    (under its share: protected) joins behind it and passes it to a worker. Once others hold
    more, the held request is under its share and goes too (protection is not fixed on
    arrival)."""
    from services.common.schemas import WorkerCapacity

    hold = asyncio.Event()
    cap = WorkerCapacity(block_size=16, num_gpu_blocks=1000, max_num_seqs=64, max_model_len=8192)
    ws = [await FakeWorker(f"w{i}", hold=hold, capacity=cap).start(bus) for i in range(2)]
    beats = Beats(bus, ws).start()
    router = await RouterProc(
        nats_url, subjects, protect_prefill=True, protect_quantile=0.9, queue_timeout=2.0
    ).start()
    trust_tenant_headers(router)
    await router.wait_workers(2)
    r = router.router
    from prometheus_client import REGISTRY

    def room_held() -> float:
        labels = {"priority": "standard"}
        return REGISTRY.get_sample_value("kvgate_flow_room_held_total", labels) or 0.0

    held_before = room_held()
    try:
        async with aiohttp.ClientSession() as s:
            url = router.url + "/v1/completions"

            def send(prompt: str, tenant: str, prio: str = "standard") -> asyncio.Task:
                return asyncio.create_task(
                    post(
                        s,
                        url,
                        {"model": "m", "prompt": prompt, "max_tokens": 4},
                        {"x-kvgate-tenant": tenant, "x-kvgate-priority": prio},
                    )
                )

            def names() -> set[str]:
                return {x for w in ws for x in order_served(w)}

            async def served(n: int, what: str) -> None:
                await wait_until(lambda: len(names()) == n, what=what)

            # no protected arrivals yet: room 0, heavy's requests go straight to the worker
            first = [send("h1", "heavy"), send("h2", "heavy")]
            await served(2, "h1, h2 sent")
            # two critical arrivals: a stream of protected requests, the room is 1
            first += [send("c1", "crit", "critical"), send("c2", "crit", "critical")]
            await served(4, "c1, c2 sent")
            assert r.flow.room is not None and r.flow.room.room(time.monotonic()) == 1
            # heavy holds 2 of 4 in flight (over its share): best-effort, held by the room
            held = send("h3", "heavy")
            await wait_until(lambda: r.queue_len == 1, what="h3 held in the line")
            # light (under its share) joins behind h3 (same band) and passes it
            light = send("l1", "light")
            await served(5, "l1 sent past h3")
            assert names() == {"h1", "h2", "c1", "c2", "l1"}
            assert r.queue_len == 1  # h3 still waits
            # three more critical requests (protected: they pass h3 too) make heavy's 2 of 8
            # in flight no more than its third of the work: h3's protection is asked again
            # at each wake-up (it was over its share on arrival), so it is placed now,
            # while the workers still hold every prompt, not refused at the queue timeout
            first += [send(f"c{i}", "crit", "critical") for i in (3, 4, 5)]
            await served(9, "c3-c5 sent, then h3 as a protected request")
            assert "h3" in names() and r.queue_len == 0
            hold.set()
            assert [t[0] for t in await asyncio.gather(*first, light, held)] == [200] * 9
            # h3 was asked again at every wake-up, but it is one request the room held
            assert room_held() == held_before + 1
    finally:
        await router.stop()
        await beats.stop()
        for w in ws:
            await w.stop()
