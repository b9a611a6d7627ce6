"""``kv_aware`` and ``slo_aware`` decide by the formulas their docs state: each policy's cost
has one implementation (``_worker_cost``, called by the full loop and the large-fleet path
alike); here a plain reference written from the documented formula (module docstrings,
docs/router.md) pins its scores on random clusters (first decision of a fresh policy: no
prefill clock, routed memory or queue age yet; ``hot_min_blocks`` out of reach, so no
spreading)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.policy import (
    Capacity,
    ClusterSnapshot,
    RequestInfo,
    WorkerState,
    build_policy,
    decide,
)

BS = 16
BLOCKS = 4096
CAP = Capacity(block_size=BS, num_gpu_blocks=BLOCKS, max_num_seqs=512, max_model_len=65536)
PRIOR = {
    "overhead_s": 0.0065,
    "prefill_token_s": 4.0e-5,
    "prefill_attn_s": 2.5e-9,
    "decode_seq_s": 3.0e-5,
    "decode_kv_token_s": 5.5e-8,
}
NO_HOT = {"hot_min_blocks": 10**6}

worker = st.tuples(
    st.integers(0, 20_000),  # pending prefill tokens
    st.integers(0, 100),  # requests in flight
    st.integers(512, BLOCKS),  # free blocks (the prompt and its output always fit)
    st.integers(0, 200),  # blocks of the prompt held
)
cluster = st.lists(worker, min_size=1, max_size=10)
request = st.tuples(st.integers(1, 6000), st.integers(1, 1000))  # prompt, max_tokens


def _snapshot(ws) -> tuple[ClusterSnapshot, dict[str, int]]:
    states, ov = {}, {}
    for i, (q, inflight, free, held) in enumerate(ws):
        wid = f"w{i}"
        states[wid] = WorkerState(
            wid,
            model="m",
            capacity=CAP,
            pending_prefill_tokens=q,
            inflight=inflight,
            kv_blocks_free=free,
        )
        ov[wid] = held
    return ClusterSnapshot(states), ov


@settings(max_examples=150, deadline=None)
@given(
    cluster,
    request,
    st.floats(0, 4),
    st.floats(0, 100),
    st.floats(0, 500),
    st.sampled_from([0.0, 0.5, 1.7]),
)
def test_kv_aware_scores_are_its_documented_formula(ws, rq, uw, dw, kw, iw) -> None:
    # cost(w) = queued + uncached_weight x uncached + decode_weight x inflight
    #           + kv_pressure_weight x kv_usage
    #           + imposed_weight x decoding x prefill(w) / prefill_token_s
    prompt, out = rq
    params = {"uncached_weight": uw, "decode_weight": dw, "kv_pressure_weight": kw, **NO_HOT}
    if iw:
        params["imposed_weight"] = iw
    pol = build_policy({"name": "kv_aware", "params": params})
    snap, ov = _snapshot(ws)
    d = decide(pol, RequestInfo("r", "m", prompt, out), snap, ov)
    for wid, w in snap.workers.items():
        uncached = max(0, prompt - ov[wid] * BS)
        usage = 1.0 - w.kv_blocks_free / BLOCKS
        ref = w.pending_prefill_tokens + uw * uncached + dw * w.inflight + kw * usage
        # the prefill stall: slo_aware's imposed term (the latency model's prefill time of
        # this prompt, each decoding request waits it) in prefill tokens (decode_gaps is 0 here,
        # so the TPOT term adds nothing); nothing of this
        # policy's own is queued, so every request in flight decodes
        _, _, prefill = _predict(0, 0, uncached, prompt, out)
        ref += iw * w.inflight * prefill / PRIOR["prefill_token_s"]
        assert math.isclose(d.scores[wid], ref, rel_tol=1e-9, abs_tol=1e-6), wid


def test_kv_aware_stall_is_off_by_default_and_moves_a_prompt_off_decoders() -> None:
    # w0: nothing queued, 30 requests decoding; w1: 4k prompt tokens queued, 2 decoding. By
    # its TTFT alone the new 6k-token prompt goes to w0; with the stall (30 decoders each
    # waiting its prefill) to w1
    snap, ov = _snapshot([(0, 30, 4096, 0), (4000, 2, 4096, 0)])
    req = RequestInfo("r", "m", 6000, 20)
    plain = decide(build_policy({"name": "kv_aware", "params": NO_HOT}), req, snap, ov)
    assert plain.worker_id == "w0"
    stall = build_policy({"name": "kv_aware", "params": {"imposed_weight": 0.5, **NO_HOT}})
    assert decide(stall, req, snap, ov).worker_id == "w1"


def test_kv_aware_prices_the_tpot_the_stall_adds_worked_by_hand() -> None:
    # a 4,000-token cold prompt; prefill(w) / prefill_token_s = 4000 + 2.5e-9 x 4000 x 2000
    # / 4e-5 = 4500 prefill-token equivalents (the attention term: 500). w0: nothing queued,
    # 10 requests decoding with 13-token answers (gaps = 10 / 12); w1: 3,000 tokens queued,
    # 10 decoding with 301-token answers (gaps = 10 / 300). Base costs (uncached_weight 1,
    # decode_weight 0, no KV pressure): w0 4000, w1 7000. stall_tpot_weight 10 adds
    # 10 x 10/12 x 4500 = 37500 to w0 and 10 x 10/300 x 4500 = 1500 to w1: w1 (8500) wins;
    # imposed_weight 1 would add 45000 to both alike and leave w0 first
    states = {
        "w0": WorkerState("w0", model="m", capacity=CAP, inflight=10, decode_gaps=10 / 12),
        "w1": WorkerState(
            "w1",
            model="m",
            capacity=CAP,
            inflight=10,
            pending_prefill_tokens=3000,
            decode_gaps=10 / 300,
        ),
    }
    snap, ov = ClusterSnapshot(states), {"w0": 0, "w1": 0}
    req = RequestInfo("r", "m", 4000, 20)
    base = {"uncached_weight": 1.0, "decode_weight": 0.0, "kv_pressure_weight": 0.0, **NO_HOT}
    base["stall_tpot_weight"] = 0.0
    plain = decide(build_policy({"name": "kv_aware", "params": base}), req, snap, ov)
    assert plain.worker_id == "w0"
    assert plain.scores == pytest.approx({"w0": 4000.0, "w1": 7000.0})
    tpot = build_policy({"name": "kv_aware", "params": {**base, "stall_tpot_weight": 10.0}})
    d = decide(tpot, req, snap, ov)
    assert d.scores == pytest.approx({"w0": 41500.0, "w1": 8500.0})
    assert d.worker_id == "w1"
    imposed = build_policy({"name": "kv_aware", "params": {**base, "imposed_weight": 1.0}})
    assert decide(imposed, req, snap, ov).worker_id == "w0"


def _predict(q: float, dec: int, u: float, prompt: int, out: int) -> tuple[float, float, float]:
    """The latency model as docs/router.md writes it (TTFT, TPOT, this prompt's prefill)
    for the prior, a step budget of 8192 and a decoder's mean context = this request's."""
    ov, pt, pa, ds, dk = (PRIOR[k] for k in PRIOR)
    ctx = prompt + out / 2.0
    steps = max(1, math.ceil((q + u) / max(1, 8192 - dec)))
    step = ov + ds * dec + dk * dec * ctx
    prefill = pt * u + pa * u * (prompt - u / 2.0)
    return steps * step + pt * q + prefill, step + ds + dk * ctx, prefill


@settings(max_examples=150, deadline=None)
@given(
    cluster,
    request,
    st.floats(0, 2),
    st.floats(0, 2),
    st.sampled_from([(2000.0, 50.0), (300.0, 8.0), (1e9, 1e9)]),
)
def test_slo_aware_scores_are_its_documented_formula(ws, rq, iw, cw, slo) -> None:
    # cost(w) = ttft(w) + imposed_weight x decoding(w) x prefill(w) + compute_weight x prefill(w)
    # + a large constant for a worker predicted to miss the SLO when another meets it
    prompt, out = rq
    params = {
        "prior": PRIOR,
        "imposed_weight": iw,
        "compute_weight": cw,
        "slo_ttft_ms": slo[0],
        "slo_tpot_ms": slo[1],
        **NO_HOT,
    }
    pol = build_policy({"name": "slo_aware", "params": params})
    snap, ov = _snapshot(ws)
    d = decide(pol, RequestInfo("r", "m", prompt, out), snap, ov)
    ref, ok = {}, {}
    for wid, w in snap.workers.items():
        u = max(0, prompt - ov[wid] * BS)
        dec = w.inflight  # nothing of this policy's own is queued: all in flight decode
        ttft, tpot, prefill = _predict(w.pending_prefill_tokens, dec, u, prompt, out)
        ref[wid] = ttft + (iw * dec + cw) * prefill
        ok[wid] = ttft <= slo[0] / 1000.0 and tpot <= slo[1] / 1000.0
    if any(ok.values()):
        ref = {w: c + (0.0 if ok[w] else 1e6) for w, c in ref.items()}
    for wid in snap.workers:
        assert math.isclose(d.scores[wid], ref[wid], rel_tol=1e-9, abs_tol=1e-9), wid
