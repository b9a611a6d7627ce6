"""One lifecycle, two clocks: the same scenario through the live router (real router, real
indexer, real simulated workers, real NATS) and through the cluster simulator (bench/simcore.py,
virtual clock), both driving ``services.core.lifecycle``. For a deterministic arrival order
(each request sent after the previous one finished and its KV events reached the router's
index) every request must go to the same worker and find the same cached prefix.

The scenario: 4 workers, 4 prompt groups (a 20-block shared prefix each) interleaved, 3 rounds.
``kv_aware`` spreads the groups' first requests and keeps every later one on its group's
holder; a simulator whose dispatch, accounting or index drifted from the router's would send
some elsewhere (or predict other hits).
"""

from __future__ import annotations

import dataclasses

import aiohttp

from bench.simcore import SimOptions, simulate
from bench.workloads import BenchRequest
from services.common.bus import Bus
from services.common.tokenizer import load_tokenizer
from services.core.keys import block_keys, block_seed
from services.worker_sim.app import engine_config_from
from tests.test_router_e2e_sim import SimCluster
from tests.test_router_support import Indexer, RouterProc, shutdown, wait_until

GROUPS, ROUNDS, WORKERS = 4, 3, 4
POLICY = {"name": "kv_aware", "params": {}}


def _scenario(block_size: int) -> list[BenchRequest]:
    out = []
    for rnd in range(ROUNDS):
        for g in range(GROUPS):
            prefix = "".join(chr(97 + (g * 11 + i * 7) % 26) for i in range(20 * block_size))
            out.append(
                BenchRequest(
                    request_id=f"g{g}-r{rnd}",
                    prompt=f"{prefix} question {rnd} of group {g}?",
                    max_tokens=4,
                    arrival_s=10.0 * len(out),  # each one long finished before the next
                    group=g,
                )
            )
    return out


async def test_live_router_and_simulator_make_the_same_decisions(
    nats_url, subjects, bus: Bus
) -> None:
    sims = await SimCluster(nats_url, subjects, WORKERS).start()
    indexer = await Indexer(nats_url, subjects).start()
    router = await RouterProc(nats_url, subjects, policy="kv_aware").start()
    cfg = engine_config_from(sims.st, load_tokenizer(""))
    requests = _scenario(cfg.block_size)
    seed = block_seed(router.router.st.hash_seed if router.router else 0)
    live: dict[str, tuple[str, int]] = {}
    try:
        await router.wait_workers(WORKERS, timeout=20)
        r = router.router
        assert r is not None
        index = r.index_source.index
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            for q in requests:
                body = {"model": "m", "prompt": q.prompt, "max_tokens": q.max_tokens}
                headers = {"x-request-id": q.request_id}
                async with s.post(router.url + "/v1/completions", json=body, headers=headers) as x:
                    assert x.status == 200, await x.text()
                    worker = x.headers["x-kvgate-worker"]
                    usage = (await x.json())["usage"]
                live[q.request_id] = (worker, usage["prompt_tokens_details"]["cached_tokens"])
                # the next decision sees this request's prompt in the index, as in the
                # simulator (where KV events apply when the engine step ends)
                keys = block_keys(q.token_ids(), cfg.block_size, seed)
                await wait_until(
                    lambda k=keys, w=worker: index.find_matches(k).get(w, 0) == len(k),
                    what=f"{q.request_id}'s prompt indexed on {worker}",
                )
    finally:
        await shutdown(
            ("router", router.stop()), ("indexer", indexer.stop()), ("sims", sims.stop()), each_s=10
        )

    engine = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    opts = SimOptions(
        num_workers=WORKERS,
        engine=engine,
        model="m",
        telemetry_interval_s=0.0,  # the live sim workers publish no telemetry either
        speedup=sims.st.speedup,
        worker_prefix=sims.st.worker_id,
    )
    run = simulate(requests, POLICY, opts)
    simulated = {x.request_id: (x.worker, x.cached_tokens) for x in run.results}
    assert all(x.status == "ok" for x in run.results), [x.error for x in run.results]
    assert simulated == live
    # and the scenario is not trivial: groups spread over the workers, followers stay
    by_group = {g: {live[f"g{g}-r{rnd}"][0] for rnd in range(ROUNDS)} for g in range(GROUPS)}
    assert all(len(ws) == 1 for ws in by_group.values()), by_group
    assert len(set().union(*by_group.values())) >= 3, by_group
    assert all(
        live[f"g{g}-r{rnd}"][1] >= 20 * cfg.block_size for g in range(GROUPS) for rnd in (1, 2)
    )
