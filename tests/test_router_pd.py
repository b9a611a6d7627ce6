"""Disaggregated serving end to end: sim prefill and decode workers (real processes' code on
the real bus), the router, and the official ``openai`` client; both handshakes (vLLM NIXL
kv_transfer_params, SGLang bootstrap), a prefill worker dying (retried on another prefiller,
or colocated on the decoder when none is left) and a decoder dying mid-stream (migrates).

The pairing is a minimal P/D decision written for these tests (the production P/D policies
are services/core/policy/builtin/pd_*.py): the least-loaded decode worker, prefill workers in
turn, none when no prefill worker is routable.
"""

from __future__ import annotations

import asyncio
import itertools

import aiohttp
import openai
import pytest

from services.common.bus import Bus
from services.core.policy import Decision
from services.router import metrics as M
from tests.test_router_e2e_sim import SimCluster
from tests.test_router_support import RouterProc, shutdown, wait_until

PROMPT = "Prefill here, decode there: the KV cache moves between engines. " * 8


def install_pairing(router: RouterProc) -> None:
    """The test's P/D decision on the router (decider.decide_for), over its live state."""
    dec = router.router.decider
    turn = itertools.count()

    def decide_for(parsed, request_id, session_id, policy, excluded, slo_targets=None):
        states = dec.state.states
        ok = [w for w in states.values() if w.routable and w.worker_id not in excluded]
        decoders = sorted(
            (w for w in ok if w.role == "decode"), key=lambda w: (w.inflight, w.worker_id)
        )
        prefills = sorted(w.worker_id for w in ok if w.role == "prefill")
        if not decoders:
            return Decision(None, reason="no decode worker", wait=True, policy=policy.name), {}
        pw = prefills[next(turn) % len(prefills)] if prefills else None
        d = Decision(decoders[0].worker_id, prefill_worker=pw, reason="test pairing")
        d.policy = policy.name
        return d, {}

    dec.decide_for = decide_for  # type: ignore[method-assign]


class PdFleet:
    def __init__(self, nats_url, subjects, prefill: int = 2, decode: int = 2, **kw) -> None:
        # leases far longer than a test: a decoder always finds its prefill's KV
        common = {"speedup": kw.pop("speedup", 20.0), "pd_kv_lease_s": 1e4, **kw}
        self.pre = SimCluster(
            nats_url, subjects, prefill, worker_id="pre", role="prefill", **common
        )
        self.dec = SimCluster(nats_url, subjects, decode, worker_id="dec", role="decode", **common)

    async def start(self) -> PdFleet:
        await asyncio.gather(self.pre.start(), self.dec.start())
        return self

    async def stop(self) -> None:
        await asyncio.gather(self.pre.stop(), self.dec.stop())

    async def health(self, cluster: SimCluster, i: int) -> dict:
        async with aiohttp.ClientSession() as s, s.get(cluster.url(i) + "/health") as r:
            return await r.json()


async def _pd_stats(fleet: PdFleet) -> tuple[int, int]:
    pulled = sum([(await fleet.health(fleet.pre, i))["pd"]["pulled"] for i in range(2)])
    recomputed = sum([(await fleet.health(fleet.dec, i))["pd"]["recomputed"] for i in range(2)])
    return pulled, recomputed


@pytest.mark.parametrize("handshake", ["nixl", "bootstrap"])
async def test_openai_client_streams_through_both_handshakes(
    nats_url, subjects, bus: Bus, handshake: str
) -> None:
    fleet = await PdFleet(nats_url, subjects).start()
    router = await RouterProc(
        nats_url, subjects, policy="round_robin", pd_handshake=handshake
    ).start()
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    try:
        await router.wait_workers(4, timeout=20)
        install_pairing(router)
        before = M.PD_REQUESTS.labels(handshake, "prefilled").value
        prefills = sum(M.PD_PREFILL._only.counts)
        handoffs = sum(M.PD_HANDOFF._only.counts)
        pairs = set()
        async with client.chat.completions.with_streaming_response.create(
            model="m",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        ) as resp:
            pairs.add((resp.headers["x-kvgate-prefill-worker"], resp.headers["x-kvgate-worker"]))
            chunks = [c async for c in await resp.parse()]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert len(text) == 12 and chunks[-1].usage.completion_tokens == 12
        async with client.completions.with_streaming_response.create(
            model="m", prompt=PROMPT, max_tokens=9, stream=True
        ) as resp:
            pairs.add((resp.headers["x-kvgate-prefill-worker"], resp.headers["x-kvgate-worker"]))
            text = "".join([c.choices[0].text async for c in await resp.parse() if c.choices])
        assert len(text) == 9
        raw = await client.completions.with_raw_response.create(
            model="m", prompt=PROMPT, max_tokens=5
        )
        pairs.add((raw.headers["x-kvgate-prefill-worker"], raw.headers["x-kvgate-worker"]))
        assert raw.parse().usage.completion_tokens == 5
        assert all(p.startswith("pre-") and d.startswith("dec-") for p, d in pairs), pairs
        assert M.PD_REQUESTS.labels(handshake, "prefilled").value == before + 3
        if handshake == "nixl":  # sequential: every prefill answered, then its decoder
            assert sum(M.PD_PREFILL._only.counts) == prefills + 3
            await wait_until(
                lambda: sum(M.PD_HANDOFF._only.counts) == handoffs + 2, what="outcomes recorded"
            )
        # every decoder read its prompt's KV from the prefill worker (none recomputed it)
        assert await _pd_stats(fleet) == (3, 0)
    finally:
        await client.close()
        await shutdown(("router", router.stop()), ("fleet", fleet.stop()), each_s=10)


@pytest.mark.parametrize("handshake", ["nixl", "bootstrap"])
async def test_dead_prefill_worker_is_retried_elsewhere_then_colocated(
    nats_url, subjects, bus: Bus, handshake: str
) -> None:
    fleet = await PdFleet(nats_url, subjects).start()
    router = await RouterProc(
        nats_url, subjects, policy="round_robin", pd_handshake=handshake, max_retries=3
    ).start()
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    try:
        await router.wait_workers(4, timeout=20)
        install_pairing(router)
        failed = M.PD_REQUESTS.labels(handshake, "prefill_failed").value
        async with aiohttp.ClientSession() as s:
            async with s.post(fleet.pre.url(0) + "/admin/faults", json={"crash": True}):
                pass

        async def one(i: int) -> tuple[str | None, str]:
            async with client.completions.with_streaming_response.create(
                model="m", prompt=f"{i} {PROMPT}", max_tokens=6, stream=True
            ) as resp:
                text = "".join([c.choices[0].text async for c in await resp.parse() if c.choices])
                assert len(text) == 6
                return resp.headers.get("x-kvgate-prefill-worker"), resp.headers["x-kvgate-worker"]

        # pre-0 is still believed healthy (its heartbeats have not timed out): the pairing
        # sends prefills to it in turn, each fails at once and is retried on pre-1
        got = await asyncio.gather(*(one(i) for i in range(8)))
        assert {p for p, _ in got} == {"pre-1"}, got
        assert M.PD_REQUESTS.labels(handshake, "prefill_failed").value > failed
        # no prefill worker left: the decoder prefills itself (colocated fallback)
        async with aiohttp.ClientSession() as s:
            async with s.post(fleet.pre.url(1) + "/admin/faults", json={"crash": True}):
                pass
        got = await asyncio.gather(*(one(100 + i) for i in range(4)))
        assert all(p is None and d.startswith("dec-") for p, d in got), got
    finally:
        await client.close()
        await shutdown(("router", router.stop()), ("fleet", fleet.stop()), each_s=10)


async def test_decoder_dying_mid_stream_migrates(nats_url, subjects, bus: Bus) -> None:
    fleet = await PdFleet(nats_url, subjects, speedup=1.0).start()
    router = await RouterProc(nats_url, subjects, policy="round_robin", pd_handshake="nixl").start()
    try:
        await router.wait_workers(4, timeout=20)
        install_pairing(router)
        before = M.MIGRATIONS.labels("completed").value
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 40, "stream": True}
        raw = b""
        async with aiohttp.ClientSession() as s:
            async with s.post(router.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                assert resp.headers["x-kvgate-prefill-worker"].startswith("pre-")
                victim = int(resp.headers["x-kvgate-worker"].rsplit("-", 1)[1])
                crashed = False
                async for chunk in resp.content.iter_any():
                    raw += chunk
                    if not crashed and raw.count(b"data:") >= 3:
                        crashed = True
                        url = fleet.dec.url(victim) + "/admin/faults"
                        async with s.post(url, json={"crash": True}):
                            pass
        import json

        text = ""
        for block in raw.split(b"\n\n"):
            block = block.strip()
            if block.startswith(b"data: {"):
                for ch in json.loads(block[6:]).get("choices", []):
                    text += ch.get("text", "")
        assert raw.rstrip().endswith(b"data: [DONE]")
        assert len(text) == 40
        assert M.MIGRATIONS.labels("completed").value == before + 1
    finally:
        await shutdown(("router", router.stop()), ("fleet", fleet.stop()), each_s=10)


def test_operator_views_show_pairs_and_roles():
    """The admin API's decision feed keeps a P/D request's pair and timings (the operator
    page draws ``prefill → decode``), and its worker view says each worker's role."""
    from services.api.ui import DecisionFeed
    from services.api.workers import WorkerRegistry
    from services.common.schemas import RouterOutcome, WorkerCapacity, WorkerHeartbeat

    feed = DecisionFeed()
    feed.add(
        RouterOutcome(
            request_id="r1",
            router_id="rt",
            ts=1.0,
            policy="pd_slo",
            worker_id="decode-0",
            prefill_worker="prefill-1",
            prefill_s=0.12,
            handoff_s=0.03,
        )
    )
    item = feed.items[-1][1]
    assert (item["prefill_worker"], item["worker_id"]) == ("prefill-1", "decode-0")
    assert (item["prefill_s"], item["handoff_s"]) == (0.12, 0.03)
    reg = WorkerRegistry()
    hb = WorkerHeartbeat(
        worker_id="prefill-1",
        instance_id="i",
        url="http://x:1",
        model="m",
        capacity=WorkerCapacity(
            block_size=16, num_gpu_blocks=64, max_num_seqs=8, max_model_len=512
        ),
        role="prefill",
    )
    reg.on_heartbeat(hb, now=0.0)
    assert reg.view("prefill-1", None, False, now=0.5)["role"] == "prefill"
