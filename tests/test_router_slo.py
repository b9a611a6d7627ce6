"""SLO headers at the router: x-slo-ttft-ms / x-slo-tpot-ms reach the policy, a policy that
sheds answers 429, bad headers are 400s, attainment is counted per policy."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from prometheus_client import REGISTRY

from services.common.bus import Bus
from tests.test_router_support import Beats, FakeWorker, RouterProc, post

# 1 s per prompt token before any observation: a 10-token prompt is predicted at ~10 s TTFT
SPEC = {"name": "slo_aware", "params": {"shed": True, "prior": {"prefill_token_s": 1.0}}}


def slo_count(result: str) -> float:
    v = REGISTRY.get_sample_value(
        "kvgate_router_slo_requests_total", {"policy": "slo_aware", "result": result}
    )
    return v or 0.0


async def test_slo_headers_shed_and_attainment(nats_url, subjects, bus: Bus) -> None:
    w = await FakeWorker("w0").start(bus)
    beats = Beats(bus, [w]).start()
    router = await RouterProc(nats_url, subjects, policy=json.dumps(SPEC)).start()
    shed0, met0 = slo_count("shed"), slo_count("met")
    try:
        await router.wait_workers(1)
        url = router.url + "/v1/completions"
        body = {"model": "m", "prompt": "a" * 10, "max_tokens": 4}
        async with aiohttp.ClientSession() as s:
            # predicted ~10 s > 100 ms: no worker meets it, the policy sheds -> 429
            st, h, raw = await post(s, url, body, {"x-slo-ttft-ms": "100"})
            assert st == 429, raw
            assert "Retry-After" in h
            err = json.loads(raw)["error"]
            assert err["type"] == "rate_limit_error" and "SLO" in err["message"]
            assert not w.served
            # a target it can meet is served (the policy default, 2 s, would shed it too)
            st, _, raw = await post(s, url, body, {"x-slo-ttft-ms": "600000"})
            assert st == 200, raw
            assert len(w.served) == 1
            st, _, _ = await post(s, url, body)
            assert st == 429
            # malformed targets are the client's error, naming the header
            for bad in ("abc", "-5", "0", "nan"):
                st, _, raw = await post(s, url, body, {"x-slo-tpot-ms": bad})
                assert st == 400, (bad, raw)
                assert b"x-slo-tpot-ms" in raw
        assert slo_count("shed") - shed0 == 2
        assert slo_count("met") - met0 == 1
    finally:
        await router.stop()
        await beats.stop()
        await w.stop()


def test_slo_result_against_targets_and_defaults() -> None:
    from services.router import slo

    t = slo.parse({"x-slo-ttft-ms": "500", "x-slo-tpot-ms": "20"})
    assert t == slo.SloTargets(0.5, 0.02)
    assert slo.parse({}) is slo.NO_TARGETS
    # 11 tokens: TPOT = (e2e - TTFT) / 10
    assert slo.result(t, {}, "ok", 0.4, 0.4 + 10 * 0.019, 11) == "met"
    assert slo.result(t, {}, "ok", 0.6, 0.7, 11) == "missed_ttft"
    assert slo.result(t, {}, "ok", 0.4, 0.4 + 10 * 0.021, 11) == "missed_tpot"
    assert slo.result(t, {}, "error", None, 1.0, 0) == "failed"
    assert slo.result(t, {}, "rejected", None, 0.0, 0, shed=True) == "shed"
    # no header: the policy's defaults, else 2 s / 50 ms
    assert slo.result(slo.NO_TARGETS, {"slo_ttft_ms": 100.0}, "ok", 0.2, 0.2, 1) == "missed_ttft"
    assert slo.result(slo.NO_TARGETS, {}, "ok", 1.9, 1.9 + 10 * 0.049, 11) == "met"


# the latency model's prior: 0.1 s of per-step overhead, ~15x the sim engine's 6.5 ms
SLOW_PRIOR = {"name": "slo_aware", "params": {"prior": {"overhead_s": 0.1}}}


async def test_streams_calibrate_the_decode_step_from_inter_token_times(
    nats_url, subjects, bus: Bus
) -> None:
    """Each stream the router relays ends with one inter-token observation (its mean gap)
    for the worker's latency model: a prior 15x too slow learns the engine's real step
    (without these observations only the per-token prefill cost is ever fitted)."""
    from services.core.latency import step_features
    from tests.test_router_e2e_sim import SimCluster

    sims = await SimCluster(nats_url, subjects, 1, speedup=1.0).start()
    router = await RouterProc(nats_url, subjects, policy=json.dumps(SLOW_PRIOR)).start()
    try:
        await router.wait_workers(1, timeout=20)
        policy = router.router.policies.control
        body = {"model": "m", "prompt": "count slowly", "max_tokens": 16, "stream": True}
        gaps: list[float] = []  # the client's own measure of each stream's mean gap
        wids: set[str] = set()
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as s:

            async def stream() -> None:
                stamps = []
                async with s.post(router.url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    wids.add(r.headers["x-kvgate-worker"])
                    async for line in r.content:
                        if line.startswith(b"data: {") and b'"text"' in line:
                            stamps.append(loop.time())
                assert len(stamps) >= 8
                gaps.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))

            for _ in range(8):  # 8 rounds of 8 concurrent streams
                await asyncio.gather(*(stream() for _ in range(8)))
        (wid,) = wids
        model = policy.state.extra["slo_models"][wid]
        assert model.observations >= 64  # one per stream (prefill samples may add more)
        ctx = policy.state.extra["slo_ctx"]
        # a decode step of one sequence reading the mean context, as the model predicts it
        x = step_features(0.0, 0.0, 1, ctx)
        step = sum(t * v for t, v in zip(model.theta, x, strict=True))
        mean_gap = sum(gaps) / len(gaps)
        # the prior said 0.1 s; calibrated, it is near the engine's step as clients see it
        assert step < 3 * mean_gap, (step, mean_gap)
    finally:
        await router.stop()
        await sims.stop()
