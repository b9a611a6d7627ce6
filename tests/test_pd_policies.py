"""P/D policies' pairing decisions, worked out by hand: kvgate's ``pd_slo`` from the latency
model's prior (the engine model's step costs), and the peers' P/D rules from their sources."""

from __future__ import annotations

import math

import pytest

from services.core.pd.transfer import LINK_PROFILES, ModelShape, transfer_seconds
from services.core.policy import (
    Capacity,
    ClusterSnapshot,
    RequestInfo,
    WorkerState,
    build_policy,
    decide,
)
from services.core.policy.builtin.pd_dynamo import bypass
from services.core.policy.builtin.pd_llmd import disaggregate

CAP = Capacity(block_size=16, num_gpu_blocks=100_000, max_num_seqs=256, max_model_len=65536)
# the prior: overhead 6.5 ms, 40 us a prefill token, 2.5 ns a (token x context) of attention,
# 30 us a decoding sequence, 55 ns a KV token read
OV, PT, PA, DS, DK = 0.0065, 4.0e-5, 2.5e-9, 3.0e-5, 5.5e-8


def fleet(**per: dict) -> dict[str, WorkerState]:
    out = {}
    for wid, kw in per.items():
        role = "prefill" if wid.startswith("p") else "decode" if wid.startswith("d") else "both"
        out[wid] = WorkerState(wid, model="m", capacity=CAP, role=role, **kw)
    return out


def req(prompt: int, out: int = 100, rid: str = "r") -> RequestInfo:
    return RequestInfo(rid, model="m", prompt_tokens=prompt, max_tokens=out)


def pd(name: str, workers, r: RequestInfo, ov: dict[str, int] | None = None, **params):
    pol = build_policy({"name": name, "params": params})
    return decide(pol, r, ClusterSnapshot(workers), ov or {})


# ---------------------------------------------------------------- pd_slo
def test_pd_slo_idle_decoder_prefills_itself_the_transfer_costs_more() -> None:
    # prompt 4096, 100 out, nothing cached, everything idle; ctx = 4096 + 50 = 4146.
    # local on d: prefill = 40e-6 x 4096 + 2.5e-9 x 4096 x 2048 = 0.184811; ttft = 6.5 ms +
    #   0.184811 = 0.191311; tpot = 6.5 ms + own (30e-6 + 55e-9 x 4146 = 258.03 us);
    #   cost = 0.191311 + 100 x tpot (0.675803) + 1 x prefill (0.184811) = 1.051925
    # remote via p: ttft = 0.191311 (p's) + transfer 4096 tok (2 ms + 4096 x 131072 / 40e9 =
    #   15.42 ms) + one decode step on d (6.5 ms + 258.03 us + 40 us) = 0.213531; cost =
    #   0.213531 + 0.675803 + p's compute 0.184811 = 1.074145 > local
    d = pd("pd_slo", fleet(p0={}, d0={}), req(4096))
    prefill = PT * 4096 + PA * 4096 * 2048
    own = DS + DK * 4146
    local = (OV + prefill) + 100 * (OV + own) + prefill
    assert d.worker_id == "d0" and d.prefill_worker is None and d.reason == "local prefill"
    assert math.isclose(d.scores["d0"], local, rel_tol=1e-9)


def test_pd_slo_never_lets_a_decoder_that_cannot_prefill_alone_do_it() -> None:
    # the idle case above prefers the decoder's own prefill (1.0519 < 1.0741); an SGLang
    # decode server cannot run it (it waits for a bootstrap room's KV), so the pair is remote
    # at the remote cost worked out above, and with no prefill worker there is nothing to send
    # to: the request waits for one instead of hanging on the decoder
    sglang_decoder = {"prefills_alone": False}
    d = pd("pd_slo", fleet(p0={}, d0=sglang_decoder), req(4096))
    assert d.worker_id == "d0" and d.prefill_worker == "p0" and d.reason == "remote prefill"
    xfer = transfer_seconds(4096, ModelShape(), LINK_PROFILES["rdma"])
    prefill = PT * 4096 + PA * 4096 * 2048
    own = DS + DK * 4146
    remote = (OV + prefill) + xfer + (OV + own + PT) + 100 * (OV + own) + prefill
    assert math.isclose(d.scores["d0"], remote, rel_tol=1e-9)
    # beside it a vLLM decoder may still prefill locally, and is then the cheaper pick
    d = pd("pd_slo", fleet(p0={}, d0=sglang_decoder, d1={}), req(4096))
    assert d.worker_id == "d1" and d.prefill_worker is None
    alone = pd("pd_slo", fleet(d0=sglang_decoder), req(4096))
    assert alone.worker_id is None and alone.wait and "prefill worker" in alone.reason


def test_sglang_decoders_are_known_from_their_heartbeat() -> None:
    from services.common.schemas import WorkerCapacity, WorkerHeartbeat
    from services.core.cluster import prefills_alone

    def hb(engine: str, role: str) -> WorkerHeartbeat:
        cap = WorkerCapacity(block_size=16, num_gpu_blocks=8, max_num_seqs=8, max_model_len=64)
        return WorkerHeartbeat(
            worker_id="w",
            instance_id="i",
            url="http://h:1",
            model="m",
            capacity=cap,
            engine=engine,
            role=role,
        )

    assert not prefills_alone(hb("sglang", "decode"))
    assert prefills_alone(hb("vllm", "decode")) and prefills_alone(hb("sim", "decode"))
    assert prefills_alone(hb("sglang", "prefill")) and prefills_alone(hb("sglang", "both"))


def test_pd_slo_busy_decoder_sends_the_prefill_away() -> None:
    # 10 requests decoding on d0: locally the 0.1848 s prefill stalls each of them (imposed
    # 10 x 0.1848 = 1.85 s) while the remote path adds 24 ms of transfer and a decode step:
    # remote, from the idle prefiller, with the transfer of the 4096 tokens d0 lacks
    d = pd("pd_slo", fleet(p0={}, d0={"inflight": 10}), req(4096))
    assert (d.worker_id, d.prefill_worker) == ("d0", "p0")
    assert math.isclose(d.transfer_s, transfer_seconds(4096, ModelShape(), LINK_PROFILES["rdma"]))
    assert d.prefill_cached_tokens == 0 and d.cached_tokens == 0


def test_pd_slo_decoder_holding_most_of_the_prompt_prefills_locally() -> None:
    # d0 (10 decoding) holds 250 blocks = 4000 of 4096 tokens: locally 96 tokens
    # (40e-6 x 96 + 2.5e-9 x 96 x 4048 = 4.81 ms, x 10 decoders = 48 ms imposed) beat the
    # prefiller's 0.185 s of compute for the whole prompt
    d = pd("pd_slo", fleet(p0={}, d0={"inflight": 10}), req(4096), {"d0": 250})
    assert (d.worker_id, d.prefill_worker) == ("d0", None)
    assert d.cached_tokens == 4000


def test_pd_slo_keeps_decoders_within_tpot_while_they_prefill() -> None:
    # d0 holds 2000 of 4096 tokens, 1 request decoding there; the prefiller has 30,000 tokens
    # queued (its TTFT ~1.4 s, within the 2 s target). Locally: 2096 tokens,
    # 40e-6 x 2096 + 2.5e-9 x 2096 x 3048 = 99.8 ms, far cheaper than waiting for p0.
    # With 100 output tokens the stall is ~1 ms a token on top of d0's ~7 ms step: local.
    w = fleet(p0={"pending_prefill_tokens": 30_000}, d0={"inflight": 1})
    assert pd("pd_slo", w, req(4096, 100), {"d0": 125}).prefill_worker is None
    # answers of 2 tokens: d0's decoding request would wait 99.8 ms / 2 = 50 ms a token more,
    # past the 50 ms target (step ~7 ms + 50 ms): remote, although its TTFT is longer
    assert pd("pd_slo", w, req(4096, 2), {"d0": 125}).prefill_worker == "p0"
    # with nobody decoding there nobody waits: local again
    w["d0"].inflight = 0
    assert pd("pd_slo", w, req(4096, 2), {"d0": 125}).prefill_worker is None


def test_pd_slo_prefiller_by_overlap_and_queue_decoder_by_load() -> None:
    # p0 holds 200 of the prompt's 256 blocks, p1 holds none; p0 also has 1000 tokens queued:
    # p0 computes 896 tokens behind 1000 (ttft ~ 6.5 ms + 40e-6 x 1896 + attention) ~ 0.09 s,
    # p1 4096 ~ 0.19 s: p0. The decoders differ in load only (5 vs 40 decoding): d0.
    w = fleet(
        p0={"pending_prefill_tokens": 1000},
        p1={},
        d0={"inflight": 5},
        d1={"inflight": 40},
    )
    d = pd("pd_slo", w, req(4096), {"p0": 200})
    assert (d.worker_id, d.prefill_worker) == ("d0", "p0")
    assert d.prefill_cached_tokens == 3200
    assert d.scores["d0"] < d.scores["d1"]


def test_pd_slo_ties_spread_over_equal_workers() -> None:
    w = fleet(p0={}, p1={}, d0={"inflight": 10}, d1={"inflight": 10})
    pairs = {
        (x.worker_id, x.prefill_worker)
        for x in (pd("pd_slo", w, req(4096), seed=s) for s in range(16))
    }
    assert {p for _, p in pairs} == {"p0", "p1"} and {d for d, _ in pairs} == {"d0", "d1"}


def test_pd_slo_sheds_only_when_asked_and_nothing_meets_the_slo() -> None:
    # TTFT target 50 ms: even the idle prefiller needs 0.19 s for 4096 tokens
    w = fleet(p0={}, d0={"inflight": 10})
    assert pd("pd_slo", w, req(4096), slo_ttft_ms=50).worker_id == "d0"
    d = pd("pd_slo", w, req(4096), slo_ttft_ms=50, shed=True)
    assert d.worker_id is None and d.shed and "no P/D pair" in d.reason


def test_pd_policies_wait_or_refuse_like_colocated_ones() -> None:
    full = fleet(p0={}, d0={"inflight": 256})
    for name in ("pd_slo", "pd_dynamo", "pd_llmd", "pd_round_robin", "pd_sglang"):
        d = pd(name, full, req(64))
        assert d.worker_id is None and d.wait, name
        d = pd(name, fleet(p0={}), req(64))  # no decoder at all
        assert d.worker_id is None and not d.wait and "decode worker" in d.reason, name
        huge = pd(name, fleet(p0={}, d0={}), req(70_000))
        assert huge.never_fits, name


# ---------------------------------------------------------------- peers
def test_round_robin_pairs_cycle_independently() -> None:
    # vLLM's toy proxy: itertools.cycle over prefillers and decoders, every request remote
    pol = build_policy({"name": "pd_round_robin"})
    w = fleet(p0={}, p1={}, d0={}, d1={}, d2={})
    got = [
        (d.prefill_worker, d.worker_id)
        for d in (decide(pol, req(64, rid=f"r{i}"), ClusterSnapshot(w), {}) for i in range(4))
    ]
    assert got == [("p0", "d0"), ("p1", "d1"), ("p0", "d2"), ("p1", "d0")]


@pytest.mark.parametrize(
    ("prompt", "cached", "expected"),
    [
        (1000, 896, True),  # eff 104 < 2048, ratio 0.104 < 0.7 (Dynamo's own test case)
        (200, 0, False),  # eff 200 but ratio 1.0
        (100_000, 64_000, False),  # ratio 0.36 but eff 36k
        (2048 * 4, 2048 * 3, False),  # eff 2048 = threshold: strict <
    ],
)
def test_dynamo_isl_bounding_bypass(prompt: int, cached: int, expected: bool) -> None:
    assert bypass(prompt, cached, 2048, 0.7) is expected


def test_dynamo_pairs_by_kv_cost_and_bypasses_mostly_cached_requests() -> None:
    # decode: Dynamo's cost = prefill blocks + decode blocks; d1 holds 56 of 64 blocks of the
    # 1024-token prompt -> (1024 - 896) / 16 = 8 prefill blocks + 64 = 72 vs d0's 64 + 64:
    # d1; eff_isl = 128 < 2048, ratio 0.125 < 0.7: bypass (d1 prefills)
    w = fleet(p0={}, p1={}, d0={}, d1={})
    d = pd("pd_dynamo", w, req(1024), {"d1": 56})
    assert (d.worker_id, d.prefill_worker) == ("d1", None)
    # a cold prompt: remote, the prefiller with the lower KV cost (p1 holds 32 blocks)
    d = pd("pd_dynamo", w, req(1024), {"p1": 32})
    assert d.prefill_worker == "p1" and d.worker_id in {"d0", "d1"}
    assert pd("pd_dynamo", w, req(1024), {"d1": 56}, conditional=False).prefill_worker


def test_dynamo_ties_spread() -> None:
    w = fleet(p0={}, p1={}, d0={}, d1={})
    pairs = {
        (x.prefill_worker, x.worker_id)
        for x in (pd("pd_dynamo", w, req(4096), seed=s) for s in range(16))
    }
    assert {p for p, _ in pairs} == {"p0", "p1"} and {d for _, d in pairs} == {"d0", "d1"}


@pytest.mark.parametrize(
    ("prompt", "cached", "threshold", "expected"),
    [
        (64, 0, 0, True),  # nonCachedTokens 0 (the default): always disaggregate
        (400, 0, 512, False),  # the prompt is shorter than the threshold
        (4096, 3800, 512, False),  # 296 uncached < 512
        (4096, 3000, 512, True),  # 1096 uncached >= 512
    ],
)
def test_llmd_prefix_based_decider(prompt: int, cached: int, threshold: int, expected) -> None:
    assert disaggregate(prompt, cached, threshold) is expected


def test_llmd_decode_profile_first_then_decider_on_its_pick() -> None:
    w = fleet(p0={}, p1={"waiting": 3}, d0={}, d1={})
    # decode profile: prefix x3 + queue x2; d0 holds 240 of 256 blocks -> d0; the decider
    # (threshold 512) sees 256 uncached tokens there: decode only
    d = pd("pd_llmd", w, req(4096), {"d0": 240}, non_cached_tokens=512, prefix_mode="precise")
    assert (d.worker_id, d.prefill_worker) == ("d0", None)
    # nothing cached: prefill profile runs; p1's queue is longer: p0
    d = pd("pd_llmd", w, req(4096), {}, non_cached_tokens=512)
    assert d.prefill_worker == "p0"


def test_sglang_pd_pairs_each_pool_by_its_own_cache_aware_tree() -> None:
    pol = build_policy({"name": "pd_sglang"})
    w = fleet(p0={}, p1={}, d0={}, d1={})
    keys = tuple(range(100, 164))
    first = RequestInfo("a", model="m", prompt_tokens=1024, max_tokens=8, block_keys=keys)
    a = decide(pol, first, ClusterSnapshot(w), {})
    again = RequestInfo("b", model="m", prompt_tokens=1024, max_tokens=8, block_keys=keys)
    b = decide(pol, again, ClusterSnapshot(w), {})
    # the same prompt follows its tree in both pools
    assert (b.prefill_worker, b.worker_id) == (a.prefill_worker, a.worker_id)
    other = RequestInfo(
        "c", model="m", prompt_tokens=1024, max_tokens=8, block_keys=tuple(range(500, 564))
    )
    # a cold prompt goes to the least loaded, ties by fewest processed: the other pair
    c = decide(pol, other, ClusterSnapshot(w), {})
    assert c.prefill_worker != a.prefill_worker and c.worker_id != a.worker_id
