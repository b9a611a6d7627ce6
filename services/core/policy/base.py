"""The policy plugin model: a policy is a named class with a parameter schema that turns the
candidate workers (already filtered) into costs; :func:`decide` does the rest.

Flow of :func:`decide` (pure; the live router and the simulator both call it):

1. **filters** (:mod:`.filters`): routable (healthy, not cordoned / draining, circuit closed),
   serves the model, could *ever* hold the request (KV blocks and max_model_len) ->
   otherwise ``never_fits`` with the numbers;
2. **admission**: can take it *now* (in-flight below the cap, enough free KV blocks counting the
   prefix it already holds) -> otherwise ``wait`` (the router queues it);
3. **scorers** (:mod:`.scorers`, combined by the policy class): a cost per candidate;
4. **picker** (:mod:`.pickers`): lowest cost, ties broken by the policy's seeded RNG.

Over a tracked snapshot (``ClusterSnapshot.watchers``, the router's and the simulator's) a
policy may shortcut steps 1-3 (:meth:`PolicyImpl.fast_costs`: ``kv_aware`` from 128 workers
keeps per-worker filter inputs and cost bounds up to date as workers change and scores only
the holders of the prompt and the workers whose bound can still win); the pick is the same.

Invariant: given the same spec (including ``seed``) and the same sequence of
(request, snapshot, overlaps), the sequence of decisions is identical, shortcut or not.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

from services.core.policy import filters
from services.core.policy.attribution import attribute
from services.core.policy.errors import PolicyError
from services.core.policy.pickers import TIE_EPS, pick_min
from services.core.policy.types import ClusterSnapshot, Decision, RequestInfo, WorkerState
from services.core.policy.validation import check

# parameters every policy accepts
COMMON_PARAMS: dict[str, Any] = {
    "seed": {
        "type": "integer",
        "minimum": 0,
        "default": 0,
        "description": "seed of the policy's RNG (tie breaks, random choices)",
    },
    "max_inflight": {
        "type": ["integer", "null"],
        "minimum": 1,
        "default": None,
        "description": "per-worker cap on in-flight requests (null: the worker's max_num_seqs)",
    },
}


@dataclass
class PolicyState:
    """Mutable state a policy keeps between decisions (deterministic given the seed)."""

    rng: random.Random
    counter: int = 0
    # the snapshot's ``removed`` count when this state last dropped departed workers' entries
    removed_seen: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    now: float = 0.0  # the snapshot's clock at the current decision (set by :func:`decide`)
    # workers a policy asks to receive a one-token copy of the current request (set by
    # ``costs``/``pick``, read and cleared by :func:`decide`)
    replicate_to: tuple[str, ...] = ()
    # request the current one should wait for (its first token) and for how long at most
    after: str | None = None
    hold_s: float = 0.0
    # set by ``costs`` to refuse the current request (why): :func:`decide` returns a shed
    # decision instead of a pick
    shed: str | None = None


class PolicyImpl:
    """Base of every policy. Subclasses set ``name``, ``PARAMS`` (JSON Schema properties) and
    implement :meth:`costs`. ``self.p`` holds validated params (defaults filled in)."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    PARAMS: ClassVar[dict[str, Any]] = {}
    # parameters a related policy takes that this one has no use for (name -> why): a spec
    # naming one is refused by name (an accepted parameter that changes nothing would let a
    # user believe it was tuned); they are not in PARAMS
    NOT_TAKEN: ClassVar[dict[str, str]] = {}
    # a P/D policy (prefill/decode disaggregation) pairs a prefill worker with a decode worker
    # in :meth:`decide_pd` instead of costing colocated ("both") workers
    disaggregated: ClassVar[bool] = False
    # reuse attribution: why this policy's cost puts a worker that holds more of the prompt
    # behind the chosen one ("load": it weighs queues against reuse; "policy": it ignores
    # prefixes); services.core.policy.attribution
    cost_reason: ClassVar[str] = "load"

    def __init__(self, params: dict[str, Any]) -> None:
        self.p = params
        self.max_inflight: int | None = params.get("max_inflight")

    def wants_block_keys(self) -> bool:
        """Does this policy need the prompt's whole block-key chain (``RequestInfo.block_keys``)?
        Policies that remember where they sent a prefix do (``routed_ttl`` > 0, or their own
        routed-prompt tree); hashing the whole chain costs the live router a pass over the
        prompt, so the others get none."""
        return bool(self.p.get("routed_ttl"))

    def cap(self, w: WorkerState) -> int:
        """In-flight requests ``w`` may take under this policy (``filters.fit_now`` applies
        the same limit inline)."""
        c = w.capacity.max_num_seqs
        return c if self.max_inflight is None else min(c, self.max_inflight)

    def costs(
        self,
        req: RequestInfo,
        cands: list[WorkerState],
        overlaps: dict[str, int],
        state: PolicyState,
    ) -> dict[str, float]:
        raise NotImplementedError

    def pick(self, costs: dict[str, float], state: PolicyState) -> str:
        return pick_min(costs, state.rng)

    def lost_reason(self, holder: str, chosen: str, costs: dict[str, float]) -> str:
        """Why the candidate ``holder`` (it holds more of the prompt) was not chosen over
        ``chosen``: ``tie`` when it cost no more (the picker chose among equals, or sampled),
        else :attr:`cost_reason`."""
        if costs[holder] <= costs[chosen] + TIE_EPS:
            return "tie"
        return self.cost_reason

    def observe_decode(
        self, worker_id: str, gap_s: float, decoding: int, state: PolicyState
    ) -> None:
        """A streamed answer's mean inter-token gap on ``worker_id``, with ``decoding``
        requests in flight there (:meth:`RequestLifecycle.decoded
        <services.core.lifecycle.RequestLifecycle.decoded>`): for a policy that calibrates a
        latency model from it; ignored by default."""

    def decide_pd(
        self,
        req: RequestInfo,
        snapshot: ClusterSnapshot,
        overlaps: dict[str, int],
        state: PolicyState,
    ) -> Decision:
        """A P/D policy's whole decision (``disaggregated`` True): the decode worker as
        ``worker_id``, the prefill worker as ``prefill_worker`` (None: the decoder prefills
        itself). Filters are the policy's (:func:`services.core.pd.pools.pools`)."""
        raise NotImplementedError

    def observe_prefill(
        self, request_id: str, worker_id: str, ttft_s: float, state: PolicyState
    ) -> None:
        """Request ``request_id``'s prefill on ``worker_id`` took ``ttft_s`` from dispatch to
        its first token (:meth:`RequestLifecycle.prefilled
        <services.core.lifecycle.RequestLifecycle.prefilled>`; a P/D policy calibrates its
        prefill model from it); ignored by default."""

    def prune(self, state: PolicyState, live: dict[str, WorkerState]) -> None:
        """Workers left the cluster: drop what ``state`` keeps for workers not in ``live``
        (called by :func:`decide` over a tracked snapshot once its ``removed`` count moved).
        Nothing by default."""

    def fast_costs(
        self,
        req: RequestInfo,
        snapshot: ClusterSnapshot,
        overlaps: dict[str, int],
        state: PolicyState,
        filtered: dict[str, str],
    ) -> dict[str, float] | None:
        """Optional shortcut of filters + :meth:`costs` for a tracked snapshot
        (``ClusterSnapshot.watchers``): None (the default) when it does not apply, before
        changing any state; else the costs of enough candidates that :meth:`pick` chooses
        exactly what it would over all of them (every other candidate costs more than the
        lowest + the tie margin), ``filtered`` filled as the filters would."""
        return None


REGISTRY: dict[str, type[PolicyImpl]] = {}


def register(cls: type[PolicyImpl]) -> type[PolicyImpl]:
    """Class decorator: make a policy available by ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    REGISTRY[cls.name] = cls
    return cls


def params_schema(cls: type[PolicyImpl]) -> dict[str, Any]:
    return {
        "type": "object",
        "description": cls.description,
        "properties": {**COMMON_PARAMS, **cls.PARAMS},
        "additionalProperties": False,
    }


@dataclass
class Policy:
    """A configured policy: implementation + validated params + its own state."""

    name: str
    params: dict[str, Any]
    impl: PolicyImpl
    state: PolicyState
    version: int = 0

    @property
    def spec(self) -> dict[str, Any]:
        return {"name": self.name, "params": dict(self.params)}


def validate_policy_spec(name: str, params: dict[str, Any] | None) -> dict[str, Any]:
    """Validated params with defaults filled in, or :class:`PolicyError` naming the field."""
    if not isinstance(name, str) or name not in REGISTRY:
        raise PolicyError("name", f"unknown policy {name!r} (known: {', '.join(sorted(REGISTRY))})")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise PolicyError("params", "must be an object")
    cls = REGISTRY[name]
    for key in params:
        if key in cls.NOT_TAKEN:
            raise PolicyError(f"params.{key}", f"{name} does not take it: {cls.NOT_TAKEN[key]}")
    return check(params, params_schema(cls), "params")


def build_policy(spec: dict[str, Any], version: int = 0) -> Policy:
    """``{"name": ..., "params": {...}}`` -> a ready :class:`Policy` (validated)."""
    if not isinstance(spec, dict):
        raise PolicyError("spec", "must be an object with 'name' and 'params'")
    unknown = set(spec) - {"name", "params"}
    if unknown:
        raise PolicyError(sorted(unknown)[0], "unknown field (a spec has 'name' and 'params')")
    name = spec.get("name")
    params = validate_policy_spec(name, spec.get("params"))  # type: ignore[arg-type]
    impl = REGISTRY[name](params)  # type: ignore[index]
    return Policy(name, params, impl, PolicyState(random.Random(params["seed"])), version)


def decide(
    policy: Policy, request: RequestInfo, snapshot: ClusterSnapshot, overlaps: dict[str, int]
) -> Decision:
    impl = policy.impl
    filtered: dict[str, str] = {}
    state = policy.state
    if impl.disaggregated:
        state.now = snapshot.now
        d = impl.decide_pd(request, snapshot, overlaps, state)
        d.policy = policy.name
        # reuse attribution covers colocated decisions only: a P/D pair's reuse is not
        # compared with other pairs' (available = captured, no reason)
        d.available_tokens = max(d.available_tokens, d.cached_tokens)
        return d
    if snapshot.watchers is not None:
        if snapshot.removed != state.removed_seen:  # workers left: forget them
            state.removed_seen = snapshot.removed
            impl.prune(state, snapshot.workers)
        state.now = snapshot.now
        state.replicate_to = ()
        state.after = None
        state.shed = None
        costs = impl.fast_costs(request, snapshot, overlaps, state, filtered)
        if costs is not None:
            return _chosen(policy, request, snapshot, overlaps, costs, filtered)
    serving = filters.routable_for_model(snapshot.workers.values(), request.model, filtered)
    if not serving:
        return Decision(
            None,
            reason=f"no routable worker serves model {request.model!r}",
            filtered=filtered,
            policy=policy.name,
        )
    possible, cands = filters.fit_now(serving, request, overlaps, impl.max_inflight, filtered)
    if not possible:
        return Decision(
            None,
            reason="request can never fit",
            never_fits=filters.never_fits_message(serving, request),
            filtered=filtered,
            policy=policy.name,
        )
    if not cands:
        return Decision(
            None,
            reason="all workers at capacity",
            wait=True,
            filtered=filtered,
            policy=policy.name,
        )
    state.now = snapshot.now
    state.replicate_to = ()
    state.after = None
    state.shed = None
    costs = impl.costs(request, cands, overlaps, state)
    return _chosen(policy, request, snapshot, overlaps, costs, filtered)


def _chosen(
    policy: Policy,
    request: RequestInfo,
    snapshot: ClusterSnapshot,
    overlaps: dict[str, int],
    costs: dict[str, float],
    filtered: dict[str, str],
) -> Decision:
    impl, state = policy.impl, policy.state
    if state.shed is not None:
        reason, state.shed = state.shed, None
        state.replicate_to = ()
        return Decision(
            None, scores=costs, reason=reason, filtered=filtered, policy=policy.name, shed=True
        )
    wid = impl.pick(costs, state)
    replicas = tuple(w for w in state.replicate_to if w != wid)
    after, hold_s = state.after, state.hold_s
    state.replicate_to = ()
    state.after = None
    ov = overlaps.get(wid, 0)
    bs = snapshot.workers[wid].capacity.block_size
    cached = min(ov * bs, request.prompt_tokens)
    available, lost = attribute(impl, request, snapshot, overlaps, costs, filtered, wid, cached)
    return Decision(
        wid,
        scores=costs,
        reason="lowest cost",
        filtered=filtered,
        overlap_blocks=ov,
        cached_tokens=cached,
        available_tokens=available,
        lost_reason=lost,
        policy=policy.name,
        replicate_to=replicas,
        after=after,
        hold_s=hold_s if after is not None else 0.0,
    )
