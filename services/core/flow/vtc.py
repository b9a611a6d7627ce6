"""Virtual token counters (VTC): how much weighted service each flow (tenant) has received,
after "Fairness in Serving Large Language Models" (Sheng et al., OSDI '24), Algorithm 2 with
weights.

A request's cost is ``input_cost`` x its prompt tokens + ``output_cost`` x its generated
tokens (the paper's w_p = 1, w_q = 2: a generated token costs the engine about twice a prompt
token); a flow's counter grows by cost / weight. The queue serves the backlogged flow with the
least counter first, so backlogged flows receive service in proportion to their weights.

Invariants:
- counters only grow;
- a flow that becomes backlogged (had nothing queued) is *lifted* to the least counter among
  the flows backlogged now, or, when none is, to the counter of the flow dispatched last: an
  idle flow banks no credit for the time it sent nothing (else it could starve the others
  when it comes back), and is not penalised for service it received while the fleet had room;
- the prompt is charged when the request is dispatched, the generated tokens when it ends
  (the live router learns the count from the finished stream; the paper charges per step).
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field


@dataclass(slots=True)
class VirtualCounters:
    input_cost: float = 1.0
    output_cost: float = 2.0
    counters: dict[str, float] = field(default_factory=dict)
    last: float = 0.0  # counter of the flow dispatched last: the lift's floor when none waits
    version: int = 0  # bumped on every charge (a queue's cached head is stale after one)

    def get(self, flow: str) -> float:
        return self.counters.get(flow, 0.0)

    def lift(self, flow: str, floor: float | None) -> None:
        """``flow`` becomes backlogged; ``floor``: the least counter among the flows
        backlogged now (None: none is)."""
        f = self.last if floor is None else floor
        if self.counters.get(flow, 0.0) < f:
            self.counters[flow] = f
            self.version += 1

    def dispatched(self, flow: str, weight: float, input_tokens: int) -> None:
        """A request of ``flow`` was dispatched: its prompt is charged."""
        c = self.counters.get(flow, 0.0) + self.input_cost * input_tokens / weight
        self.counters[flow] = c
        self.last = c
        self.version += 1

    def completed(self, flow: str, weight: float, output_tokens: int) -> None:
        """A request of ``flow`` ended having generated ``output_tokens``."""
        if output_tokens > 0:
            self.counters[flow] = (
                self.counters.get(flow, 0.0) + self.output_cost * output_tokens / weight
            )
            self.version += 1

    def forget(self, floor: float | None, keep: Container[str]) -> int:
        """Drop the counters of flows not in ``keep`` (the backlogged ones) at or below the
        lift floor (``floor``, as for :meth:`lift`): a returning flow is lifted to at least
        that anyway, and the floor does not go down. Bounds memory when flows come and go
        (tenants from a trusted header). Returns how many were dropped."""
        floor = self.last if floor is None else floor
        drop = [f for f, c in self.counters.items() if c <= floor and f not in keep]
        for f in drop:
            del self.counters[f]
        return len(drop)
