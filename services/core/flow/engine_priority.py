"""The flow-control order carried into the engines' own schedulers: the ``priority`` field
of the request sent to the engine (vLLM ``--scheduling-policy priority``, SGLang
``--enable-priority-scheduling --schedule-low-priority-values-first``; lower values first).

Router-side flow control orders only the requests that wait in the router; once dispatched,
a request waits in the engine's own queue and, under an engine's preemption, may be put back
there. With a priority from the same model the engine serves the queue in the same order:

- the band, strictly: critical < standard < sheddable, ``BAND_STEP`` apart;
- within a band, +1 for a request whose flow (tenant) already holds more than its weighted
  share of the requests in flight on this router (:class:`Holdings`): a light tenant's request
  goes ahead of the over-share tenant's in the engine's queue.

``BAND_STEP`` is 20, above SGLang's default ``--priority-scheduling-preemption-threshold``
(10): there a waiting request preempts running requests of a lower band, while within a band
(a difference of 1) it only reorders the queue, unless the threshold is set to 0. vLLM 0.33
never preempts for a waiting request (its priority picks the victim when blocks run out).

Invariants: holdings count every dispatched, not yet ended request of a flow once; the total
is their sum; a flow with nothing in flight is not held.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BAND_STEP = 20


def engine_priority(band_rank: int, over_share: bool) -> int:
    """The engine's ``priority`` of a request of band ``band_rank`` (0 = critical)."""
    return BAND_STEP * band_rank + int(over_share)


@dataclass(slots=True)
class Holdings:
    """Requests in flight per flow and the flows' weights (the router's dispatched, not yet
    ended requests)."""

    count: dict[str, int] = field(default_factory=dict)
    weight: dict[str, float] = field(default_factory=dict)
    total: int = 0
    total_weight: float = 0.0

    def over_share(self, flow: str, weight: float) -> bool:
        """Would one more request of ``flow`` hold more than its weighted share of the
        requests in flight (its weight over the weights of the flows holding any)?"""
        mine = self.count.get(flow, 0)
        weights = self.total_weight + (0.0 if mine else weight)
        # (mine + 1) / (total + 1) > weight / weights, without dividing
        return (mine + 1) * weights > weight * (self.total + 1)

    def add(self, flow: str, weight: float) -> None:
        n = self.count.get(flow, 0)
        if not n:
            self.weight[flow] = weight
            self.total_weight += weight
        self.count[flow] = n + 1
        self.total += 1

    def remove(self, flow: str) -> None:
        n = self.count.get(flow, 0)
        if not n:
            return
        self.total -= 1
        if n == 1:
            del self.count[flow]
            self.total_weight -= self.weight.pop(flow)
            if not self.count:
                self.total_weight = 0.0  # no drift from float sums
        else:
            self.count[flow] = n - 1
