"""The pure flow-control core (services/core/flow), worked out by hand."""

from __future__ import annotations

from services.common.tenancy import Priority, RequestTenancy, TenantQuota
from services.core.flow import FlowQueue, QuotaBook, Verdict, VirtualCounters, on_arrival, verdict

C, S, X = Priority.CRITICAL, Priority.STANDARD, Priority.SHEDDABLE


def ten(flow: str, prio: Priority = S, weight: float = 1.0) -> RequestTenancy:
    return RequestTenancy(flow, prio, weight)


def drain(q: FlowQueue, c: VirtualCounters, tenancy: dict[str, RequestTenancy], cost: int):
    """Serve the queue to the end, charging ``cost`` prompt tokens per request."""
    order = []
    while q:
        e = q.head()
        q.leave(e)
        t = tenancy[e]
        c.dispatched(t.flow, t.weight, cost)
        order.append(e)
    return order


def test_counters_charge_weighted_input_and_output() -> None:
    c = VirtualCounters()  # input 1, output 2 per token
    c.dispatched("a", 2.0, 100)  # 100 / 2
    assert c.get("a") == 50 and c.last == 50
    c.completed("a", 2.0, 30)  # + 2 * 30 / 2
    assert c.get("a") == 80 and c.last == 50  # the lift floor moves on dispatch only
    c.lift("b", None)  # nobody backlogged: lifted to the last dispatched flow's counter
    assert c.get("b") == 50
    c.lift("a", 10.0)  # never lowered
    assert c.get("a") == 80


def test_bands_first_then_fifo() -> None:
    c = VirtualCounters()
    q: FlowQueue[str] = FlowQueue(c, 10, 30.0)
    tn = {"s1": ten("a", S), "c1": ten("a", C), "s2": ten("a", S), "c2": ten("b", C)}
    for i, (e, t) in enumerate(tn.items()):
        assert q.join(e, t, float(i)).ok
    assert q.head() == "c1" and q.ahead(C.rank) and q.ahead(S.rank)
    # critical first (a then b: equal counters, a's request came first), then standard, FIFO
    assert drain(q, c, tn, 10) == ["c1", "c2", "s1", "s2"]


def test_fair_order_by_weighted_counter() -> None:
    # a (weight 1) has 4 queued, b (weight 3) has 4 queued, each request 30 prompt tokens.
    # charges: a +30 per request, b +10. Ties go to the flow whose head came first.
    c = VirtualCounters()
    q: FlowQueue[str] = FlowQueue(c, 100, 30.0)
    tn = {}
    for i in range(4):
        tn[f"a{i}"] = ten("a", S, 1.0)
        tn[f"b{i}"] = ten("b", S, 3.0)
    for i, e in enumerate(sorted(tn, key=lambda e: (e[1], e[0]))):  # a0 b0 a1 b1 ...
        q.join(e, tn[e], float(i))
    # a0 (a=30); b0 (b=10); b1 (b=20); b2 (b=30); a vs b tie at 30: a's head a1 came first
    # -> a1 (a=60); b3 (b=40); then a2, a3
    assert drain(q, c, tn, 30) == ["a0", "b0", "b1", "b2", "a1", "b3", "a2", "a3"]


def test_newly_backlogged_flow_is_lifted_not_credited() -> None:
    c = VirtualCounters()
    q: FlowQueue[str] = FlowQueue(c, 100, 30.0)
    tn = {f"h{i}": ten("heavy") for i in range(5)}
    for i in range(5):
        q.join(f"h{i}", tn[f"h{i}"], float(i))
    for _ in range(3):  # heavy served alone: its counter reaches 300
        e = q.head()
        q.leave(e)
        c.dispatched("heavy", 1.0, 100)
    # light was idle all along (counter 0): it joins at heavy's 300, not at 0; so it is
    # served next (tie, then ...) but does not get three requests in a row
    tn["l0"], tn["l1"] = ten("light"), ten("light")
    q.join("l0", tn["l0"], 10.0)
    q.join("l1", tn["l1"], 11.0)
    assert c.get("light") == 300
    # heavy's head (h3, seq 4) came before light's (l0, seq 6): heavy first at the tie
    assert drain(q, c, tn, 100) == ["h3", "l0", "h4", "l1"]


def test_full_queue_bumps_the_youngest_lower_band() -> None:
    c = VirtualCounters()
    q: FlowQueue[str] = FlowQueue(c, 2, 30.0)
    assert q.join("s1", ten("a", S), 0.0).ok
    assert q.join("s2", ten("b", S), 1.0).ok
    assert not q.join("s3", ten("a", S), 2.0).ok  # same band: refused
    j = q.join("c1", ten("a", C), 3.0)
    assert j.ok and j.bumped == "s2" and "s2" not in q and len(q) == 2
    assert q.join("c2", ten("a", C), 4.0).bumped == "s1"
    assert not q.join("c3", ten("a", C), 5.0).ok


def test_timeouts_and_leave_anywhere() -> None:
    c = VirtualCounters()
    q: FlowQueue[str] = FlowQueue(c, 10, 2.0)
    q.join("x", ten("a"), 1.0)
    q.join("y", ten("a"), 2.0)
    assert q.left_s("y", 3.5) == 0.5 and not q.expired("x", 3.0) and q.expired("x", 3.1)
    q.leave("y")  # not the head: removed from the middle
    q.leave("y")  # twice: no-op
    assert len(q) == 1 and q.head() == "x"
    q.leave("x")
    assert not q and q.head() is None and q.floor() is None


def test_verdicts() -> None:
    c = VirtualCounters()
    q: FlowQueue[str] = FlowQueue(c, 10, 30.0)
    # nothing waits: everyone asks the policy
    assert {on_arrival(p, q) for p in Priority} == {Verdict.DECIDE}
    q.join("s", ten("a", S), 0.0)
    assert on_arrival(C, q) is Verdict.DECIDE  # only lower bands wait
    assert on_arrival(S, q) is Verdict.QUEUE
    assert on_arrival(X, q) is Verdict.SHED  # saturated: sheddable never waits
    # the decision named no worker: at capacity (shed=False) or the SLO cannot be met (True)
    assert verdict(X, False) is Verdict.SHED and verdict(X, True) is Verdict.SHED
    assert verdict(S, False) is Verdict.QUEUE and verdict(S, True) is Verdict.SHED
    assert verdict(C, False) is Verdict.QUEUE and verdict(C, True) is Verdict.QUEUE


def test_forget_keeps_the_lift_equivalent() -> None:
    c = VirtualCounters()
    c.dispatched("a", 1.0, 10)
    c.dispatched("b", 1.0, 50)  # last = 50
    assert c.forget(None, keep={"b"}) == 1 and "a" not in c.counters
    c.lift("a", None)
    assert c.get("a") == 50  # what it would have been lifted to anyway


def test_quota_limits_summed_over_replicas() -> None:
    b = QuotaBook(span_s=60.0, bucket_s=1.0)
    q = TenantQuota(requests_per_min=5, input_tokens_per_min=1000, concurrent_requests=3)
    assert b.check("t", q, 400, 0.0) is None
    b.admitted("t", 400, 0.0)
    b.admitted("t", 400, 10.0)
    r = b.check("t", q, 300, 20.0)  # 800 + 300 > 1000
    assert r is not None and r.limit == "input_tokens_per_min"
    # 100 over of 800 used: the first bucket ([0, 1) s, 400) is forgotten at 61 s -> 41 s
    assert r.retry_after_s == 41
    assert b.check("t", q, 200, 20.0) is None
    # another router reports 150 input tokens and 1 in flight for t
    b.on_peer("r2", {"t": [1, 150, 0, 1]}, 21.0)
    assert b.usage("t", 21.0).input_tokens == 950 and b.usage("t", 21.0).concurrent == 3
    r = b.check("t", q, 10, 21.0)
    assert r is not None and r.limit == "concurrent_requests" and r.retry_after_s == 1
    b.ended("t", 7, 22.0)
    assert b.check("t", q, 51, 22.0).limit == "input_tokens_per_min"  # 950 + 51 > 1000
    b.admitted("t", 25, 22.0)
    b.on_peer("r2", {"t": [1, 150, 0, 0]}, 22.5)  # heard again: 975 known
    b.ended("t", 0, 23.0)
    assert b.report(23.0) == {"t": [3, 825, 7, 1]}
    # the first request's bucket ages out at 60 s; a silent peer is forgotten after its ttl
    assert b.usage("t", 32.5).input_tokens == 825 + 150
    assert b.usage("t", 33.0).input_tokens == 825  # r2 last heard at 22.5, ttl 10 s: gone
    assert b.usage("t", 60.5).input_tokens == 825  # kept until its last instant is 60 s old
    assert b.usage("t", 61.0).input_tokens == 425
    assert b.check("x", TenantQuota(), 10**9, 0.0) is None  # unlimited


def test_quota_headroom_is_split_until_the_others_are_heard() -> None:
    b = QuotaBook()
    q = TenantQuota(input_tokens_per_min=1000)
    b.on_peer("r2", {"t": [1, 400, 0, 0]}, 0.0)
    b.on_peer("r3", {"t": [1, 300, 0, 0]}, 0.0)
    # 300 left, 3 routers: this one's first request may take it all (nothing admitted since
    # it heard the others) ...
    assert b.check("t", q, 300, 1.0) is None
    b.admitted("t", 60, 1.0)
    # ... after that, at most 1/3 of the 300 it knew of until it hears one of them again
    assert b.check("t", q, 40, 1.0) is None  # 60 + 40 <= 100
    r = b.check("t", q, 41, 1.0)
    assert r is not None and r.retry_after_s == 1 and "1/3 of the 300 left" in r.message
    # r2 took 80 meanwhile: 60 + 480 + 300 = 840 known, 160 left
    b.on_peer("r2", {"t": [2, 480, 0, 0]}, 1.5)
    assert b.check("t", q, 160, 1.5) is None and b.check("t", q, 161, 1.5).limit == (
        "input_tokens_per_min"
    )


def test_quota_output_admits_while_under() -> None:
    b = QuotaBook()
    q = TenantQuota(output_tokens_per_min=100)
    b.admitted("t", 5, 0.0)
    b.ended("t", 99, 1.0)
    assert b.check("t", q, 5, 2.0) is None  # 99 < 100: admitted; its output may overshoot
    b.admitted("t", 5, 2.0)
    b.ended("t", 50, 3.0)
    r = b.check("t", q, 5, 4.0)
    assert r is not None and r.limit == "output_tokens_per_min"
