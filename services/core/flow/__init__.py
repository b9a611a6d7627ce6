"""Flow control when the fleet is saturated: priority bands, fair queueing across tenants by
virtual token counters, shedding, and per-tenant quotas. Pure (no I/O, no clock: ``now`` is an
argument), so the live router (services/router/admission.py) and the simulator
(bench/simcore.py) run the same code.

- :mod:`.vtc`: virtual token counters (VTC, "Fairness in Serving Large Language Models",
  OSDI '24): the weighted service each flow (tenant) received;
- :mod:`.queue`: the admission queue in service order (band, then the least-served flow);
- :mod:`.control`: what a request does when it cannot be dispatched now (queue or shed);
- :mod:`.engine_priority`: that order as the engines' own ``priority`` field (opt-in);
- :mod:`.prefill_room`: workers kept free of best-effort prompt work for protected requests
  (opt-in ``--protect-prefill``), sized by an M/G/infinity model of the protected load;
- :mod:`.quota`: per-tenant requests / tokens per minute and concurrency, summed over router
  replicas from what each reports.
"""

from services.core.flow.control import Verdict, on_arrival, verdict
from services.core.flow.engine_priority import BAND_STEP, Holdings, engine_priority
from services.core.flow.prefill_room import (
    PrefillRoom,
    decide_in_room,
    is_protected,
    poisson_room,
    protected_prompt_s,
)
from services.core.flow.queue import FlowQueue, Joined
from services.core.flow.quota import QuotaBook, Refusal, Usage
from services.core.flow.vtc import VirtualCounters

__all__ = [
    "BAND_STEP",
    "FlowQueue",
    "Holdings",
    "Joined",
    "PrefillRoom",
    "QuotaBook",
    "Refusal",
    "Usage",
    "Verdict",
    "VirtualCounters",
    "decide_in_room",
    "engine_priority",
    "is_protected",
    "on_arrival",
    "poisson_room",
    "protected_prompt_s",
    "verdict",
]
