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


def test_sglang_match_below_threshold_goes_to_least_loaded() -> None:
    # 2 of 10 blocks = 20% <= 30%: no cache path -> SMG's min_load_idx (load, processed, id):
    # b, the least loaded, though its tree is the largest (the older rule's smallest tree: a, c)
    pol = build_policy({"name": "sglang_cache_aware", "params": {}})
    first = RequestInfo(
        "r0", model="m", prompt_tokens=480, max_tokens=8, block_keys=tuple(range(30))
    )
    assert decide(pol, first, ClusterSnapshot(ws(b={})), {}).worker_id == "b"
    w = ws(a={"inflight": 2}, b={"inflight": 0}, c={"inflight": 1})
    assert decide(pol, req(160), ClusterSnapshot(w), {"a": 2}).worker_id == "b"


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


# ---------------------------------------------------------------- faithful to the sources
# sglang: lightseekorg/smg 73da68c model_gateway/src/policies/cache_aware.rs;
# llm-d: llm-d-inference-scheduler 520af47; Dynamo: lib/kv-router/src/scheduling/selector/default.rs


def keyed(rid: str, keys: tuple[int, ...], tokens: int | None = None) -> RequestInfo:
    n = 16 * len(keys) if tokens is None else tokens
    return RequestInfo(rid, model="m", prompt_tokens=n, max_tokens=8, block_keys=keys)


def test_sglang_cold_prompt_goes_to_least_loaded_not_smallest_tree() -> None:
    # a's tree holds 50 blocks, b's nothing; a has 0 in flight, b 3. SMG routes a prompt
    # without a match to the least loaded worker (a); the older rule took the smallest tree (b)
    pol = build_policy({"name": "sglang_cache_aware", "params": {}})
    assert (
        decide(pol, keyed("r1", tuple(range(50))), ClusterSnapshot(ws(a={})), {}).worker_id == "a"
    )
    snap = ClusterSnapshot(ws(a={"inflight": 0}, b={"inflight": 3}))
    assert decide(pol, keyed("r2", tuple(range(100, 110))), snap, {}).worker_id == "a"


def test_sglang_least_load_ties_go_to_fewest_processed_then_first_id() -> None:
    # equal loads: SMG's key (load, processed, index) deals cold prompts out in turn,
    # whatever their sizes (no random draw, no tree size)
    pol = build_policy({"name": "sglang_cache_aware", "params": {}})
    snap = ClusterSnapshot(ws(c={}, a={}, b={}))
    sizes = (30, 6, 6, 6, 30)
    got = [
        decide(pol, keyed(f"r{i}", tuple(range(1000 * i, 1000 * i + n))), snap, {}).worker_id
        for i, n in enumerate(sizes)
    ]
    assert got == ["a", "b", "c", "a", "b"]


def test_sglang_cache_hit_goes_to_the_creator_of_the_deepest_position() -> None:
    # b, then a, routed the same 10 blocks; the next such prompt goes to b (the node's
    # last_tenant, its creator) for every seed, not to a random one of the equally deep holders
    keys = tuple(range(10))
    for seed in range(8):
        pol = build_policy({"name": "sglang_cache_aware", "params": {"seed": seed}})
        decide(pol, keyed("r1", keys), ClusterSnapshot(ws(b={})), {})
        decide(pol, keyed("r2", keys), ClusterSnapshot(ws(a={})), {})
        both = ClusterSnapshot(ws(a={}, b={}))
        assert decide(pol, keyed("r3", keys), both, {}).worker_id == "b"


def test_llmd_exact_ties_spread_over_every_worker_reproducibly() -> None:
    # llm-d's max-score picker shuffles before a stable sort: exact ties go to a random one.
    # Equal queues, no prefix: every worker ties; 64 picks reach all 8, the same per seed
    snap = ClusterSnapshot(ws(**{f"w{i}": {} for i in range(8)}))

    def picks(name: str, seed: int) -> list[str]:
        pol = build_policy({"name": name, "params": {"seed": seed}})
        return [decide(pol, req(160, f"r{i}"), snap, {}).worker_id for i in range(64)]

    for name in ("llmd_default", "llmd_kv_util"):
        first = picks(name, 0)
        assert len(set(first)) == 8
        assert picks(name, 0) == first
        assert picks(name, 1) != first


def test_llmd_prefix_scores_at_most_256_leading_blocks() -> None:
    # maxPrefixBlocksToMatch = 256: a 1000-block prompt whose first 256 blocks were routed to a
    # scores prefix 256/256 = 1 there (3 + queue 2 = 5), not 256/1000
    pol = build_policy({"name": "llmd_default", "params": {}})
    cap = Capacity(block_size=16, num_gpu_blocks=100_000, max_num_seqs=256, max_model_len=65536)
    big = {w: WorkerState(w, model="m", capacity=cap) for w in ("a", "b")}
    head = tuple(range(256))
    decide(pol, keyed("r1", head), ClusterSnapshot({"a": big["a"]}), {})
    d = decide(pol, keyed("r2", head + tuple(range(5000, 5744))), ClusterSnapshot(big), {})
    assert d.worker_id == "a" and d.scores["a"] == pytest.approx(-5.0)


def test_llmd_approximate_view_forgets_beyond_the_pods_kv_blocks() -> None:
    # per-pod LRU sized by the pod's KV blocks (autoTune): a holds 20 blocks; after a 10-block
    # and a 15-block prompt, the first prompt's leading blocks are gone, so it scores no prefix
    small = Capacity(block_size=16, num_gpu_blocks=20, max_num_seqs=256, max_model_len=4096)
    a = WorkerState("a", model="m", capacity=small)
    b = WorkerState("b", model="m", capacity=small)
    pol = build_policy({"name": "llmd_default", "params": {}})
    first = tuple(range(10))
    decide(pol, keyed("r1", first), ClusterSnapshot({"a": a}), {})
    decide(pol, keyed("r2", tuple(range(100, 115))), ClusterSnapshot({"a": a}), {})
    d = decide(pol, keyed("r3", first), ClusterSnapshot({"a": a, "b": b}), {})
    assert d.scores == {"a": pytest.approx(-2.0), "b": pytest.approx(-2.0)}
    # a set capacity applies instead
    pol = build_policy({"name": "llmd_default", "params": {"lru_capacity_per_server": 100}})
    decide(pol, keyed("r1", first), ClusterSnapshot({"a": a}), {})
    decide(pol, keyed("r2", tuple(range(100, 115))), ClusterSnapshot({"a": a}), {})
    assert decide(pol, keyed("r3", first), ClusterSnapshot({"a": a, "b": b}), {}).worker_id == "a"


def test_dynamo_zero_temperature_ties_spread_over_every_worker() -> None:
    snap = ClusterSnapshot(ws(**{f"w{i}": {} for i in range(8)}))
    pol = build_policy({"name": "dynamo_kv", "params": {}})
    assert len({decide(pol, req(160, f"r{i}"), snap, {}).worker_id for i in range(64)}) == 8


def test_dynamo_router_temperature_samples_softmax_of_range_normalised_costs() -> None:
    # costs a = 130, b = 100 (the trade test above): at temperature 1 Dynamo samples b with
    # p = 1 / (1 + e^-1) = 0.731 (costs divided by their range); seeded, so reproducible
    w = ws(
        a={"kv_blocks_free": 900},
        b={"kv_blocks_free": 950, "pending_prefill_tokens": 160},
    )
    snap = ClusterSnapshot(w)

    def picks(seed: int) -> list[str]:
        pol = build_policy(
            {"name": "dynamo_kv", "params": {"router_temperature": 1.0, "seed": seed}}
        )
        return [decide(pol, req(320, f"r{i}"), snap, {"a": 10}).worker_id for i in range(4000)]

    got = picks(0)
    assert got.count("b") / len(got) == pytest.approx(0.731, abs=0.02)
    assert picks(0) == got


def test_pod_lru_prefix_index_refreshes_evicts_and_forgets_pods() -> None:
    from services.core.policy.pod_lru_prefix import PodLruPrefixIndex

    idx = PodLruPrefixIndex()
    idx.add("a", (1, 2, 3), capacity=3)
    idx.add("b", (1, 2), capacity=10)
    idx.add("a", (1,), capacity=99)  # 1 becomes a's newest; the capacity stays 3
    idx.add("a", (4,), capacity=3)  # evicts a's oldest: 2
    # matchLongestPrefix counts, per hash, every pod that holds it (not a per-pod run):
    # 1 -> a, b; 2 -> b; 3 -> a
    assert idx.match((1, 2, 3)) == {"a": 2, "b": 2}
    assert idx.pods[2] == {"b"} and list(idx.lru["a"]) == [3, 1, 4]
    idx.remove_pod("b")
    assert idx.match((1, 2)) == {"a": 1} and 2 not in idx.pods
