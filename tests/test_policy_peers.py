"""Peer baselines (sglang cache_aware, Dynamo KV cost, llm-d scorers): expected choices worked
out by hand from each peer's published rule on small snapshots."""

from __future__ import annotations

import pytest

from services.core.policy import (
    Capacity,
    ClusterSnapshot,
    RequestInfo,
    WorkerState,
    build_policy,
    decide,
    policy_names,
)

CAP = Capacity(block_size=16, num_gpu_blocks=1000, max_num_seqs=256, max_model_len=65536)


def ws(**per: dict) -> dict[str, WorkerState]:
    return {wid: WorkerState(wid, model="m", capacity=CAP, **kw) for wid, kw in per.items()}


def req(prompt: int, rid: str = "r") -> RequestInfo:
    return RequestInfo(rid, model="m", prompt_tokens=prompt, max_tokens=8)


def choose(name: str, workers: dict[str, WorkerState], r: RequestInfo, ov: dict[str, int], **p):
    pol = build_policy({"name": name, "params": p})
    return decide(pol, r, ClusterSnapshot(workers), ov).worker_id, pol


def test_peer_baselines_registered() -> None:
    assert {"sglang_cache_aware", "dynamo_kv", "llmd_default", "llmd_kv_util"} <= set(
        policy_names()
    )


# ---------------------------------------------------------------- sglang cache_aware


def test_sglang_cache_hit_above_threshold_goes_to_longest_match_despite_load() -> None:
    # prompt 160 tokens = 10 blocks; b holds 4 blocks = 64 tokens = 40% > 30%: b, although b
    # has 60 more in flight (60 <= 64: balanced by the absolute threshold)
    w = ws(a={"inflight": 0}, b={"inflight": 60})
    assert choose("sglang_cache_aware", w, req(160), {"b": 4})[0] == "b"


def test_sglang_match_below_threshold_goes_to_smallest_tree() -> None:
    # 2 of 10 blocks = 20% <= 30%: no cache path; tree sizes after two cold routed prompts
    w = ws(a={}, b={}, c={})
    pol = build_policy({"name": "sglang_cache_aware", "params": {}})
    snap = ClusterSnapshot(w)
    first = decide(pol, req(500, "r1"), snap, {}).worker_id  # all trees empty: any
    second = decide(pol, req(300, "r2"), snap, {}).worker_id  # not ``first`` (500 tokens)
    assert second != first
    # ``first`` has 500 tokens, ``second`` 300, the third worker 0: it gets a 20% match request
    third = ({"a", "b", "c"} - {first, second}).pop()
    assert decide(pol, req(160, "r3"), snap, {first: 2}).worker_id == third
    # it held nothing, so the whole prompt went into its tree; a matched prefix does not
    assert pol.state.extra["sglang_tree"].size[third] == 160
    assert decide(pol, req(160, "r4"), snap, {third: 10}).worker_id == third  # 100% > 30%
    assert pol.state.extra["sglang_tree"].size[third] == 160


def test_sglang_imbalance_needs_both_thresholds() -> None:
    # b holds the whole prompt; a has 0 in flight, b 65: 65 - 0 > 64 and 65 > 1.5 x 0 -> a
    w = ws(a={"inflight": 0}, b={"inflight": 65})
    assert choose("sglang_cache_aware", w, req(160), {"b": 10})[0] == "a"
    # 200 vs 135: difference 65 > 64 but 200 < 1.5 x 135 = 202.5 -> balanced -> cache -> b
    w = ws(a={"inflight": 135}, b={"inflight": 200})
    assert choose("sglang_cache_aware", w, req(160), {"b": 10})[0] == "b"


# ---------------------------------------------------------------- Dynamo KV cost


def test_dynamo_cost_trades_prefill_against_decode_blocks() -> None:
    # prompt 320 tokens = 20 blocks. a: holds 10 blocks, 100 used blocks, no queued prefill:
    #   prefill = (0 + 320 - 160) / 16 = 10, decode = 100 + 20 = 120 -> 130
    # b: holds nothing, 50 used blocks, 160 queued tokens:
    #   prefill = (160 + 320) / 16 = 30, decode = 50 + 20 = 70 -> 100  => b (weight 1)
    w = ws(
        a={"kv_blocks_free": 900},
        b={"kv_blocks_free": 950, "pending_prefill_tokens": 160},
    )
    wid, pol = choose("dynamo_kv", w, req(320), {"a": 10})
    assert wid == "b"
    d = decide(pol, req(320, "r2"), ClusterSnapshot(w), {"a": 10})
    assert d.scores == {"a": pytest.approx(130.0), "b": pytest.approx(100.0)}
    # weight 3: a = 30 + 120 = 150, b = 90 + 70 = 160 => a
    assert choose("dynamo_kv", w, req(320), {"a": 10}, overlap_score_weight=3.0)[0] == "a"


# ---------------------------------------------------------------- llm-d scorers


def test_llmd_default_prefix_x3_plus_queue_x2() -> None:
    # prompt 160 = 10 blocks. queues a=0, b=4, c=2 -> queue scores 1, 0, 0.5.
    # prefix: a 0, b 10/10 = 1, c 5/10 = 0.5.  a = 2, b = 3, c = 1.5 + 1 = 2.5 -> b
    w = ws(a={"waiting": 0}, b={"waiting": 4}, c={"waiting": 2})
    ov = {"b": 10, "c": 5}
    wid, pol = choose("llmd_default", w, req(160), ov)
    assert wid == "b"
    # queues 0, 8, 4 -> 1, 0, 0.5; prefix b 6/10, c 5/10: a = 2, b = 1.8, c = 2.5 -> c
    w = ws(a={"waiting": 0}, b={"waiting": 8}, c={"waiting": 4})
    assert choose("llmd_default", w, req(160), {"b": 6, "c": 5})[0] == "c"


def test_llmd_kv_util_adds_free_kv_scorer() -> None:
    # equal queues (queue score 1 each) and no prefix: only KV usage differs -> less used wins
    w = ws(a={"kv_blocks_free": 100}, b={"kv_blocks_free": 900})
    assert choose("llmd_kv_util", w, req(160), {})[0] == "b"
    # a holds 4/10 blocks: a = 1.2 + 2 + 2 x 0.1 = 3.4; b = 0 + 2 + 2 x 0.9 = 3.8 -> b
    assert choose("llmd_kv_util", w, req(160), {"a": 4})[0] == "b"
    # llmd_default ignores KV usage: a = 1.2 + 2 = 3.2 > b = 2 -> a
    assert choose("llmd_default", w, req(160), {"a": 4})[0] == "a"


def test_sglang_tree_is_built_from_routed_prompts_not_kv_events() -> None:
    # like sglang-router: a routed prompt is in its worker's tree at once, so the next request
    # sharing 4 of its 10 blocks (40% > 30%) follows it before any KV event (index empty)
    pol = build_policy({"name": "sglang_cache_aware", "params": {}})
    snap = ClusterSnapshot(ws(a={}, b={}, c={}))
    keys = tuple(range(100, 110))
    r1 = RequestInfo("r1", model="m", prompt_tokens=160, max_tokens=8, block_keys=keys)
    first = decide(pol, r1, snap, {}).worker_id
    r2 = RequestInfo(
        "r2",
        model="m",
        prompt_tokens=160,
        max_tokens=8,
        block_keys=keys[:4] + (7, 8, 9, 10, 11, 12),
    )
    assert decide(pol, r2, snap, {}).worker_id == first
    # 2 of 10 blocks (20%) is below the threshold: the smallest tree (an empty one) instead
    r3 = RequestInfo(
        "r3", model="m", prompt_tokens=160, max_tokens=8, block_keys=keys[:2] + tuple(range(8))
    )
    assert decide(pol, r3, snap, {}).worker_id != first


def test_llmd_approximate_prefix_follows_routed_prompts() -> None:
    keys = tuple(range(10))
    snap = ClusterSnapshot(ws(a={}, b={}, c={}))

    def r(rid: str) -> RequestInfo:
        return RequestInfo(rid, model="m", prompt_tokens=160, max_tokens=8, block_keys=keys)

    # approximate (default): the second request scores prefix 1.0 where the first went
    pol = build_policy({"name": "llmd_default", "params": {}})
    first = decide(pol, r("r1"), snap, {}).worker_id
    d = decide(pol, r("r2"), snap, {})
    assert d.worker_id == first and d.scores[first] == pytest.approx(-5.0)
    # precise: only the KV-event index counts, which holds nothing yet: all tie at -2
    pol = build_policy({"name": "llmd_default", "params": {"prefix_mode": "precise"}})
    decide(pol, r("r1"), snap, {})
    assert set(decide(pol, r("r2"), snap, {}).scores.values()) == {-2.0}
