"""``slo_aware``: the latency-model objective subject to per-request SLOs (expected choices
worked out by hand with a simple prior: 1 ms per prefill token, every other term 0)."""

from __future__ import annotations

import pytest

from services.core.policy import (
    Capacity,
    ClusterSnapshot,
    PolicyError,
    RequestInfo,
    WorkerState,
    build_policy,
    decide,
)

CAP = Capacity(block_size=16, num_gpu_blocks=100_000, max_num_seqs=256, max_model_len=65536)
PRIOR = {
    "overhead_s": 0.0,
    "prefill_token_s": 1e-3,
    "prefill_attn_s": 0.0,
    "decode_seq_s": 0.0,
    "decode_kv_token_s": 0.0,
}


def cluster() -> ClusterSnapshot:
    # a holds the whole 1000-token prompt but has 1500 tokens queued: TTFT 1.5 s, computes 0;
    # b is idle and cold: TTFT 1.0 s, computes 1000 tokens (1.0 s)
    return ClusterSnapshot(
        {
            "a": WorkerState("a", model="m", capacity=CAP, pending_prefill_tokens=1500),
            "b": WorkerState("b", model="m", capacity=CAP),
        }
    )


OV = {"a": 63}  # 63 blocks = 1008 tokens >= the prompt


def pick(ttft_ms: float, header_ttft_s: float | None = None, **params):
    spec = {"prior": PRIOR, "slo_ttft_ms": ttft_ms, **params}
    pol = build_policy({"name": "slo_aware", "params": spec})
    r = RequestInfo("r", model="m", prompt_tokens=1000, max_tokens=10, slo_ttft_s=header_ttft_s)
    return decide(pol, r, cluster(), OV)


def test_loose_slo_lowest_cost_wins() -> None:
    # cost = TTFT + own compute (compute_weight 1): a = 1.5 + 0, b = 1.0 + 1.0 -> a
    d = pick(2000)
    assert d.worker_id == "a"
    assert d.scores["a"] == pytest.approx(1.5)
    assert d.scores["b"] == pytest.approx(2.0)


def test_worker_missing_the_ttft_slo_is_avoided() -> None:
    # 1.2 s: a's 1.5 s misses it, b's 1.0 s meets it -> b despite its higher cost
    assert pick(1200).worker_id == "b"
    # the per-request target (header) overrides the policy default
    assert pick(2000, header_ttft_s=1.2).worker_id == "b"
    assert pick(1200, header_ttft_s=2.0).worker_id == "a"


def test_headroom_pick() -> None:
    # both meet 2 s: headroom a = 1 - 1.5/2 = 0.25, b = 1 - 1/2 = 0.5 -> b
    assert pick(2000, feasible_pick="headroom").worker_id == "b"


def test_nobody_meets_the_slo_best_overall_or_shed() -> None:
    d = pick(800)
    assert d.worker_id == "a" and not d.shed
    d = pick(800, shed=True)
    assert d.worker_id is None and d.shed and not d.wait
    assert "SLO" in d.reason
    # shedding does not leave the policy's per-decision state behind: the next one is normal
    pol = build_policy({"name": "slo_aware", "params": {"prior": PRIOR, "shed": True}})
    snap = cluster()
    tight = RequestInfo("r1", model="m", prompt_tokens=1000, max_tokens=10, slo_ttft_s=0.5)
    assert decide(pol, tight, snap, OV).shed
    loose = RequestInfo("r2", model="m", prompt_tokens=1000, max_tokens=10, slo_ttft_s=2.0)
    assert decide(pol, loose, snap, OV).worker_id == "a"


def test_decoders_pay_for_a_prefill() -> None:
    # same queues, b has 10 decoding: sending the 1000-token prefill there delays each of them
    # by 1.0 s (imposed_weight 1) -> a, although both are cold
    snap = ClusterSnapshot(
        {
            "a": WorkerState("a", model="m", capacity=CAP, inflight=0),
            "b": WorkerState("b", model="m", capacity=CAP, inflight=10),
        }
    )
    pol = build_policy({"name": "slo_aware", "params": {"prior": PRIOR}})
    d = decide(pol, RequestInfo("r", model="m", prompt_tokens=1000, max_tokens=10), snap, {})
    assert d.worker_id == "a"
    assert d.scores["b"] - d.scores["a"] == pytest.approx(10 * 1.0)


def test_params_validated() -> None:
    with pytest.raises(PolicyError, match="params.feasible_pick"):
        build_policy({"name": "slo_aware", "params": {"feasible_pick": "most"}})
    with pytest.raises(PolicyError, match="params.prior.prefill_token_s"):
        build_policy({"name": "slo_aware", "params": {"prior": {"prefill_token_s": -1}}})
    with pytest.raises(PolicyError, match="params.slo_ttft_ms"):
        build_policy({"name": "slo_aware", "params": {"slo_ttft_ms": 0}})
