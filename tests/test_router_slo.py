"""SLO headers at the router: x-slo-ttft-ms / x-slo-tpot-ms reach the policy, a policy that
sheds answers 429, bad headers are 400s, attainment is counted per policy."""

from __future__ import annotations

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
