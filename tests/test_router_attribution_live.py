"""Reuse attribution live, on the real bus with real simulated workers, the real indexer and the
router: per answered request available >= captured >= delivered; the router's counters add up
(available = delivered + every token lost, by reason) and its delivered total equals the
cached prompt tokens the workers' engines counted (``vllm:prefix_cache_hits_total``); a
holder whose circuit is open is reported as lost to ``breaker``. The scaling signal is fed by
the same requests."""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest
from prometheus_client import generate_latest

from services.common.bus import Bus
from services.common.schemas import RouterOutcome
from services.router import metrics as M
from tests.test_router_e2e_sim import SimCluster
from tests.test_router_support import Indexer, RouterProc, shutdown, wait_until

SYSTEM = "You are a careful assistant. Answer briefly and cite your sources please. " * 12


def _counter(kind: str) -> float:
    return M.PREFIX_TOKENS.labels(kind).value


def _lost() -> dict[tuple[str, str], float]:
    return {k: c.value for k, c in M.PREFIX_LOST._children.items()}


async def _engine_hits(session: aiohttp.ClientSession, sims: SimCluster) -> float:
    total = 0.0
    for i in range(sims.st.count):
        async with session.get(sims.url(i) + "/metrics") as r:
            text = await r.text()
        for m in re.finditer(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M):
            total += float(m.group(1))
    return total


async def test_attribution_adds_up_against_the_workers_reports(
    nats_url, subjects, bus: Bus
) -> None:
    sims = await SimCluster(nats_url, subjects, 3).start()
    indexer = await Indexer(nats_url, subjects).start()
    router = await RouterProc(nats_url, subjects, policy="kv_aware").start()
    seen: dict[str, RouterOutcome] = {}
    got = asyncio.Event()
    want = 0

    async def on(o: RouterOutcome, _raw) -> None:
        seen[o.request_id] = o
        if len(seen) >= want:
            got.set()

    sub = await bus.subscribe(subjects.router_outcomes, RouterOutcome, on)
    try:
        await router.wait_workers(3, timeout=20)
        r = router.router
        before = {k: _counter(k) for k in ("available", "captured", "delivered", "unpredicted")}
        lost_before = _lost()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            hits_before = await _engine_hits(s, sims)

            async def ask(rid: str, question: str) -> str:
                body = {
                    "model": "m",
                    "messages": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": question},
                    ],
                    "max_tokens": 4,
                }
                headers = {"x-request-id": rid}
                async with s.post(
                    router.url + "/v1/chat/completions", json=body, headers=headers
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
                    return resp.headers["x-kvgate-worker"]

            # sequential, each after the index heard of the previous one's blocks, so the
            # router's prediction is exact: what a worker holds is what the index says
            holder = ""
            for i in range(8):
                n = len(r.index_source.index)
                holder = await ask(f"attr-{i}", f"question {i}: why is the sky blue?")
                await wait_until(lambda n=n: len(r.index_source.index) > n, what="blocks indexed")
            # the holder of the system prompt is out: its circuit opens, the reuse it offers
            # is lost to the breaker (and the next worker computes the prefix anew)
            r.state.set_breaker_open(holder, True)
            try:
                for i in range(8, 11):
                    n = len(r.index_source.index)
                    await ask(f"attr-{i}", f"question {i}: and the sea?")
                    await wait_until(lambda n=n: len(r.index_source.index) > n, what="indexed")
            finally:
                r.state.set_breaker_open(holder, False)
            want = 11
            got.clear()
            if len(seen) < want:
                await asyncio.wait_for(got.wait(), 10)
            hits = await _engine_hits(s, sims) - hits_before
        outs = [seen[f"attr-{i}"] for i in range(11)]
        for o in outs:
            assert o.status == "ok" and o.cached_tokens is not None, o
            assert o.available_cached_tokens >= o.predicted_cached_tokens >= o.cached_tokens, o
            assert (o.lost_reason == "") == (o.available_cached_tokens == o.predicted_cached_tokens)
        # the shared system prompt is reused once indexed
        assert sum(o.cached_tokens or 0 for o in outs[1:8]) > 0
        # the breaker phase: the first request after the opening lost the holder's prefix
        assert outs[8].lost_reason == "breaker" and outs[8].worker_id != holder, outs[8]
        assert outs[8].available_cached_tokens > outs[8].predicted_cached_tokens
        # the router's counters add up to the outcomes, and to the engines' own counts
        d = {k: _counter(k) - v for k, v in before.items()}
        assert d["available"] == sum(o.available_cached_tokens for o in outs)
        assert d["captured"] == sum(o.predicted_cached_tokens for o in outs)
        assert d["delivered"] == sum(o.cached_tokens or 0 for o in outs) == hits
        lost = {k: v - lost_before.get(k, 0.0) for k, v in _lost().items()}
        lost = {k: v for k, v in lost.items() if v}
        assert d["available"] == d["delivered"] + sum(lost.values()) - d["unpredicted"]
        assert lost.get(("breaker", "control"), 0) > 0, lost
        # the scaling signal saw the arrivals and the answers (services/router/scaling.py)
        need = r.scaling.need()
        assert need.reachable and need.work_s > 0 and need.engines > 0
        text = generate_latest().decode()
        exported = re.search(r"^kvgate_fleet_engines_needed (\S+)$", text, re.M)
        assert exported and float(exported.group(1)) == pytest.approx(need.engines, rel=0.2)
        assert M.ARRIVAL_RATE.value > 0
    finally:
        await sub.unsubscribe()
        await shutdown(
            ("router", router.stop()), ("indexer", indexer.stop()), ("sims", sims.stop()), each_s=10
        )
