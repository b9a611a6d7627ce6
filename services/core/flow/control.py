"""What a request does when the fleet is saturated: wait in the :class:`FlowQueue`, or be
shed (the caller answers 429 with Retry-After).

The fleet is *saturated* for a request when its decision names no worker because every
worker is at capacity (``Decision.wait``) or because the latency model predicts no worker
meets its SLO (``Decision.shed``), and also while requests of its band or above already wait
(it must not overtake them). The model, by band:

- **sheddable**: shed whenever the fleet is saturated; never waits. So a sheddable request
  is dispatched only when nothing waits, and no critical request can be refused (queue full
  or timed out) while a sheddable one is dispatched;
- **standard**: waits for capacity; shed when the latency model says its SLO cannot be met
  (the SLO policy's own shedding, as without tenants);
- **critical**: waits for capacity, and also when the SLO cannot be met (it is never shed on
  a prediction); refused only when the queue is full of critical requests or it waited the
  queue's timeout.
"""

from __future__ import annotations

from enum import StrEnum

from services.common.tenancy import Priority
from services.core.flow.queue import FlowQueue


class Verdict(StrEnum):
    DECIDE = "decide"  # nothing of its band or above waits: ask the policy now
    QUEUE = "queue"
    SHED = "shed"


def on_arrival(priority: Priority, queue: FlowQueue) -> Verdict:
    """A request arrives (before any decision): decide now, or join the waiters / be shed
    because requests of its band or above already wait (any waiter, for a sheddable one)."""
    if not queue:
        return Verdict.DECIDE
    if priority is Priority.SHEDDABLE:
        return Verdict.SHED
    return Verdict.QUEUE if queue.ahead(priority.rank) else Verdict.DECIDE


def verdict(priority: Priority, policy_shed: bool) -> Verdict:
    """The decision named no worker (``policy_shed``: the policy predicts no worker meets the
    SLO; else every worker is at capacity): wait or be shed."""
    if priority is Priority.SHEDDABLE:
        return Verdict.SHED
    if policy_shed and priority is not Priority.CRITICAL:
        return Verdict.SHED
    return Verdict.QUEUE
