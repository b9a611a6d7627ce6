"""Reuse attribution of one decision: how many prompt tokens some eligible worker already held
(*available*), how many the chosen worker holds (*captured*: ``Decision.cached_tokens``), and,
when the chosen worker holds fewer, why the best holder was not taken.

*Eligible*: a worker of the snapshot that serves the request's model, has a role the policy
routes to (a colocated policy: ``both``) and could ever hold the request (KV blocks,
``max_model_len``); a holder the request could never run on had no reuse to offer. The engine's own report (*delivered*) comes later, from the response's usage, and is
the caller's to add (:data:`DELIVERY_REASONS`).

Reasons (:data:`LOST_REASONS`), for the holder with the most tokens:

- ``unhealthy``, ``breaker`` (its circuit is open), ``drain`` (cordoned or draining),
  ``capacity`` (at its in-flight cap, or too few free KV blocks now), ``filtered`` (another
  filter verdict): it was no candidate;
- ``tie``: a candidate at most as costly as the chosen one (the picker's tie break, or a
  sampling picker chose another);
- otherwise the policy's reason for a higher cost (:meth:`PolicyImpl.lost_reason
  <services.core.policy.base.PolicyImpl.lost_reason>`): ``load`` by default (the policy
  weighed the holder's queue against the reuse), ``slo`` (``slo_aware``: predicted to miss
  the request's SLO where another meets it), ``policy`` (a policy that ignores prefixes).

Invariant: ``0 <= captured <= available <= prompt_tokens``; ``lost_reason`` is ``""``
exactly when ``captured == available``. Work: one pass over ``overlaps`` in C when no holder
holds more tokens than the chosen one (the common case of a cache-aware policy; it needs the
snapshot's ``max_block_size``), else one in Python.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.core.policy.pickers import TIE_EPS
from services.core.policy.types import ClusterSnapshot, RequestInfo

if TYPE_CHECKING:
    from services.core.policy.base import PolicyImpl

# why the best holder was not chosen (the decision's part); see the module docstring
LOST_REASONS = (
    "unhealthy",
    "breaker",
    "drain",
    "capacity",
    "filtered",
    "tie",
    "load",
    "slo",
    "policy",
)
# added by the caller (services/router/outcomes.py): ``retry`` (the best holder failed this
# request before, so a later decision left it out), ``engine`` (the engine reported fewer
# cached tokens than the chosen worker was predicted to hold: evicted meanwhile, or computed
# again by the engine's own rule, e.g. the prompt's last token)
DELIVERY_REASONS = ("retry", "engine")

# among holders of as many tokens, the reason reported is the one closest to a choice: the
# best holder the policy could have taken
_TIE, _COST, _FILTER, _NONE = 0, 1, 2, 3
_INF = float("inf")

# filters.py's verdicts -> reason; verdicts of workers the request could never run on -> None
_VERDICTS = {
    "unhealthy": "unhealthy",
    "circuit open": "breaker",
    "cordoned": "drain",
    "draining": "drain",
}


def verdict_reason(verdict: str) -> str | None:
    """A filter verdict (:mod:`services.core.policy.filters`) as a lost reason; None for a
    worker that was not eligible (another model or role, the request can never fit there)."""
    r = _VERDICTS.get(verdict)
    if r is not None:
        return r
    if verdict.startswith(("at cap", "KV full")):
        return "capacity"
    if verdict.startswith(("serves ", "needs ", "role ")) or "max_model_len" in verdict:
        return None
    return "filtered"


def attribute(
    impl: PolicyImpl,
    request: RequestInfo,
    snapshot: ClusterSnapshot,
    overlaps: dict[str, int],
    costs: dict[str, float],
    filtered: dict[str, str],
    chosen: str,
    captured: int,
) -> tuple[int, str]:
    """(available tokens, lost reason) of the decision that chose ``chosen``, which holds
    ``captured`` cached tokens of the prompt."""
    prompt = request.prompt_tokens
    if captured >= prompt or not overlaps:
        return captured, ""
    mbs = snapshot.max_block_size
    if mbs and max(overlaps.values()) * mbs <= captured:  # nobody holds more tokens
        return captured, ""
    model = request.model
    workers = snapshot.workers
    chosen_cost = costs.get(chosen, 0.0)
    best, reason, rank = captured, "", _NONE
    for wid, blocks in overlaps.items():
        if mbs and blocks * mbs < best:  # cannot hold more than the best so far
            continue
        w = workers.get(wid)
        if w is None or wid == chosen:  # not in this snapshot (left, or excluded by the caller)
            continue
        tokens = blocks * w.capacity.block_size
        if tokens > prompt:
            tokens = prompt
        if tokens <= captured or tokens < best:
            continue
        verdict = filtered.get(wid)
        if tokens == best:
            # as many tokens as the best so far: only a reason closer to a choice replaces it
            # (a tie before a cost before a filter)
            if rank == _TIE or (rank == _COST and verdict is not None):
                continue
            if rank == _COST and costs.get(wid, _INF) > chosen_cost + TIE_EPS:
                continue
        if model and w.model != model and model not in w.loras:
            continue
        if verdict is not None:
            why = verdict_reason(verdict)
            if why is None:
                continue
        elif wid in costs:
            why = impl.lost_reason(wid, chosen, costs)
        else:  # a shortcut (fast_costs) left it unscored: its cost could not win
            why = impl.cost_reason
        r = _TIE if why == "tie" else _FILTER if verdict is not None else _COST
        if tokens > best or r < rank:
            best, reason, rank = tokens, why, r
    return best, reason
