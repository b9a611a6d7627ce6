"""``slo_aware``: the latency-model objective subject to per-request SLOs (expected choices
worked out by hand with a simple prior: 1 ms per prefill token, every other term 0)."""

from __future__ import annotations

import pytest

from services.core.policy import (
    POLICY_SCHEMAS,
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
    # by 1.0 s (x imposed_weight 0.5) -> a, although both are cold
    snap = ClusterSnapshot(
        {
            "a": WorkerState("a", model="m", capacity=CAP, inflight=0),
            "b": WorkerState("b", model="m", capacity=CAP, inflight=10),
        }
    )
    pol = build_policy({"name": "slo_aware", "params": {"prior": PRIOR}})
    d = decide(pol, RequestInfo("r", model="m", prompt_tokens=1000, max_tokens=10), snap, {})
    assert d.worker_id == "a"
    assert d.scores["b"] - d.scores["a"] == pytest.approx(0.5 * 10 * 1.0)
    pol = build_policy({"name": "slo_aware", "params": {"prior": PRIOR, "imposed_weight": 1}})
    d = decide(pol, RequestInfo("r", model="m", prompt_tokens=1000, max_tokens=10), snap, {})
    assert d.scores["b"] - d.scores["a"] == pytest.approx(10 * 1.0)


def test_decode_phase_does_not_pull_a_conversation_off_its_holder() -> None:
    # a holds 4000 of the 4100-token context and has 8 sequences decoding, b is idle and cold.
    # Decode steps cost 1 ms per sequence: a's decoders would make this request's 300 tokens
    # slower, and it theirs, by ~2.7 s and ~2.4 s, but that lasts only while those 8 decode;
    # the cost has TTFT and prefill terms only, so a (0.1 s of prefill) beats b (0.41 s, twice)
    prior = {**PRIOR, "prefill_token_s": 1e-4, "decode_seq_s": 1e-3}
    snap = ClusterSnapshot(
        {
            "a": WorkerState("a", model="m", capacity=CAP, inflight=8),
            "b": WorkerState("b", model="m", capacity=CAP),
        }
    )
    scores = []
    for out in (10, 300):
        spec = {"prior": prior, "slo_tpot_ms": 1000}
        pol = build_policy({"name": "slo_aware", "params": spec})  # fresh: no routed memory
        # with its block keys, as the router sends it (without, one prefix held by one busy
        # worker of two looks like a hot spot and is spread)
        keys = tuple(range(1, 257))
        r = RequestInfo(f"r{out}", model="m", prompt_tokens=4100, max_tokens=out, block_keys=keys)
        d = decide(pol, r, snap, {"a": 250})  # 250 blocks = 4000 tokens
        assert d.worker_id == "a"
        scores.append(d.scores)
    # the expected output changes no cost (it enters the TPOT prediction for the SLO only)
    assert scores[0] == pytest.approx(scores[1])


def test_params_validated() -> None:
    with pytest.raises(PolicyError, match="params.feasible_pick"):
        build_policy({"name": "slo_aware", "params": {"feasible_pick": "most"}})
    with pytest.raises(PolicyError, match="params.prior.prefill_token_s"):
        build_policy({"name": "slo_aware", "params": {"prior": {"prefill_token_s": -1}}})
    with pytest.raises(PolicyError, match="params.slo_ttft_ms"):
        build_policy({"name": "slo_aware", "params": {"slo_ttft_ms": 0}})


@pytest.mark.parametrize("key", ["stall_tpot_weight", "uncached_weight", "kv_pressure_weight"])
def test_kv_aware_cost_terms_it_does_not_use_are_refused_by_name(key: str) -> None:
    """kv_aware's cost terms have no place in slo_aware's cost: a spec naming one is refused
    (accepted, it would change nothing while the user believes it tuned), by name and why;
    kv_aware takes them, and slo_aware's schema no longer lists them."""
    with pytest.raises(PolicyError) as exc:
        build_policy({"name": "slo_aware", "params": {key: 10.0}})
    assert exc.value.field == f"params.{key}"
    assert "slo_aware does not take it" in exc.value.message and "kv_aware" in exc.value.message
    assert key not in POLICY_SCHEMAS["slo_aware"]["properties"]
    assert key not in build_policy({"name": "slo_aware", "params": {}}).params
    assert build_policy({"name": "kv_aware", "params": {key: 10.0}}).params[key] == 10.0
    # decode_weight stays: slo_aware's replication orders its targets by it
    assert build_policy({"name": "slo_aware", "params": {"decode_weight": 1.0}})


def test_queued_prefill_counts_in_full_until_its_first_token() -> None:
    """kv_aware's prefill clock discounts a queued prefill by the time elapsed at the learned
    speed; slo_aware counts it in full until its first token (long prompts looked done while
    still computing). Same clock, same samples: 500 tokens left by elapsed time, 1000 in full."""
    from services.core.policy.prefill_clock import PrefillClock

    def run(discount: bool) -> float:
        c = PrefillClock(min_tokens=1, slack=1.0)
        c.discount = discount
        c.dispatched("a", 0.0, 1000, 1000)
        done = WorkerState("a", model="m", capacity=CAP, first_token_at=1.0)
        c.observe(done, 1.0)  # 1000 tokens in 1 s: 1 ms per token
        assert c.spt == pytest.approx(1e-3)
        c.dispatched("a", 1.0, 1000, 1000)
        busy = WorkerState("a", model="m", capacity=CAP, pending_prefill_tokens=1000)
        return c.queued(busy, 1.5)

    assert run(True) == pytest.approx(500.0)
    assert run(False) == pytest.approx(1000.0)
    # and slo_aware sets its clock so
    pol = build_policy({"name": "slo_aware", "params": {"prior": PRIOR}})
    decide(pol, RequestInfo("r", model="m", prompt_tokens=100, max_tokens=4), cluster(), {})
    assert pol.state.extra["kv_aware_clock"].discount is False
