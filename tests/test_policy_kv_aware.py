"""``kv_aware``'s hot-prefix rule: spread a prefix only when its holders are the bottleneck
(they carry more than their share of the traffic and are busier, or are overloaded), and then
at once; keep prefix groups on their holders otherwise. Pure core, no I/O."""

from __future__ import annotations

import random
from collections import Counter, deque

import pytest

from services.core.index import PrefixIndex
from services.core.keys import block_keys
from services.core.policy import (
    Capacity,
    ClusterSnapshot,
    RequestInfo,
    WorkerState,
    build_policy,
    decide,
)
from services.core.policy.demand import ColdEntry, Demand
from services.core.policy.prefill_clock import PrefillClock

CAP = Capacity(block_size=16, num_gpu_blocks=100_000, max_num_seqs=64, max_model_len=8192)


def workers(n: int) -> dict[str, WorkerState]:
    return {f"w{i}": WorkerState(f"w{i}", model="m", capacity=CAP) for i in range(n)}


def req(i: int = 0, tokens: int = 1024 + 64) -> RequestInfo:
    return RequestInfo(f"r{i}", "m", tokens, 16)


def test_one_hot_prefix_spreads_to_the_least_loaded_non_holder_at_once() -> None:
    ws = workers(8)
    p = build_policy({"name": "kv_aware"})
    ws["w0"].inflight = p.params["spread_margin"]  # busier than the idle rest, but only just
    for w in ("w1", "w2", "w3", "w4", "w5", "w6"):
        ws[w].inflight = 1
    # every recent request wanted w0's prefix: w0 carries all the traffic of its prefix
    d = decide(p, req(), ClusterSnapshot(ws), {"w0": 64})
    assert d.worker_id == "w7", d.scores  # the least-loaded non-holder takes it right away
    assert d.cached_tokens == 0  # it computes the prefix once and is a holder afterwards


def test_group_prefix_stays_on_its_holder_under_moderate_imbalance() -> None:
    """Many groups: each holder serves ~1/N of the traffic; a few more in flight than the least
    loaded is normal fluctuation and must not scatter the group (it would lose its hits)."""
    ws = workers(8)
    p = build_policy({"name": "kv_aware"})
    ids = sorted(ws)
    for i in range(64):  # 8 groups, one per worker, round the clock
        wid = ids[i % 8]
        decide(p, req(i), ClusterSnapshot(ws), {wid: 64})
    ws["w0"].inflight = p.params["overload_margin"] - 1  # busier, below the overload margin
    d = decide(p, req(99), ClusterSnapshot(ws), {"w0": 64})
    assert d.worker_id == "w0", d.scores
    assert d.cached_tokens == 1024


def test_overload_margin_spreads_any_prefix() -> None:
    ws = workers(8)
    p = build_policy({"name": "kv_aware"})
    ids = sorted(ws)
    for i in range(64):
        decide(p, req(i), ClusterSnapshot(ws), {ids[i % 8]: 64})
    ws["w0"].inflight = p.params["overload_margin"]
    d = decide(p, req(99), ClusterSnapshot(ws), {"w0": 64})
    assert d.worker_id != "w0", d.scores


def test_overload_needs_a_ratio_under_heavy_load() -> None:
    """At ~100 requests in flight per worker, 20 more on the holder is noise, not overload."""
    big = Capacity(block_size=16, num_gpu_blocks=100_000, max_num_seqs=256, max_model_len=8192)
    ws = {f"w{i}": WorkerState(f"w{i}", model="m", capacity=big) for i in range(8)}
    p = build_policy({"name": "kv_aware"})
    ids = sorted(ws)
    for i in range(64):
        decide(p, req(i), ClusterSnapshot(ws), {ids[i % 8]: 64})
    for w in ws.values():
        w.inflight = 90
    ws["w0"].inflight = 110
    d = decide(p, req(99), ClusterSnapshot(ws), {"w0": 64})
    assert d.worker_id == "w0", d.scores
    ws["w0"].inflight = 135  # 1.5x the least loaded: now it is overloaded
    d = decide(p, req(100), ClusterSnapshot(ws), {"w0": 64})
    assert d.worker_id != "w0", d.scores


def test_demand_window_matches_its_contents() -> None:
    rng = random.Random(5)
    dem = Demand(size=16)
    ids = [None, "a", "b", ("w0",), ("w0", "w1")]
    for _ in range(200):
        dem.add(rng.choice(ids))
        assert len(dem.window) <= 16
        expect = Counter(x for x in dem.window if x is not None)
        assert dem.count == dict(expect)
        for pid in ids[1:]:
            assert dem.fraction(pid) == pytest.approx(expect[pid] / len(dem.window))


def test_a_prefix_claims_the_cold_requests_that_created_it() -> None:
    rng = random.Random(7)
    dem = Demand(size=12)
    creators = [ColdEntry((1, 2, 3, 10 + i)) for i in range(3)]  # computed prefix (1, 2, 3)
    for _ in range(40):
        e = rng.choice([*creators, ColdEntry((5, 6)), ColdEntry((1, 9)), "x", None])
        dem.add(e)
    dem.claim(3, 3)  # prefix id = key of block 3
    creators_left = sum(1 for e in dem.window if e == 3)
    assert creators_left >= 1  # (the seed keeps some creators in the window)
    assert not any(isinstance(e, ColdEntry) and e.keys[2:3] == (3,) for e in dem.window)
    assert all(e.keys[:3] != (1, 2, 3) for e in dem.window if isinstance(e, ColdEntry))
    assert dem.count[3] == creators_left
    dem.claim(3, 3)  # a prefix claims once: already counted entries are not counted twice
    assert dem.count[3] == creators_left
    for _ in range(30):  # the count stays equal to the window's contents as entries leave
        dem.add(rng.choice([3, ColdEntry((1, 2, 3, 99)), None]))
        expect = Counter(x for x in dem.window if x is not None and not isinstance(x, ColdEntry))
        assert dem.count == dict(expect)


def test_demand_lower_bound_doubts_small_windows() -> None:
    dem = Demand(size=128)
    dem.add("p")
    dem.add("p")
    # two of two: at least ~2/3 of the traffic even at one standard deviation of doubt
    assert dem.fraction_low("p", 1.0) == pytest.approx(2 / 3)
    assert dem.fraction_low("p", 0.0) == dem.fraction("p") == 1.0
    dem = Demand(size=128)
    for i in range(19):  # one group's 4 of the first 19 requests of a 32-group workload
        dem.add("g" if i % 5 == 0 else f"other{i}")
    assert dem.fraction("g") * 8 - 0.5 > 1  # taken at face value: more than its one holder
    assert dem.fraction_low("g", 1.0) * 8 - 0.5 < 1  # doubted: not hot
    assert 0.0 <= dem.fraction_low("nobody", 1.0) < 0.1


def _keys(prefix: list[int], i: int) -> tuple[int, ...]:
    return tuple(block_keys(prefix + [i % 200 + 20] * 64, 16))


def test_a_hot_prefix_with_keys_spreads_to_every_worker() -> None:
    """One prefix is all the traffic: it deserves all N workers, so it keeps spreading while
    its holders are busier than the least loaded, until every worker holds it."""
    index = PrefixIndex()
    prefix = [9] * 1024
    ws = workers(8)
    p = build_policy({"name": "kv_aware", "params": {"routed_ttl": 0}})
    index.apply_stored("w0", block_keys(prefix, 16))
    for i in range(40):
        keys = _keys(prefix, i)
        r = RequestInfo(f"r{i}", "m", 1088, 16, keys)
        d = decide(p, r, ClusterSnapshot(ws), index.find_matches(keys))
        assert d.worker_id is not None
        ws[d.worker_id].inflight += 1  # nothing finishes: the holders stay the busier ones
        index.apply_stored(d.worker_id, keys)
    assert index.find_matches(_keys(prefix, 0)).keys() == set(ws)


def test_group_prefixes_with_keys_stay_on_their_holders() -> None:
    """With block keys each group is its own prefix: one of 8 groups carries 1/8 of the traffic,
    its fair share, so its holder keeps it though it has more in flight than the others."""
    ws = workers(8)
    p = build_policy({"name": "kv_aware"})
    ids = sorted(ws)
    groups = [[100 + g] * 1024 for g in range(8)]
    for i in range(64):
        keys = _keys(groups[i % 8], i)
        decide(p, RequestInfo(f"r{i}", "m", 1088, 16, keys), ClusterSnapshot(ws), {ids[i % 8]: 64})
    ws["w0"].inflight = p.params["overload_margin"] - 1
    keys = _keys(groups[0], 99)
    d = decide(p, RequestInfo("r99", "m", 1088, 16, keys), ClusterSnapshot(ws), {"w0": 64})
    assert d.worker_id == "w0", d.scores


def test_routed_memory_remembers_every_worker_a_prefix_was_sent_to() -> None:
    prefix = [5] * 1024
    ws = workers(4)
    p = build_policy({"name": "kv_aware"})
    sent = []
    for i in range(2):
        d = decide(
            p, RequestInfo(f"r{i}", "m", 1088, 16, _keys(prefix, i)), ClusterSnapshot(ws), {}
        )
        sent.append(d.worker_id)
        ws[d.worker_id].pending_prefill_tokens += 5000  # the next one goes elsewhere
    assert sent[0] != sent[1]
    d = decide(p, RequestInfo("r9", "m", 1088, 16, _keys(prefix, 9)), ClusterSnapshot(ws), {})
    # both were credited with the prefix: besides their queue, only the question is uncached
    for w in sent:
        assert d.scores[w] - 5000 < min(d.scores[x] for x in ws if x not in sent), d.scores


def _cold_vs_busy(now: float, clock: bool = True) -> str | None:
    """w0 holds a hot prefix but is overloaded; w1 is sent the prefix cold at t=10 (2112
    tokens). Before, the policy saw a 2112-token cold prefill on w1 take 2 s (t=0 to t=2).
    Which worker gets the next request of the hot prefix at ``now``?"""
    ws = workers(2)
    p = build_policy({"name": "kv_aware", "params": {"progress_slack": 1.0}})
    t = lambda x: x if clock else 0.0  # noqa: E731
    ws["w0"].inflight = 20
    r = RequestInfo("a", "m", 2112, 16, _keys([8] * 2048, 0))
    assert decide(p, r, ClusterSnapshot(ws, t(0.0)), {}).worker_id == "w1"
    ws["w1"].pending_prefill_tokens = 0  # its first token came at t=2
    ws["w1"].first_token_at = t(2.0)
    hot = [7] * 2048
    r = RequestInfo("b", "m", 2112, 16, _keys(hot, 1))
    d = decide(p, r, ClusterSnapshot(ws, t(10.0)), {"w0": 128})
    assert d.worker_id == "w1" and d.cached_tokens == 0  # overloaded holder: spread
    ws["w1"].pending_prefill_tokens = 2112
    ws["w1"].inflight = 1
    r = RequestInfo("c", "m", 2112, 16, _keys(hot, 2))
    return decide(p, r, ClusterSnapshot(ws, t(now)), {"w0": 128}).worker_id


def test_a_cold_prefill_nearly_done_takes_the_next_request_of_its_prefix() -> None:
    # just started: 2 s to go, the busy holder answers sooner
    assert _cold_vs_busy(10.1) == "w0"
    # 1.9 s in: w1 is about to hold the prefix and is idle otherwise
    assert _cold_vs_busy(11.9) == "w1"
    # without a clock nothing is known about its progress: the holder keeps it
    assert _cold_vs_busy(11.9, clock=False) == "w0"


def test_prefill_clock_learns_the_speed_from_first_tokens() -> None:
    c = PrefillClock(min_tokens=256, slack=1.0)
    w = WorkerState("w0", capacity=CAP)
    c.dispatched("w0", 1.0, 2000, 2000)
    w.pending_prefill_tokens = 2000
    c.observe(w, 1.5)
    assert c.spt is None and c.queued(w, 1.5) == 2000  # nothing learned yet: nothing done
    w.pending_prefill_tokens = 0
    w.first_token_at = 3.0  # 2 s for 2000 tokens, seen at the decision at t=4
    c.observe(w, 4.0)
    assert c.spt == pytest.approx(1e-3)
    assert not c.fifo["w0"]
    c.dispatched("w0", 10.0, 1000, 1000)
    w.pending_prefill_tokens = 1000
    assert c.queued(w, 10.0) == pytest.approx(1000)
    assert c.queued(w, 10.5) == pytest.approx(500)
    assert c.queued(w, 12.0) == 0
    # another router's queued prefill on the same worker is counted as it is
    w.pending_prefill_tokens = 1300
    assert c.queued(w, 10.5) == pytest.approx(800)
    # small batches (per-step overheads dominate) teach nothing
    small = PrefillClock(min_tokens=256)
    w.pending_prefill_tokens = 64
    small.dispatched("w0", 30.0, 64, 64)
    w.pending_prefill_tokens = 0
    w.first_token_at = 30.4
    small.observe(w, 31.0)
    assert small.spt is None and not small.fifo["w0"]


def _queued_by_entry(c: PrefillClock, w: WorkerState, now: float) -> float:
    """PrefillClock.queued written out entry by entry (the definition in its docstring)."""
    q = c.fifo.get(w.worker_id)
    if not q:
        return w.pending_prefill_tokens
    left = float(max(0, w.pending_prefill_tokens - sum(p for _, p, _ in q)))
    spt = c.spt * c.slack if c.discount and c.spt is not None else None
    free = c.last_done.get(w.worker_id, 0.0)
    for at, _, comp in q:
        if spt is None:
            left += comp
            continue
        start = max(at, free)
        end = start + comp * spt
        if now < end:
            left += comp if now <= start else comp * (end - now) / (end - start)
        free = end
    return left


@pytest.mark.parametrize("seed", range(6))
def test_prefill_clock_queued_equals_its_entry_by_entry_definition(seed: int) -> None:
    """Random dispatches, first tokens, other routers' load and FIFO overflow (MAX_ENTRIES):
    ``queued`` (a running sum where every entry counts in full) is the same float as adding
    up the entries, with and without a learned speed, discounting or not (slo_aware)."""
    rng = random.Random(seed)
    clocks = [PrefillClock(min_tokens=64, slack=1.5), PrefillClock(min_tokens=64, discount=False)]
    for c in clocks:
        c.MAX_ENTRIES = 40
    ws = [WorkerState(f"w{i}", capacity=CAP) for i in range(3)]
    other = {w.worker_id: 0 for w in ws}
    now = 0.0
    for _ in range(1500):
        now += rng.expovariate(200.0)
        w = rng.choice(ws)
        r = rng.random()
        for c in clocks:
            if r < 0.55:
                pend = rng.choice([0, rng.randint(1, 5000)])
                c.dispatched(w.worker_id, now, pend, rng.randint(0, pend))
            elif r < 0.85:  # some of this clock's oldest prefills are done
                q = c.fifo.get(w.worker_id)
                done = rng.randint(0, len(q)) if q else 0
                own = c.own.get(w.worker_id, 0)
                w.pending_prefill_tokens = own - sum(p for _, p, _ in list(q)[:done]) if q else 0
                w.pending_prefill_tokens += other[w.worker_id]
                w.first_token_at = now - rng.random() * 0.01
                c.observe(w, now)
            else:
                other[w.worker_id] = rng.choice([0, rng.randint(1, 3000)])
            w.pending_prefill_tokens = c.own.get(w.worker_id, 0) + other[w.worker_id]
            for x in ws:
                x.pending_prefill_tokens = c.own.get(x.worker_id, 0) + other[x.worker_id]
                assert c.queued(x, now) == _queued_by_entry(c, x, now)
                q = c.fifo.get(x.worker_id) or ()
                assert c.computing.get(x.worker_id, 0) == sum(comp for _, _, comp in q)
    assert clocks[0].spt is not None  # the learned-speed branch ran too


def test_ties_go_to_the_worker_whose_queued_prefill_is_oldest() -> None:
    ws = workers(2)
    p = build_policy({"name": "kv_aware"})
    ws["w0"].pending_prefill_tokens = 2000
    ws["w0"].inflight = 1
    assert decide(p, req(1), ClusterSnapshot(ws), {}).worker_id == "w1"
    ws["w1"].pending_prefill_tokens = 2000  # now both have the same queue; w0's is older
    ws["w1"].inflight = 1
    for i in range(5):  # deterministic, not a coin flip
        assert decide(p, req(2 + i), ClusterSnapshot(ws), {}).worker_id == "w0"


def _groups_run(spec: dict, groups: int = 16, steps: int = 300) -> tuple[Counter, float, float]:
    """Toy cluster (as in test_policy_hotspot) with ``groups`` shared prefixes drawn at random:
    returns (requests per worker, reuse of the shared prefixes, infinite-cache bound)."""
    bs, rate, decode, per_step = 16, 900, 12, 2
    rng = random.Random(11)
    prefixes = [[1000 + g] * 512 for g in range(groups)]  # 32 blocks each
    pol = build_policy(spec)
    index = PrefixIndex()
    ws = workers(8)
    prefill_q: dict[str, deque] = {w: deque() for w in ws}
    decoding: dict[str, list[int]] = {w: [] for w in ws}
    budget = dict.fromkeys(ws, 0.0)
    used: Counter = Counter()
    seen: set[int] = set()
    cached = shared = bound = 0
    rid = 0
    for step in range(steps):
        for _ in range(per_step):
            rid += 1
            g = rng.randrange(groups)
            tokens = prefixes[g] + [(rid * 31 + j) % 251 + 5000 for j in range(64)]
            keys = block_keys(tokens, bs)
            r = RequestInfo(f"r{rid}", "m", len(tokens), 16, tuple(keys))
            d = decide(pol, r, ClusterSnapshot(ws, now=float(step)), index.find_matches(keys))
            assert d.worker_id is not None
            used[d.worker_id] += 1
            cached += min(d.cached_tokens, 512)
            shared += 512
            bound += 512 if g in seen else 0
            seen.add(g)
            uncached = len(tokens) - d.cached_tokens
            prefill_q[d.worker_id].append((keys, uncached))
            ws[d.worker_id].inflight += 1
            ws[d.worker_id].pending_prefill_tokens += uncached
        for wid, w in ws.items():
            budget[wid] += rate
            q = prefill_q[wid]
            while q and budget[wid] >= q[0][1]:
                keys, uncached = q.popleft()
                budget[wid] -= uncached
                w.pending_prefill_tokens -= uncached
                index.apply_stored(wid, keys)
                decoding[wid].append(step + decode)
            if not q:
                budget[wid] = 0.0
            done = [t for t in decoding[wid] if t <= step]
            decoding[wid] = [t for t in decoding[wid] if t > step]
            w.inflight -= len(done)
    return used, cached / shared, bound / shared


def test_many_prefix_groups_keep_their_hits_and_use_every_worker() -> None:
    """16 groups of random popularity on 8 lightly loaded workers: no group carries more than
    its share, so groups stay on their holders (no copies: reuse near the bound). The workers
    then carry what their groups draw (two ~1/16 groups is a fair share, one is half): every
    worker is used and none carries more than 1.5x; balancing further would cost copies, which
    only pays once a holder is ``balance_margin`` requests busier than the least loaded and has
    at least a prefix of prefill queued."""
    used, reuse, bound = _groups_run({"name": "kv_aware"})
    assert len(used) == 8, used
    total = sum(used.values())
    assert min(used.values()) >= 0.25 * total / 8 and max(used.values()) <= 1.5 * total / 8, used
    assert reuse >= 0.98 * bound, (reuse, bound)
    # even at 2 requests of excess nothing is balanced: no holder's queued prefill here is ever
    # as long as a prefix (a copy would start later than the holder and lose the group's hits)
    used2, reuse2, _ = _groups_run({"name": "kv_aware", "params": {"balance_margin": 2}})
    assert (used2, reuse2) == (used, reuse)
    # the rule this replaced (spread whenever holders have 2 more in flight) scatters groups
    _, old_reuse, _ = _groups_run(
        {
            "name": "kv_aware",
            "params": {"hot_share": 0, "overload_margin": 2, "uncached_weight": 1},
        }
    )
    assert reuse > old_reuse, (reuse, old_reuse)


def test_a_busy_holder_keeps_a_group_while_it_has_less_than_a_prefix_to_prefill() -> None:
    """16 groups of 2048-token prefixes, 6 of them on w0: w0 draws 3x its fair share of the
    traffic (a busy holder) and has ``balance_margin`` more requests in flight than the least
    loaded. While its queued prefill is shorter than the prefix, the next request of one of its
    groups stays there (a copy would compute 2048 tokens instead of 64 and cost the group a
    prefix of hits); once it has a prefix's worth queued, the group is spread."""
    ws = workers(8)
    p = build_policy({"name": "kv_aware"})
    ids = sorted(ws)
    holder = [ids[0]] * 6 + [ids[1 + g % 7] for g in range(10)]
    prefixes = [[300 + g] * 2048 for g in range(16)]
    for i in range(p.params["demand_window"]):
        g = i % 16
        r = RequestInfo(f"r{i}", "m", 2112, 16, _keys(prefixes[g], i))
        assert decide(p, r, ClusterSnapshot(ws), {holder[g]: 128}).worker_id == holder[g]
    for w in ws.values():
        w.inflight = 1
    ws["w0"].inflight = 1 + p.params["balance_margin"]
    r = RequestInfo("x", "m", 2112, 16, _keys(prefixes[0], 150))
    d = decide(p, r, ClusterSnapshot(ws), {"w0": 128})
    assert d.worker_id == "w0" and d.cached_tokens == 2048, d.scores
    ws["w0"].pending_prefill_tokens = 2100  # now a copy starts no later than the holder's queue
    r = RequestInfo("y", "m", 2112, 16, _keys(prefixes[0], 151))
    d = decide(p, r, ClusterSnapshot(ws), {"w0": 128})
    assert d.worker_id != "w0" and d.cached_tokens == 0, d.scores


def test_routed_memory_sends_a_new_groups_second_request_after_its_first() -> None:
    """With block keys and ``routed_ttl``, the second request of a new prefix follows the first
    before the index knows (no KV events yet); without it, it goes to the least loaded."""
    prefix = [42] * 512
    keys1 = tuple(block_keys(prefix + [1] * 64, 16))
    keys2 = tuple(block_keys(prefix + [2] * 64, 16))
    r1 = RequestInfo("r1", "m", 576, 16, keys1)
    r2 = RequestInfo("r2", "m", 576, 16, keys2)
    for ttl, follows in ((256, True), (0, False)):
        ws = workers(4)
        p = build_policy({"name": "kv_aware", "params": {"routed_ttl": ttl}})
        first = decide(p, r1, ClusterSnapshot(ws), {}).worker_id
        assert first is not None
        ws[first].inflight += 1
        ws[first].pending_prefill_tokens += 576
        second = decide(p, r2, ClusterSnapshot(ws), {}).worker_id  # index: still empty
        assert (second == first) is follows, (ttl, first, second)
    # the memory outlives routed_ttl decisions while the prefill that computes the prefix there
    # is still queued (a burst of G groups sends a group's next request ~G decisions later);
    # once that prefill is done (and the index still does not show the prefix) it expires
    ws = workers(4)
    p = build_policy({"name": "kv_aware", "params": {"routed_ttl": 2}})
    first = decide(p, r1, ClusterSnapshot(ws), {}).worker_id
    ws[first].inflight += 1
    ws[first].pending_prefill_tokens += 576
    for i in range(3):
        decide(p, req(10 + i), ClusterSnapshot(ws), {})
    r2b = RequestInfo("r2b", "m", 576, 16, keys2)
    assert decide(p, r2b, ClusterSnapshot(ws), {}).worker_id == first  # still computing it
    ws = workers(4)
    p = build_policy({"name": "kv_aware", "params": {"routed_ttl": 2}})
    first = decide(p, r1, ClusterSnapshot(ws), {}).worker_id
    ws[first].inflight += 1
    ws[first].pending_prefill_tokens += 576
    decide(p, req(9), ClusterSnapshot(ws), {})
    ws[first].pending_prefill_tokens -= 576  # r1's first token: its prefill is done
    for i in range(3):
        decide(p, req(10 + i), ClusterSnapshot(ws), {})
    assert decide(p, r2, ClusterSnapshot(ws), {}).worker_id != first


def test_router_state_gives_the_policy_its_first_token_times() -> None:
    """The live router's half of the clock: ``first_token(ticket, now)`` records when the
    worker's prefill ended (once per request), and the pending prefill drops at that moment."""
    from services.common.schemas import WorkerCapacity, WorkerHeartbeat
    from services.core.cluster import ClusterState

    st = ClusterState()
    cap = WorkerCapacity(block_size=16, num_gpu_blocks=1000, max_num_seqs=8, max_model_len=4096)
    hb = WorkerHeartbeat(worker_id="w0", instance_id="i0", url="http://x", model="m", capacity=cap)
    st.on_heartbeat(hb, now=1.0)
    t = st.reserve("w0", prompt_tokens=512, max_tokens=16, cached_tokens=0, wall=1.0)
    w = st.states["w0"]
    assert w.pending_prefill_tokens == 512 and w.first_token_at is None
    st.first_token(t, 2.5)
    assert w.pending_prefill_tokens == 0 and w.first_token_at == 2.5
    st.first_token(t, 3.0)  # later chunks of the same stream change nothing
    assert w.first_token_at == 2.5
    st.release(t)
    assert w.inflight == 0 and w.first_token_at == 2.5


def _hot_cluster(**params) -> tuple[dict[str, WorkerState], PrefixIndex, list[int], object]:
    """8 workers; w0 holds a prefix (in the index) and is busier than the rest."""
    ws = workers(8)
    index = PrefixIndex()
    prefix = [11] * 1024
    index.apply_stored("w0", block_keys(prefix, 16))
    ws["w0"].inflight = 2
    params = {"replicate": True, **params}  # off by default; these tests are about it
    return ws, index, prefix, build_policy({"name": "kv_aware", "params": params})


def test_a_hot_prefix_is_copied_by_one_token_replicas_not_by_user_requests() -> None:
    ws, index, prefix, p = _hot_cluster()
    keys = _keys(prefix, 0)
    d = decide(
        p, RequestInfo("r0", "m", 1088, 16, keys), ClusterSnapshot(ws), index.find_matches(keys)
    )
    # all recent traffic wants this prefix: it deserves every worker, so the 7 others get a
    # copy now, and the user request stays where the prefix already is
    assert set(d.replicate_to) == set(ws) - {"w0"}
    assert d.worker_id == "w0" and d.cached_tokens == 1024
    for w in d.replicate_to:  # the caller counts the copies on their workers
        ws[w].inflight += 1
        ws[w].pending_prefill_tokens += 1088
    ws["w0"].inflight += 1
    keys = _keys(prefix, 1)
    d = decide(
        p, RequestInfo("r1", "m", 1088, 16, keys), ClusterSnapshot(ws), index.find_matches(keys)
    )
    assert d.replicate_to == ()  # the copies in flight count as holders: none twice


def test_without_replication_a_user_request_spreads_the_hot_prefix() -> None:
    ws, index, prefix, p = _hot_cluster(replicate=False)
    keys = _keys(prefix, 0)
    d = decide(
        p, RequestInfo("r0", "m", 1088, 16, keys), ClusterSnapshot(ws), index.find_matches(keys)
    )
    assert d.replicate_to == () and d.worker_id != "w0" and d.cached_tokens == 0


def test_the_request_that_created_a_prompt_counts_as_its_demand() -> None:
    """Seed 000's start: one request computes the system prompt on an idle cluster, the next
    request (the traffic starting) hits it. Both wanted the prompt, so it has all the demand
    and the 7 other workers get a copy at once; counted as no demand, the first request would
    make the prompt look wanted by half the traffic (4 workers' worth) and the copies trickle."""
    ws = workers(8)
    index = PrefixIndex()
    p = build_policy({"name": "kv_aware", "params": {"replicate": True}})
    prefix = [13] * 1024
    first = _keys(prefix, 0)
    d = decide(p, RequestInfo("r0", "m", 1088, 16, first), ClusterSnapshot(ws), {})
    assert d.replicate_to == ()
    index.apply_stored(d.worker_id, first)
    ws[d.worker_id].inflight = 1
    keys = _keys(prefix, 1)
    d2 = decide(
        p, RequestInfo("r1", "m", 1088, 16, keys), ClusterSnapshot(ws), index.find_matches(keys)
    )
    assert d2.worker_id == d.worker_id
    assert set(d2.replicate_to) == set(ws) - {d.worker_id}


def test_idle_holders_copy_nothing() -> None:
    """An idle cluster (e.g. a router that just restarted, its demand window empty) does not
    copy the first prefix it sees to every worker."""
    ws, index, prefix, p = _hot_cluster()
    ws["w0"].inflight = 0
    keys = _keys(prefix, 0)
    d = decide(
        p, RequestInfo("r0", "m", 1088, 16, keys), ClusterSnapshot(ws), index.find_matches(keys)
    )
    assert d.replicate_to == () and d.worker_id == "w0"


def _leader_and_followers(idle: bool, **params) -> list:
    """Two workers, both busy unless ``idle``; three requests for one new prefix in a row, each
    counted on its worker by the caller; the index never hears of the prefix."""
    ws = workers(2)
    ws["w0"].inflight = 0 if idle else 1
    ws["w1"].inflight = 4
    ws["w1"].pending_prefill_tokens = 9000
    p = build_policy({"name": "kv_aware", "params": params})
    out = []
    for i in range(3):
        r = RequestInfo(f"r{i}", "m", 2112, 16, _keys([3] * 2048, i))
        d = decide(p, r, ClusterSnapshot(ws), {})
        assert d.worker_id == "w0", d.scores
        ws["w0"].inflight += 1
        ws["w0"].pending_prefill_tokens += 2112 - d.cached_tokens
        out.append(d)
    return out


def test_followers_of_a_prefix_still_computing_wait_for_its_first_token() -> None:
    lead, f1, f2 = _leader_and_followers(idle=False)
    assert lead.after is None
    # both followers wait for the request that computes the prefix (not for each other)
    assert f1.after == "r0" and f2.after == "r0"
    assert f1.hold_s == f2.hold_s == 5.0


def test_no_hold_behind_a_leader_that_started_at_once_or_when_disabled() -> None:
    assert all(d.after is None for d in _leader_and_followers(idle=True))
    assert all(d.after is None for d in _leader_and_followers(idle=False, hold_followers=False))


def test_no_hold_once_the_index_shows_the_prefix() -> None:
    ws = workers(2)
    ws["w0"].inflight = 1
    ws["w1"].inflight = 4
    ws["w1"].pending_prefill_tokens = 9000
    p = build_policy({"name": "kv_aware"})
    d = decide(p, RequestInfo("r0", "m", 2112, 16, _keys([3] * 2048, 0)), ClusterSnapshot(ws), {})
    assert d.worker_id == "w0"
    # the leader's KV events arrived: the prefix is computed there
    d = decide(
        p, RequestInfo("r1", "m", 2112, 16, _keys([3] * 2048, 1)), ClusterSnapshot(ws), {"w0": 128}
    )
    assert d.worker_id == "w0" and d.after is None


def test_routed_memory_credits_each_candidate_its_deepest_fresh_prefix() -> None:
    """w0 was sent prefix P (64 blocks), w1 P + Q (128 blocks). A request for P + Q + R credits
    each with what it was sent (its deepest remembered block), also with w1 excluded; once
    ``routed_ttl`` decisions have passed, nobody is credited any more."""
    p_, q_, r_ = [11] * 1024, [12] * 1024, [13] * 512
    ws = workers(3)
    pol = build_policy({"name": "kv_aware", "params": {"routed_ttl": 8}})

    def send(rid: str, toks: list[int], loaded: dict[str, int]) -> str | None:
        for w in ws.values():
            w.inflight = loaded.get(w.worker_id, 0)
        k = tuple(block_keys(toks, 16))
        return decide(
            pol, RequestInfo(rid, "m", len(toks), 16, k), ClusterSnapshot(ws), {}
        ).worker_id

    assert send("a", p_, {"w1": 10, "w2": 10}) == "w0"
    assert send("b", p_ + q_, {"w0": 100, "w2": 10}) == "w1"
    for w in ws.values():
        w.inflight = 0
    keys = tuple(block_keys(p_ + q_ + r_, 16))
    r = RequestInfo("c", "m", 2560, 16, keys)
    d = decide(pol, r, ClusterSnapshot(ws), {})
    # equal load: the costs differ only by uncached_weight (2) x uncached tokens
    assert d.scores["w2"] - d.scores["w0"] == pytest.approx(2 * 1024)
    assert d.scores["w2"] - d.scores["w1"] == pytest.approx(2 * 2048)
    without_w1 = {k: v for k, v in ws.items() if k != "w1"}
    d = decide(pol, RequestInfo("d", "m", 2560, 16, keys), ClusterSnapshot(without_w1), {})
    assert d.scores["w2"] - d.scores["w0"] == pytest.approx(2 * 1024)
    for i in range(8):  # unrelated decisions: the memory above expires
        send(f"x{i}", [100 + i] * 64, {})
    for w in ws.values():
        w.inflight = 0
    d = decide(pol, RequestInfo("e", "m", 2560, 16, keys), ClusterSnapshot(ws), {})
    assert len({round(s, 6) for s in d.scores.values()}) == 1, d.scores
