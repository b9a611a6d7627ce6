"""``--engine-priority``: the router sends each request's flow-control order to a real
simulated worker (vLLM's ``--scheduling-policy priority``) as the body's ``priority``: the
band (critical 0, standard 20, sheddable 40), +1 for a tenant over its share of the
work in flight (prompt tokens); a client's own ``priority`` does not survive; off by default."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp

from services.common.bus import Bus
from tests.test_router_support import RouterProc, wait_until
from tests.test_worker_sim_support import sim_worker


async def _beat(bus: Bus, w) -> None:
    """The sim worker's heartbeats (``kvgate sim-worker`` sends them from its app loop)."""
    while True:
        await bus.publish(bus.subjects.heartbeat(w.worker_id), w.heartbeat())
        await asyncio.sleep(0.2)


def _engine_priorities(w) -> dict[str, int]:
    """prompt tag (its first 2 characters) -> the priority its engine request carries (running
    or waiting)."""
    seqs = [*w.engine.running, *w.engine.waiting]
    return {
        bytes(s.req.prompt_token_ids[:2]).decode(errors="replace"): s.req.priority for s in seqs
    }


@contextlib.asynccontextmanager
async def _fleet(bus, nats_url, subjects, scheduling: str, **router_kw):
    engine = {"scheduling": scheduling, "max_num_seqs": 16, "num_gpu_blocks": 4096}
    async with sim_worker(bus, "w0", speedup=1.0, engine=engine, model="m") as w:
        beat = asyncio.create_task(_beat(bus, w))
        router = await RouterProc(nats_url, subjects, **router_kw).start()
        router.router.tenants.trust_header = True  # behind a gateway: x-kvgate-tenant / -priority
        try:
            await router.wait_workers(1)
            yield w, router
        finally:
            await router.stop()
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat


async def test_router_sends_band_and_share_as_the_engines_priority(nats_url, subjects, bus):
    async with _fleet(bus, nats_url, subjects, "priority", engine_priority=True) as (w, router):
        url = router.url + "/v1/completions"
        streams: list[aiohttp.ClientResponse] = []
        async with aiohttp.ClientSession() as s:

            async def open_stream(prompt: str, tenant: str, band: str, **extra) -> None:
                body = {"model": "m", "prompt": prompt, "max_tokens": 1000, "stream": True}
                r = await s.post(
                    url,
                    json={**body, **extra},
                    headers={"x-kvgate-tenant": tenant, "x-kvgate-priority": band},
                )
                assert r.status == 200, await r.text()
                await r.content.readline()  # its first token: it runs on the engine
                streams.append(r)

            # heavy's prompts are 40 tokens (the byte tokenizer), the others' 2: the share is
            # of the prompt tokens in flight (weights 1), (held + mine) / (in flight + mine)
            long = "-" * 38
            await open_stream("h1" + long, "heavy", "standard")  # alone: its whole share -> 20
            await open_stream("h2" + long, "heavy", "standard")  # still alone -> 20
            # a client's own priority is replaced by the router's
            await open_stream("l1", "light", "standard", priority=-100)  # 2/82 <= 1/2 -> 20
            await open_stream("l2", "light", "standard")  # 4/84 -> 20
            # 3 of 5 requests in flight, but 6 of 86 tokens: under its share -> 20
            await open_stream("l3", "light", "standard")
            await open_stream("h3" + long, "heavy", "standard")  # 120/126 > 1/2 -> 21
            await open_stream("c1", "ops", "critical")  # 2/128 <= 1/3 -> 0
            await open_stream("s1", "batch", "sheddable")  # not saturated: sent -> 40
            assert _engine_priorities(w) == {
                "h1": 20,
                "h2": 20,
                "l1": 20,
                "l2": 20,
                "l3": 20,
                "h3": 21,
                "c1": 0,
                "s1": 40,
            }
            holdings = router.router.flow.holdings
            assert holdings is not None
            assert holdings.count == {"heavy": 3, "light": 3, "ops": 1, "batch": 1}
            assert holdings.work == {"heavy": 120, "light": 6, "ops": 2, "batch": 2}
            for r in streams:  # the clients leave: every request ends, nothing stays held
                r.close()
            await wait_until(lambda: holdings.total_work == 0, what="holdings released")
            assert holdings.count == {} and holdings.work == {} and holdings.total_weight == 0.0


async def test_off_by_default_the_body_goes_as_the_client_sent_it(nats_url, subjects, bus):
    """Without --engine-priority nothing is added: an FCFS engine (which refuses a non-zero
    priority, as vLLM's V0 engine did) serves a tenant's standard request; a client's own
    ``priority`` reaches it unchanged."""
    async with _fleet(bus, nats_url, subjects, "fcfs") as (w, router):
        assert router.router.flow.holdings is None
        url = router.url + "/v1/completions"
        headers = {"x-kvgate-tenant": "a", "x-kvgate-priority": "standard"}
        async with aiohttp.ClientSession() as s:
            body = {"model": "m", "prompt": "x", "max_tokens": 2}
            async with s.post(url, json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
            async with s.post(url, json={**body, "priority": 5}, headers=headers) as r:
                err = json.loads(await r.text())["error"]
                assert r.status == 400 and err["param"] == "priority", err
