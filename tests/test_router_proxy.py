"""The live router against real NATS: OpenAI API (official client), headers, models, health,
debug route, prefix-aware routing from KV events, outcomes on JetStream, metrics."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from services.common.bus import Bus
from services.common.schemas import RouterOutcome
from services.common.streams import require_outcomes_stream
from tests.test_router_support import (
    Beats,
    FakeWorker,
    Indexer,
    RouterProc,
    post,
    shutdown,
    wait_until,
)


@pytest.fixture
async def cluster(nats_url, subjects, bus: Bus):
    workers = [await FakeWorker(f"w{i}").start(bus) for i in range(3)]
    other = await FakeWorker("x0", model="other").start(bus)
    beats = Beats(bus, [*workers, other]).start()
    indexer = await Indexer(nats_url, subjects).start()
    router = await RouterProc(nats_url, subjects).start()
    await router.wait_workers(4)
    # an unknown model is a 404 once the router knows the cluster (503 + Retry-After before)
    assert router.router is not None
    await wait_until(router.router.readiness.cluster_known, 10, "cluster known")
    try:
        yield router, workers, other, beats
    finally:
        await shutdown(
            ("router", router.stop()),
            ("indexer", indexer.stop()),
            ("beats", beats.stop()),
            *[(w.worker_id, w.stop()) for w in [*workers, other]],
        )


async def test_openai_client_chat_and_completions(cluster) -> None:
    router, workers, other, _ = cluster
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    try:
        chat = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hello there"}], max_tokens=12
        )
        assert chat.choices[0].message.content == "ab " * 4
        comp = await client.completions.create(model="m", prompt="once upon a time", max_tokens=9)
        assert comp.choices[0].text == "ab " * 3
        stream = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "stream please"}],
            max_tokens=12,
            stream=True,
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(parts) == "ab " * 4
        cstream = await client.completions.create(
            model="m", prompt="abc", max_tokens=6, stream=True
        )
        assert "".join([c.choices[0].text async for c in cstream if c.choices]) == "ab " * 2
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "who"}], max_tokens=1
        )
        assert raw.headers["x-kvgate-worker"] in {w.worker_id for w in workers}
        assert raw.headers["x-kvgate-policy"] == "kv_aware@default"
        models = await client.models.list()
        assert sorted(m.id for m in models.data) == ["m", "other"]
        # model routing: only the worker serving "other" gets its requests
        for _ in range(3):
            r = await client.completions.with_raw_response.create(
                model="other", prompt="zz", max_tokens=1
            )
            assert r.headers["x-kvgate-worker"] == "x0"
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="absent", prompt="zz", max_tokens=1)
        # the worker asked for usage on streams, the client did not get the usage-only chunk
        streamed = [s for w in workers for s in w.served if s["body"].get("stream")]
        assert streamed and all(s["body"]["stream_options"]["include_usage"] for s in streamed)
    finally:
        await client.close()


async def test_bad_requests_get_clear_400(cluster) -> None:
    router, *_ = cluster
    async with aiohttp.ClientSession() as s:
        async with s.post(router.url + "/v1/completions", data=b"{not json") as r:
            assert r.status == 400 and "JSON" in (await r.json())["error"]["message"]
        st, _, body = await post(s, router.url + "/v1/chat/completions", {"model": "m"})
        assert st == 400 and b"messages" in body
        st, _, body = await post(
            s, router.url + "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": -3}
        )
        assert st == 400 and b"max_tokens" in body


async def test_health_models_and_debug_route_send_nothing(cluster) -> None:
    router, workers, other, _ = cluster
    async with aiohttp.ClientSession() as s:
        async with s.get(router.url + "/health") as r:
            h = await r.json()
        assert h["workers"] == 4 and h["nats"] is True and h["policy"] == "kv_aware@default"
        assert h["policy_algorithm"] == "kv_aware"
        before = sum(len(w.served) for w in workers)
        async with s.get(
            router.url + "/debug/route",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        ) as r:
            d = await r.json()
        assert d["worker"] in {"w0", "w1", "w2"}
        assert set(d["scores"]) == {"w0", "w1", "w2"}
        assert d["filtered"]["x0"].startswith("serves")
        # a new prompt on an idle cluster: no copies, nothing to wait for
        assert d["replicate_to"] == [] and d["after"] is None and d["hold_s"] == 0.0
        async with s.get(
            router.url + "/debug/route", params={"prompt": "hello", "model": "other"}
        ) as r:
            assert (await r.json())["worker"] == "x0"
        assert sum(len(w.served) for w in workers) == before


async def test_prefix_routing_follows_kv_events(cluster) -> None:
    router, workers, _, _ = cluster
    prompt = "You are a helpful assistant. " * 20  # 580 bytes = 36 full blocks
    async with aiohttp.ClientSession() as s:
        st, h, _ = await post(
            s, router.url + "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 2}
        )
        assert st == 200
        first = h["x-kvgate-worker"]
        r = router.router
        assert r is not None
        # the worker's KV events reach the router's index
        await wait_until(
            lambda: r.index_source.index.blocks_of(first) >= 36, what="kv events indexed"
        )
        async with s.get(
            router.url + "/debug/route", json={"model": "m", "prompt": prompt + " more"}
        ) as resp:
            d = await resp.json()
        assert d["worker"] == first
        assert d["overlap_blocks"] == {first: 36}
        assert d["predicted_cached_tokens"] == 36 * 16
        st, h, body = await post(
            s,
            router.url + "/v1/completions",
            {"model": "m", "prompt": prompt + " more", "max_tokens": 2},
        )
        assert h["x-kvgate-worker"] == first
    assert r.hit_pred.cached >= 36 * 16
    assert r.hit_reported.cached >= 36 * 16  # the worker reported the cached tokens


async def test_outcomes_and_metrics(cluster, bus: Bus) -> None:
    router, workers, _, _ = cluster
    stream = await require_outcomes_stream(bus)
    got: asyncio.Queue[RouterOutcome] = asyncio.Queue()

    async def on(o: RouterOutcome, _raw) -> None:
        await got.put(o)

    await bus.consume(
        stream, bus.subjects.router_outcomes, "t_outcomes", RouterOutcome, on, deliver_new=True
    )
    async with aiohttp.ClientSession() as s:
        st, h, _ = await post(
            s,
            router.url + "/v1/chat/completions",
            {
                "model": "m",
                "messages": [{"role": "user", "content": "q"}],
                "max_tokens": 9,
                "stream": True,
            },
            headers={"x-request-id": "req-123"},
        )
        assert st == 200
        o = await asyncio.wait_for(got.get(), 10)
        while o.request_id != "req-123":
            o = await asyncio.wait_for(got.get(), 10)
        assert o.status == "ok" and o.worker_id == h["x-kvgate-worker"] and o.stream
        assert o.policy == "kv_aware" and o.arm == "control" and o.ttft_s is not None
        assert o.completion_tokens == 3 * 3 and o.cached_tokens is not None
        assert o.prompt_tokens > 0 and o.e2e_s >= o.ttft_s
        async with s.get(router.url + "/metrics") as r:
            text = await r.text()
    for name in (
        "kvgate_router_requests_total",
        "kvgate_router_ttft_seconds",
        "kvgate_router_e2e_seconds",
        "kv_cache_hit_rate",
        "kvgate_router_kv_cache_hit_ratio",
        "request_timeout_total",
        "kvgate_router_timeouts_total",
        "kvgate_router_itl_seconds_bucket",
        'kvgate_router_arm_requests_total{arm="control",status="ok"}',
        'kvgate_router_arm_ttft_seconds_count{arm="control"}',
        "kvgate_router_decision_seconds",
        "kvgate_router_queue_length",
        "kvgate_router_retries_total",
        "kvgate_router_migrations_total",
    ):
        assert name in text, name
