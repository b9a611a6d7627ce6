"""``kv_aware``'s conversation term (``conversation_weight``): a request that starts a new
prefix pays, per later turn it can be expected to bring (``s / (1 - s)`` for the window's share
``s`` of next turns), for each worker's recent prompt work, a next turn's counted in full and a
start's x ``s`` (services/core/policy/recent_work.py). Worked by hand."""

from __future__ import annotations

import pytest

from services.core.policy import (
    Capacity,
    ClusterSnapshot,
    RequestInfo,
    WorkerState,
    build_policy,
    decide,
)
from services.core.policy.recent_work import MAX_TURNS_AHEAD, RecentWork

BS = 16
CAP = Capacity(block_size=BS, num_gpu_blocks=100_000, max_num_seqs=256, max_model_len=65536)
# the plain cost without terms that would move between decisions: only the queue (none here),
# the uncached prompt (x1) and the tie-break by queue age
PLAIN = {"uncached_weight": 1.0, "decode_weight": 0.0, "kv_pressure_weight": 0.0}
PLAIN |= {"stall_tpot_weight": 0.0, "routed_ttl": 0}


def _snap(now: float, w1_queued: int = 0) -> ClusterSnapshot:
    w0 = WorkerState("w0", model="m", capacity=CAP)
    w1 = WorkerState("w1", model="m", capacity=CAP, pending_prefill_tokens=w1_queued)
    return ClusterSnapshot({"w0": w0, "w1": w1}, now=now)


def test_recent_work_counts_a_start_by_the_share_of_next_turns_and_forgets_after_the_window():
    rw = RecentWork(10.0)
    rw.record(0.0, "w0", 3000, continued=False)  # the window's first request: share 0
    assert rw.work.get("w0", 0.0) == 0.0
    rw.record(1.0, "w0", 1000, continued=True)
    rw.record(2.0, "w1", 1000, continued=True)
    assert rw.continued_share() == pytest.approx(2 / 3)
    rw.record(3.0, "w1", 3000, continued=False)  # x 2/3
    assert rw.work == pytest.approx({"w0": 1000.0, "w1": 3000.0})
    rw.expire(11.5)  # the entries of t = 0 and 1 leave
    assert rw.work == pytest.approx({"w1": 3000.0})
    assert (rw.starts, rw.continued) == (1, 1)
    rw.expire(14.0)
    assert rw.work == {} and (rw.starts, rw.continued) == (0, 0)


def test_turns_ahead_is_the_geometric_count_of_later_requests():
    rw = RecentWork(10.0)
    assert rw.turns_ahead() == 0.0  # nothing seen: no conversation expected
    rw.record(0.0, "w0", 100, continued=False)
    assert rw.turns_ahead() == 0.0  # starts only: nothing comes back
    rw.record(0.0, "w0", 100, continued=True)
    rw.record(0.0, "w0", 100, continued=True)
    assert rw.turns_ahead() == pytest.approx(2.0)  # s = 2/3: s / (1 - s)
    rw.expire(10.5)
    rw.record(11.0, "w0", 100, continued=True)
    assert rw.turns_ahead() == MAX_TURNS_AHEAD  # continuations only: bounded


def test_a_new_conversation_goes_where_fewer_conversations_are_between_turns():
    # w0 idle, w1 with 100 prompt tokens queued. A conversation starts (to w0, the cheaper,
    # the window empty), then w0 serves two next turns (1,000 uncached tokens each, continuing
    # prefixes only it holds); then a new conversation starts (3,000 tokens, no holder). The
    # window: 1 start, 2 continuations (s = 2/3, 2 turns ahead), w0's recent work 2,000 (the
    # start counted x 0, the share when it came). Without the term the new one goes to w0 (100
    # tokens cheaper); with conversation_weight 0.25 it pays 0.25 x 2 x 2,000 on w0 and goes
    # to w1 (900 cheaper)
    def run(weight: float) -> tuple[str, dict[str, float]]:
        pol = build_policy({"name": "kv_aware", "params": {**PLAIN, "conversation_weight": weight}})
        first = decide(pol, RequestInfo("c0", "m", 3000, 20), _snap(0.5, 100), {"w0": 0, "w1": 0})
        assert first.worker_id == "w0"
        for i, t in enumerate((1.0, 2.0)):
            d = decide(
                pol,
                RequestInfo(f"turn{i}", "m", 1000 + 64 * BS, 20),
                _snap(t, 100),
                {"w0": 64, "w1": 0},
            )
            assert d.worker_id == "w0"
        d = decide(pol, RequestInfo("new", "m", 3000, 20), _snap(3.0, 100), {"w0": 0, "w1": 0})
        return d.worker_id, d.scores

    # (abs 0.5: the tie-break by queue age moves a cost by at most 0.1)
    wid, scores = run(0.0)
    assert wid == "w0" and scores["w1"] - scores["w0"] == pytest.approx(100.0, abs=0.5)
    wid, scores = run(0.25)
    assert wid == "w1"
    assert scores["w0"] - scores["w1"] == pytest.approx(0.25 * 2 * 2000.0 - 100.0, abs=0.5)


def test_a_next_turn_pays_nothing_and_old_work_is_forgotten():
    pol = build_policy({"name": "kv_aware", "params": {**PLAIN, "conversation_weight": 1.0}})
    decide(pol, RequestInfo("t", "m", 1000 + 64 * BS, 20), _snap(0.0), {"w0": 64, "w1": 0})
    # a next turn of w0's conversation: its own prefix decides, the recent work is not charged
    d = decide(pol, RequestInfo("t2", "m", 1000 + 64 * BS, 20), _snap(1.0), {"w0": 64, "w1": 0})
    assert d.worker_id == "w0"
    assert d.scores["w1"] - d.scores["w0"] == pytest.approx(64 * BS, abs=0.5)  # its prefix
    # a new conversation 10 s later (the window): w0's two turns are forgotten, a tie again
    d = decide(pol, RequestInfo("new", "m", 3000, 20), _snap(11.5), {"w0": 0, "w1": 0})
    assert d.scores["w0"] == pytest.approx(d.scores["w1"], abs=0.5)


def test_without_reuse_every_request_is_a_start_and_nothing_is_charged():
    # a fleet whose prompts never come back (every request a start: share 0) routes as
    # without the term, by the queue alone
    pol = build_policy({"name": "kv_aware", "params": {**PLAIN, "conversation_weight": 1.0}})
    for i in range(6):
        d = decide(pol, RequestInfo(f"r{i}", "m", 3000, 20), _snap(float(i)), {"w0": 0, "w1": 0})
        assert d.scores["w0"] == pytest.approx(d.scores["w1"], abs=0.5)


def test_slo_aware_refuses_the_conversation_term():
    from services.core.policy import PolicyError

    for k in ("conversation_weight", "conversation_window_s"):
        with pytest.raises(PolicyError, match=k):
            build_policy({"name": "slo_aware", "params": {k: 1.0}})


def test_without_a_clock_the_term_is_off():
    # a snapshot without a clock (now always 0) has no window to count recent work in: the
    # next turns leave nothing behind and the new conversation is priced as without the term
    pol = build_policy({"name": "kv_aware", "params": {**PLAIN, "conversation_weight": 1.0}})
    decide(pol, RequestInfo("c0", "m", 3000, 20), _snap(0.0), {"w0": 0, "w1": 0})
    for i in range(3):
        decide(pol, RequestInfo(f"t{i}", "m", 1000 + 64 * BS, 20), _snap(0.0), {"w0": 64, "w1": 0})
    d = decide(pol, RequestInfo("new", "m", 3000, 20), _snap(0.0), {"w0": 0, "w1": 0})
    assert d.scores["w0"] == pytest.approx(d.scores["w1"], abs=0.5)
    assert "kv_aware_recent" not in pol.state.extra
