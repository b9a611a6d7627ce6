"""The flow-control order carried into the engines' own schedulers: the ``priority`` field
of the request sent to the engine (vLLM ``--scheduling-policy priority``, SGLang
``--enable-priority-scheduling --schedule-low-priority-values-first``; lower values first).

Router-side flow control orders only the requests that wait in the router; once dispatched,
a request waits in the engine's own queue and, under an engine's preemption, may be put back
there. With a priority from the same model the engine serves the queue in the same order:

- the band, strictly: critical < standard < sheddable, ``BAND_STEP`` apart;
- within a band, +1 for a request whose flow (tenant) already holds more than its weighted
  share of the work in flight on this router (:class:`Holdings`): a light tenant's request
  goes ahead of the over-share tenant's in the engine's queue.

``BAND_STEP`` is 20, above SGLang's default ``--priority-scheduling-preemption-threshold``
(10): there a waiting request preempts running requests of a lower band, while within a band
(a difference of 1) it only reorders the queue, unless the threshold is set to 0. vLLM 0.33
never preempts for a waiting request (its priority picks the victim when blocks run out).

The share is of *work*, in the fair queue's currency (services/core/flow/vtc.py): a request
in flight holds what the virtual counters charged it at dispatch, its prompt tokens (VTC's
input cost, 1 a token); its generated tokens are charged when it ends, so they are never in
flight (the router does not know a request's output length before it ends). A tenant sending
few long prompts and one sending many short ones are compared by the prompt work they hold,
not by how many requests: a burst of short requests stays under its share while a long-prompt
tenant holds most of the slots' work. The same test decides who the prefill room protects
(services/core/flow/prefill_room.py).

Whose share: the tenants *active* now, those holding work in flight and those that sent a
request within the last ``window_s`` seconds (the prefill room's window). Counted over the
holders alone, a tenant far above its share is "within" it whenever the others happen to
have nothing in flight (live, 2 workers: a heavy tenant at 10x its share, alone in flight
between the light tenants' short requests, was protected by the prefill room most of the
time); a tenant that sends keeps its place in the division between its requests.

Invariants: a flow is held while it has a dispatched, not yet ended request; its work is the
sum of those requests' charges, never negative, and a flow's last request releases what it
holds (so holdings are empty, total 0, when nothing is in flight); ``total_work`` is the sum
over the flows, ``total_weight`` the sum of the held flows' weights; ``idle_weight`` the sum
of the weights of the flows that arrived within the window (as of the latest arrival) and
hold nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

BAND_STEP = 20


def engine_priority(band_rank: int, over_share: bool) -> int:
    """The engine's ``priority`` of a request of band ``band_rank`` (0 = critical)."""
    return BAND_STEP * band_rank + int(over_share)


@dataclass(slots=True)
class Holdings:
    """Work in flight per flow (the prompt tokens of the router's dispatched, not yet ended
    requests), how many requests hold it, the held flows' weights, and the flows that arrived
    within ``window_s`` (active while they hold nothing)."""

    work: dict[str, int] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)
    weight: dict[str, float] = field(default_factory=dict)
    total_work: int = 0
    total_weight: float = 0.0
    window_s: float = 10.0
    # flow -> (its weight, its latest arrival), oldest arrival first
    recent: OrderedDict[str, tuple[float, float]] = field(default_factory=OrderedDict)
    idle_weight: float = 0.0

    def over_share(self, flow: str, weight: float, work: int) -> bool:
        """Would ``flow``, with one more request of ``work`` in flight, hold more than its
        weighted share of the work in flight (its weight over the weights of the active
        flows: holding any, or arrived within the window)? Never while it holds nothing:
        divided among the active tenants, a lone request on an idle fleet would otherwise be
        over its share."""
        mine = self.work.get(flow, 0)
        if not mine:
            return False  # holding nothing, no tenant is over its share (an idle fleet's too)
        # it holds work, so its weight is in total_weight already
        weights = self.total_weight + self.idle_weight
        # (mine + work) / (total + work) > weight / weights, without dividing
        return (mine + work) * weights > weight * (self.total_work + work)

    def arrived(self, flow: str, weight: float, now: float) -> None:
        """A request of ``flow`` arrived at ``now``: it is active for ``window_s``. Flows
        whose latest arrival is older leave the active set (amortised O(1))."""
        recent = self.recent
        while recent:
            old, (w, t) = next(iter(recent.items()))
            if now - t <= self.window_s:
                break
            del recent[old]
            if old not in self.count:
                self.idle_weight -= w
        prev = recent.pop(flow, None)
        recent[flow] = (weight, now)
        if flow not in self.count:
            self.idle_weight += weight - (prev[0] if prev is not None else 0.0)
        if not recent and not self.count:
            self.idle_weight = 0.0

    def add(self, flow: str, weight: float, work: int) -> None:
        """A request of ``flow`` holding ``work`` (>= 0) was dispatched."""
        if work < 0:
            raise ValueError(f"work in flight must be >= 0, got {work}")
        n = self.count.get(flow, 0)
        if not n:
            self.weight[flow] = weight
            self.total_weight += weight
            r = self.recent.get(flow)
            if r is not None:  # active while idle: now a holder
                self.idle_weight -= r[0]
        self.count[flow] = n + 1
        self.work[flow] = self.work.get(flow, 0) + work
        self.total_work += work

    def remove(self, flow: str, work: int) -> None:
        """A request of ``flow`` that was added with ``work`` ended. A flow not held: no-op;
        never more than the flow holds is released, and its last request releases all."""
        n = self.count.get(flow, 0)
        if not n:
            return
        mine = self.work[flow]
        if n == 1:
            self.total_work -= mine
            del self.count[flow], self.work[flow]
            self.total_weight -= self.weight.pop(flow)
            r = self.recent.get(flow)
            if r is not None:  # still active: idle now
                self.idle_weight += r[0]
            if not self.count:
                self.total_weight = 0.0  # no drift from float sums
                self.total_work = 0
                self.idle_weight = sum(w for w, _ in self.recent.values())
        else:
            w = min(max(work, 0), mine)
            self.count[flow] = n - 1
            self.work[flow] = mine - w
            self.total_work -= w
