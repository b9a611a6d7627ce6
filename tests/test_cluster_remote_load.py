"""Other routers' counts in the cluster state: after any sequence of their messages and of
their expiry, every worker's ``inflight`` / ``pending_prefill_tokens`` equal this router's own
plus the sum of the live routers' last messages (the state keeps running sums and refreshes
only the workers a message changed), and a worker whose load changed is announced to the
policies' incremental views."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.schemas import WorkerCapacity, WorkerHeartbeat
from services.core.cluster import ClusterState

WIDS = [f"w{i}" for i in range(6)]
CAP = WorkerCapacity(block_size=16, num_gpu_blocks=1000, max_num_seqs=64, max_model_len=4096)


def _state() -> ClusterState:
    cs = ClusterState(remote_ttl_s=3.0, worker_timeout=1e9)
    for w in WIDS:
        cs.on_heartbeat(
            WorkerHeartbeat(worker_id=w, instance_id="i", url="http://x", model="m", capacity=CAP),
            0.0,
        )
    return cs


counts = st.dictionaries(st.sampled_from(WIDS), st.integers(1, 9), max_size=len(WIDS))
step = st.one_of(
    st.tuples(st.just("msg"), st.sampled_from(["ra", "rb", "rc"]), counts, counts),
    st.tuples(st.just("tick"), st.floats(0.5, 4.0)),  # time passes; routers may expire
    st.tuples(st.just("local"), st.sampled_from(WIDS), st.integers(0, 3)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(step, max_size=40))
def test_worker_load_is_own_plus_live_routers_last_counts(steps) -> None:
    cs = _state()
    seen: set[str] = set()
    cs.snapshot.watchers.append(seen)
    last: dict[str, tuple[float, dict[str, int], dict[str, int]]] = {}
    local_tickets: list = []
    now = 0.0
    for s in steps:
        before = {w: (cs.states[w].inflight, cs.states[w].pending_prefill_tokens) for w in WIDS}
        seen.clear()
        if s[0] == "msg":
            _, rid, inflight, prefill = s
            cs.on_router_load(rid, inflight, prefill, now)
            last[rid] = (now, dict(inflight), dict(prefill))
        elif s[0] == "tick":
            now += s[1]
            cs.sweep(now)
            last = {r: v for r, v in last.items() if now - v[0] <= cs.remote_ttl_s}
        else:
            _, wid, n = s
            for _ in range(n):
                local_tickets.append(cs.reserve(wid, 100, 10, 0, now))
            if n == 0 and local_tickets:  # the oldest of this router's requests ends
                cs.release(local_tickets.pop(0))
        assert set(cs.remote_routers) == set(last)
        for w in WIDS:
            own_in = sum(1 for t in local_tickets if t.worker_id == w)
            own_pre = sum(t.prefill for t in local_tickets if t.worker_id == w)
            want_in = own_in + sum(v[1].get(w, 0) for v in last.values())
            want_pre = own_pre + sum(v[2].get(w, 0) for v in last.values())
            got = (cs.states[w].inflight, cs.states[w].pending_prefill_tokens)
            assert got == (want_in, want_pre), (w, s)
            if got != before[w]:
                assert w in seen, (w, s)  # the policies' views hear of it


def test_a_message_with_nothing_new_refreshes_no_worker() -> None:
    cs = _state()
    cs.on_router_load("ra", {"w0": 2, "w1": 1}, {"w0": 300}, 0.0)
    seen: set[str] = set()
    cs.snapshot.watchers.append(seen)
    cs.on_router_load("ra", {"w0": 2, "w1": 1}, {"w0": 300}, 0.1)
    assert not seen
    cs.on_router_load("ra", {"w0": 2}, {"w0": 300}, 0.2)  # w1's request ended there
    assert seen == {"w1"} and cs.states["w1"].inflight == 0


def test_the_bench_reference_and_the_state_agree() -> None:
    """``bench.load_share_cost`` times the state against its reference: same messages, same
    loads (and it runs)."""
    from bench.load_share_cost import ReferenceState, main, messages

    msgs = messages(50, 3, 60, seed=1)
    states = []
    for cls in (ClusterState, ReferenceState):
        cs = cls()
        for i in range(50):
            hb = WorkerHeartbeat(
                worker_id=f"w{i:05d}", instance_id="i", url="http://w", model="m", capacity=CAP
            )
            cs.on_heartbeat(hb, 0.0)
        for rid, inflight, prefill in msgs:
            cs.on_router_load(rid, inflight, prefill, 0.0)
        states.append({w: (s.inflight, s.pending_prefill_tokens) for w, s in cs.states.items()})
    assert states[0] == states[1] and any(v != (0, 0) for v in states[0].values())
    assert main(["--workers", "20", "--routers", "2", "--messages", "20", "--runs", "1"]) == 0
