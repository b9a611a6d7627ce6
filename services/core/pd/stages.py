"""A colocated routing rule run over one pool of a disaggregated fleet.

The peers' P/D routers choose the prefill worker and the decode worker each with an ordinary
load-balancing rule over that pool (Dynamo: a KV router per pool; sgl-model-gateway: a
``prefill_policy`` and a ``decode_policy``; llm-d: a decode and a prefill scheduling profile),
each with its own state (prefix trees, LRU indexes, counters). A :class:`Stage` is one such rule:
a registered colocated policy with its own :class:`PolicyState`, asked for a pick among the
candidates a P/D policy's pools (:mod:`services.core.pd.pools`) leave.
"""

from __future__ import annotations

import random
from typing import Any

from services.core.policy.base import REGISTRY, PolicyState, validate_policy_spec
from services.core.policy.types import RequestInfo, WorkerState


class Stage:
    def __init__(self, name: str, params: dict[str, Any] | None, seed: int) -> None:
        p = validate_policy_spec(name, {**(params or {}), "seed": seed})
        self.impl = REGISTRY[name](p)
        self.state = PolicyState(random.Random(seed))

    def pick(
        self, req: RequestInfo, cands: list[WorkerState], overlaps: dict[str, int], now: float
    ) -> tuple[str, dict[str, float]]:
        """The rule's pick among ``cands`` (non-empty) and its costs."""
        st = self.state
        st.now = now
        st.replicate_to = ()
        st.after = None
        st.shed = None
        costs = self.impl.costs(req, cands, overlaps, st)
        return self.impl.pick(costs, st), costs

    def wants_block_keys(self) -> bool:
        return self.impl.wants_block_keys()
