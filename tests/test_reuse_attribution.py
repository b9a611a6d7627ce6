"""Reuse attribution in the pure decision path (services/core/policy/attribution.py): the
tokens some eligible worker held (available), the chosen worker's (captured), and why the best
holder was not taken."""

from __future__ import annotations

import random

import pytest

from services.core.policy import ClusterSnapshot, RequestInfo, WorkerState, build_policy, decide
from services.core.policy.attribution import LOST_REASONS, verdict_reason
from services.core.policy.types import Capacity

BS = 16


def fleet(n: int = 3, **kw) -> dict[str, WorkerState]:
    return {f"w{i}": WorkerState(f"w{i}", model="m", **kw) for i in range(n)}


def req(prompt: int = 320, rid: str = "r", model: str = "m") -> RequestInfo:
    return RequestInfo(rid, model=model, prompt_tokens=prompt, max_tokens=16)


def one(policy: str | dict, ws: dict[str, WorkerState], overlaps: dict[str, int], **kw):
    spec = {"name": policy, "params": {}} if isinstance(policy, str) else policy
    return decide(build_policy(spec), req(**kw), ClusterSnapshot(ws), overlaps)


def test_the_chosen_holder_captures_everything_available() -> None:
    d = one("kv_aware", fleet(), {"w1": 10, "w2": 4})
    assert d.worker_id == "w1"
    assert (d.available_tokens, d.cached_tokens, d.lost_reason) == (160, 160, "")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"inflight": 256}, "capacity"),  # at max_num_seqs
        ({"kv_blocks_free": 0}, "capacity"),
        ({"circuit_open": True}, "breaker"),
        ({"healthy": False}, "unhealthy"),
        ({"cordoned": True}, "drain"),
        ({"draining": True}, "drain"),
    ],
)
def test_a_holder_that_was_no_candidate_names_its_filter(change: dict, reason: str) -> None:
    ws = fleet()
    for k, v in change.items():
        setattr(ws["w1"], k, v)
    d = one("kv_aware", ws, {"w1": 10, "w2": 4})
    assert d.worker_id == "w2"
    assert (d.available_tokens, d.cached_tokens, d.lost_reason) == (160, 64, reason)


def test_a_holder_the_request_cannot_run_on_offers_nothing() -> None:
    ws = fleet()
    ws["w1"].model = "other"  # another model's worker: not eligible
    ws["w0"].capacity = Capacity(max_model_len=100)  # the request never fits there
    ws["w3"] = WorkerState("w3", model="m", role="prefill")  # P/D: not a colocated worker
    d = one("kv_aware", ws, {"w1": 20, "w0": 20, "w3": 20, "w2": 4})
    assert d.worker_id == "w2"
    assert (d.available_tokens, d.cached_tokens, d.lost_reason) == (64, 64, "")


def test_a_loaded_holder_is_lost_to_load_and_a_blind_policy_to_policy() -> None:
    ws = fleet()
    ws["w1"].inflight = 200
    ws["w1"].pending_prefill_tokens = 50_000
    d = one("kv_aware", ws, {"w1": 4})
    assert d.worker_id != "w1"
    assert (d.available_tokens, d.cached_tokens, d.lost_reason) == (64, 0, "load")
    rr = build_policy({"name": "round_robin", "params": {}})
    reasons = set()
    for i in range(3):
        d = decide(rr, req(rid=f"r{i}"), ClusterSnapshot(fleet()), {"w1": 4})
        reasons.add((d.worker_id == "w1", d.lost_reason))
    assert reasons == {(True, ""), (False, "policy")}


def test_an_equal_cost_holder_is_a_tie() -> None:
    # prefix-blind costs, all equal: random ties
    p = build_policy({"name": "least_request", "params": {}})
    seen = set()
    for i in range(20):
        d = decide(p, req(rid=f"r{i}"), ClusterSnapshot(fleet()), {"w1": 4})
        seen.add(d.lost_reason)
    assert seen == {"", "tie"}


def test_slo_aware_names_a_holder_predicted_to_miss_the_slo() -> None:
    ws = fleet(2)
    ws["w0"].pending_prefill_tokens = 400_000  # minutes of queued prefill: misses any TTFT
    ws["w0"].inflight = 10
    d = one("slo_aware", ws, {"w0": 19})
    assert d.worker_id == "w1"
    assert (d.available_tokens, d.lost_reason) == (304, "slo")


def test_available_is_capped_by_the_prompt() -> None:
    ws = fleet()
    ws["w0"].healthy = False
    d = one("kv_aware", ws, {"w0": 100, "w1": 3}, prompt=100)
    assert (d.available_tokens, d.cached_tokens, d.lost_reason) == (100, 48, "unhealthy")


def test_verdicts_map_to_reasons() -> None:
    assert verdict_reason("at cap: 3 in flight >= 3") == "capacity"
    assert verdict_reason("KV full: needs 9 blocks, 2 free") == "capacity"
    assert verdict_reason("serves 'x'") is None
    assert verdict_reason("role prefill") is None  # a colocated policy never routes there
    assert verdict_reason("needs 900 KV blocks > 10 total") is None
    assert verdict_reason("9000 tokens > max_model_len 8192") is None
    assert verdict_reason("something new") == "filtered"


@pytest.mark.parametrize(
    "policy", ["kv_aware", "slo_aware", "prefix", "round_robin", "llmd_default", "dynamo_kv"]
)
def test_invariants_over_random_fleets(policy: str) -> None:
    """0 <= captured <= available <= prompt; a reason exactly when captured < available; the
    reason is a known one; available is the best eligible holder's tokens."""
    rng = random.Random(7)
    p = build_policy({"name": policy, "params": {}})
    for i in range(300):
        ws = fleet(6)
        for w in ws.values():
            w.inflight = rng.randrange(0, 12)
            w.pending_prefill_tokens = rng.randrange(0, 4000)
            w.healthy = rng.random() > 0.1
            w.circuit_open = rng.random() < 0.1
            w.kv_blocks_free = rng.choice([None, 0, 5, 500])
            if rng.random() < 0.1:
                w.model = "other"
        overlaps = {w: rng.randrange(0, 30) for w in ws if rng.random() < 0.6}
        prompt = rng.randrange(1, 500)
        d = decide(p, req(prompt, f"r{i}"), ClusterSnapshot(ws), overlaps)
        if d.worker_id is None:
            continue
        assert 0 <= d.cached_tokens <= d.available_tokens <= prompt
        assert (d.lost_reason == "") == (d.cached_tokens == d.available_tokens)
        assert d.lost_reason == "" or d.lost_reason in LOST_REASONS
        eligible = [
            min(n * BS, prompt)
            for wid, n in overlaps.items()
            if ws[wid].model == "m" and not d.filtered.get(wid, "").startswith(("serves", "needs"))
        ]
        assert d.available_tokens == max([d.cached_tokens, *eligible])
