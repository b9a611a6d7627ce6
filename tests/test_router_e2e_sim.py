"""End to end with the real simulated workers (engine core, KV events, faults), the real
indexer and the router, all on the real bus.

- seed 000 live: one shared system prompt, 4 workers. ``prefix`` piles onto one worker;
  ``kv_aware`` uses all 4 and the workers *report* most of the shared prefix as cached;
- the sim worker's crash fault mid-stream: the router migrates the stream and the client
  gets a complete answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter

import aiohttp
import pytest

from services.common import settings as S
from services.common.bus import Bus
from services.common.embedded import port_open
from services.router import metrics as M
from tests.test_router_support import Indexer, RouterProc, shutdown, wait_until

SYSTEM = "You are a careful assistant. Answer briefly and cite sources. " * 16  # ~1 kB


def _bindable(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_base(count: int) -> int:
    """Consecutive free ports below the ephemeral range (so no client socket takes them)."""
    for _ in range(500):
        base = random.randint(12_000, 30_000)
        if all(_bindable(base + i) and not port_open("127.0.0.1", base + i) for i in range(count)):
            return base
    raise RuntimeError("no free port range")


class SimCluster:
    def __init__(self, nats_url: str, subjects, count: int, **overrides) -> None:
        from services.worker_sim import cli as sim_cli

        st = S.resolve(None, sim_cli.OPTIONS, environ={})
        st.nats_url = nats_url
        st.subject_prefix = subjects.prefix.rstrip(".")
        st.count = count
        st.port = _free_base(count)
        st.worker_id = "sim"
        st.heartbeat_interval = 0.2
        st.speedup = 20.0
        st.max_num_seqs = 16
        st.model = "m"
        for k, v in overrides.items():
            setattr(st, k, v)
        self.st = st
        self.stop_ev = asyncio.Event()
        self.task: asyncio.Task | None = None

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.st.port + i}"

    async def start(self) -> SimCluster:
        from services.worker_sim.app import serve

        self.task = asyncio.create_task(serve(self.st, self.stop_ev))
        task = self.task
        await wait_until(
            lambda: (
                task.done()
                or all(port_open("127.0.0.1", self.st.port + i) for i in range(self.st.count))
            ),
            timeout=20,
            what="sim workers listening",
        )
        if task.done():
            task.result()  # raises the start error
        return self

    async def stop(self) -> None:
        self.stop_ev.set()
        if self.task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.task, 20)


async def _run_shared_prompt(router: RouterProc, n: int, conc: int) -> Counter:
    used: Counter = Counter()
    sem = asyncio.Semaphore(conc)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:

        async def one(i: int) -> None:
            body = {
                "model": "m",
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"question number {i}: why is the sky blue?"},
                ],
                "max_tokens": 24,
            }
            async with sem, s.post(router.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                used[r.headers["x-kvgate-worker"]] += 1
                await r.read()

        # one warm-up request so a worker holds the system prompt (the seed-000 start)
        await one(-1)
        await wait_until(lambda: len(router.router.index_source.index) > 0, what="prefix indexed")
        await asyncio.gather(*(one(i) for i in range(n)))
    return used


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy",
    [
        "prefix",
        "slo_aware",  # spreads the prompt by user requests (no replication), like the default
        '{"name": "kv_aware", "params": {"replicate": true}}',  # and by one-token replicas
    ],
    ids=["prefix", "slo_aware", "kv_aware-replicate"],
)
async def test_shared_system_prompt_live(nats_url, subjects, bus: Bus, policy: str) -> None:
    sims = await SimCluster(nats_url, subjects, 4).start()
    indexer = await Indexer(nats_url, subjects).start()
    router = await RouterProc(nats_url, subjects, policy=policy).start()
    try:
        await router.wait_workers(4, timeout=20)
        r = router.router
        copies = M.REPLICAS.labels("ok").value
        used = await _run_shared_prompt(router, 64, 16)
        copies = M.REPLICAS.labels("ok").value - copies
        top = used.most_common(1)[0][1] / sum(used.values())
        if policy == "prefix":
            assert top >= 0.9, used  # the hot spot
        else:
            # all 4 busy; the first holder keeps more (its cache is warm), but not everything
            assert len(used) == 4 and min(used.values()) >= 0.1 * sum(used.values()), used
            if "replicate" in policy:
                # the prompt went to the other workers as one-token replicas, answered
                assert copies >= 1
            else:
                assert copies == 0  # replication is off by default
            assert len(r.waits) == 0  # every dispatched request was marked done
        # reported by the workers' engines (ground truth), over the whole prompt
        assert r.hit_reported.prompt > 0
        assert r.hit_reported.cached / r.hit_reported.prompt >= 0.6, (
            r.hit_reported.cached,
            r.hit_reported.prompt,
        )
    finally:
        await shutdown(
            ("router", router.stop()), ("indexer", indexer.stop()), ("sims", sims.stop()), each_s=10
        )


@pytest.mark.slow
async def test_sim_worker_crash_mid_stream_migrates(nats_url, subjects, bus: Bus) -> None:
    sims = await SimCluster(nats_url, subjects, 2, speedup=1.0).start()
    router = await RouterProc(nats_url, subjects, policy="round_robin").start()
    try:
        await router.wait_workers(2, timeout=20)
        before = M.MIGRATIONS.labels("completed").value
        body = {"model": "m", "prompt": "tell me a long story", "max_tokens": 60, "stream": True}
        text = ""
        async with aiohttp.ClientSession() as s:
            async with s.post(router.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                victim = resp.headers["x-kvgate-worker"]
                idx = int(victim.rsplit("-", 1)[1])
                crashed = False
                raw = b""
                async for chunk in resp.content.iter_any():
                    raw += chunk
                    if not crashed and raw.count(b"data:") >= 3:
                        crashed = True
                        async with s.post(sims.url(idx) + "/admin/faults", json={"crash": True}):
                            pass
        import json

        for block in raw.split(b"\n\n"):
            block = block.strip()
            if block.startswith(b"data: {"):
                for ch in json.loads(block[6:]).get("choices", []):
                    text += ch.get("text", "")
        assert raw.rstrip().endswith(b"data: [DONE]")
        assert len(text) == 60  # byte-level: 60 tokens = 60 characters, across both workers
        assert M.MIGRATIONS.labels("completed").value == before + 1
    finally:
        await shutdown(("router", router.stop()), ("sims", sims.stop()), each_s=10)


async def test_lora_requests_route_with_the_adapters_key_space(
    nats_url, subjects, bus: Bus
) -> None:
    """A worker serving LoRA adapter ``ad-1`` says so in its heartbeats; the router then
    routes ``model: ad-1`` to it and keys the prompt with the adapter's seed, so it predicts
    the cache hits the engine will have (and none for the same prompt on the base model)."""
    sims = await SimCluster(nats_url, subjects, 1, lora_modules="ad-1").start()
    indexer = await Indexer(nats_url, subjects).start()
    router = await RouterProc(nats_url, subjects, policy="kv_aware").start()
    prompt = "Translate to French, keep the tone. " * 16  # 576 bytes = 36 full blocks
    try:
        await router.wait_workers(1, timeout=20)
        r = router.router
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            async with s.get(router.url + "/v1/models") as resp:
                assert {m["id"] for m in (await resp.json())["data"]} == {"m", "ad-1"}
            body = {"model": "ad-1", "prompt": prompt, "max_tokens": 2}
            async with s.post(router.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                worker = resp.headers["x-kvgate-worker"]
                await resp.read()
            await wait_until(
                lambda: r.index_source.index.blocks_of(worker) >= 36, what="kv events indexed"
            )
            for model, expect in (("ad-1", 36 * 16), ("m", 0)):
                q = {"model": model, "prompt": prompt + " more"}
                async with s.get(router.url + "/debug/route", json=q) as resp:
                    d = await resp.json()
                assert d["worker"] == worker, d
                assert d["predicted_cached_tokens"] == expect, (model, d)
            # and the engine agrees: the second adapter request is served from its cache
            body = {"model": "ad-1", "prompt": prompt + " more", "max_tokens": 2}
            async with s.post(router.url + "/v1/completions", json=body) as resp:
                usage = (await resp.json())["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == 36 * 16
    finally:
        await shutdown(
            ("router", router.stop()), ("indexer", indexer.stop()), ("sims", sims.stop()), each_s=10
        )


@pytest.mark.slow
async def test_a_follower_is_held_until_its_prefix_is_computed(
    nats_url, subjects, bus: Bus
) -> None:
    """Both workers busy decoding; request ``lead`` brings a new 1024-token prefix to one of
    them and waits for the running step to end. ``follow`` (same prefix, another question)
    comes right after: sent at once, the engine would start both in one step and compute the
    prefix twice. The router holds it until ``lead``'s first token, so the engine reports the
    whole prefix cached for it."""
    sims = await SimCluster(nats_url, subjects, 2, speedup=0.05).start()
    router = await RouterProc(nats_url, subjects, policy="kv_aware").start()
    prefix = "".join(chr(97 + (i * 7) % 26) for i in range(1024))  # 1024 tokens = 64 blocks
    try:
        await router.wait_workers(2, timeout=20)
        r = router.router
        held = M.HOLDS.labels("token").value
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:

            async def post(rid: str, prompt: str, max_tokens: int) -> tuple[str, dict]:
                body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens}
                headers = {"x-request-id": rid}
                async with s.post(router.url + "/v1/completions", json=body, headers=headers) as x:
                    assert x.status == 200, await x.text()
                    return x.headers["x-kvgate-worker"], (await x.json())["usage"]

            busy = [asyncio.create_task(post(f"busy-{i}", f"keep busy {i}", 40)) for i in range(2)]
            await wait_until(
                lambda: all(w.inflight >= 1 for w in r.state.states.values()), what="both busy"
            )
            lead = asyncio.create_task(post("lead", prefix + " first question", 2))
            await wait_until(lambda: r.waits.pending("lead"), what="lead dispatched")
            w_follow, usage = await post("follow", prefix + " second question", 2)
            w_lead, _ = await lead
            await asyncio.gather(*busy)
        assert w_follow == w_lead
        assert M.HOLDS.labels("token").value == held + 1
        assert usage["prompt_tokens_details"]["cached_tokens"] == 1024
        assert len(r.waits) == 0
    finally:
        await shutdown(("router", router.stop()), ("sims", sims.stop()), each_s=10)
