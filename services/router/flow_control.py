"""The router's flow control: the pure core (services/core/flow) with this router's state, its
metrics and the quota reports of the other routers.

- one :class:`~services.core.flow.FlowQueue` per model (a request waits only behind requests
  for the same model), sharing one set of virtual token counters; each holds at most
  ``queue_size`` requests for ``queue_timeout`` seconds;
- one :class:`~services.core.flow.QuotaBook`: this router's per-tenant usage, reported to
  the other routers on the load-share channel (services/router/load_share.py), and theirs;
- ``quota_of(tenant_id)``: the tenant's quota (the tenant directory's, hot-reloaded; every
  tenant is unlimited until one is set);
- with ``engine_priority`` or the prefill room, the work in flight per tenant (its requests'
  prompt tokens, as charged at dispatch: :class:`~services.core.flow.Holdings`), from which
  each dispatched request gets the ``priority`` its engine schedules it by (services/core/
  flow/engine_priority.py) and the room decides who is under its share.

Counting: a request is counted (its tenant's counter charged its prompt, its quota usage
counted) once, when first dispatched, and its generated tokens when it ends; a retry on
another worker is not counted again, and what it holds in flight is released, the same
amount, when it ends. Quotas are checked on arrival and again when a request
that waited is dispatched. Only tenants with a quota are counted in the quota book.

Invariant: ``len(self)`` is the number of requests waiting in all lanes.
"""

from __future__ import annotations

from collections.abc import Callable

from services.common.loop_metrics import LoopCounter, LoopHistogram
from services.common.tenancy import Priority, RequestTenancy, TenantQuota
from services.core.flow import (
    FlowQueue,
    Holdings,
    PrefillRoom,
    QuotaBook,
    Refusal,
    VirtualCounters,
    engine_priority,
    is_protected,
    protected_prompt_s,
)
from services.core.flow.prefill_room import DEFAULT_WINDOW_S
from services.core.latency import StepCoefficients

# the engines' tokens per step (vLLM's max_num_batched_tokens default; the workers do not
# report theirs): sizes a protected prompt's predicted time on an idle worker
PROMPT_BUDGET = 8192

UNLIMITED = TenantQuota()
_PRIORITIES = [p.value for p in Priority]

SHED = LoopCounter(
    "kvgate_flow_shed_total",
    "Requests refused (429) by flow control: by priority and why (saturated: a sheddable "
    "request while the fleet is saturated; slo: no worker meets its SLO; queue_full; bumped: "
    "made room for a higher band; timeout: waited queue_timeout)",
    ["priority", "reason"],
)
QUEUED = LoopCounter(
    "kvgate_flow_queued_total", "Requests that waited for capacity, by priority", ["priority"]
)
WAIT = LoopHistogram(
    "kvgate_flow_wait_seconds",
    "How long requests that waited for capacity waited, by priority",
    ["priority"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
ROOM_HELD_COUNT = LoopCounter(
    "kvgate_flow_room_held_total",
    "Requests the prefill room held (--protect-prefill: they waited for a prompt-free worker, "
    "or were shed if sheddable), counted once per request, by priority",
    ["priority"],
)
QUOTA_REFUSED = LoopCounter(
    "kvgate_tenant_quota_refused_total",
    "Requests refused (429) over their tenant's quota, by tenant and limit",
    ["tenant", "limit"],
)


class FlowControl:
    def __init__(
        self,
        queue_size: float,
        queue_timeout_s: float,
        peer_ttl_s: float,
        engine_priority: bool = False,
        protect_quantile: float | None = None,
    ) -> None:
        # holdings: who is over its share (engine priority's +1, the prefill room's protected)
        self.holdings = (
            Holdings(window_s=DEFAULT_WINDOW_S)
            if engine_priority or protect_quantile is not None
            else None
        )
        self.engine_priority = engine_priority
        # --protect-prefill: the room kept free of best-effort prompt work (None: off)
        self.room = (
            PrefillRoom(DEFAULT_WINDOW_S, protect_quantile)
            if protect_quantile is not None
            else None
        )
        self.prefill_coef = StepCoefficients.from_engine().as_list()
        self.queue_size = queue_size
        self.queue_timeout_s = queue_timeout_s
        self.counters = VirtualCounters()
        self.lanes: dict[str, FlowQueue] = {}
        self.quotas = QuotaBook(peer_ttl_s=peer_ttl_s)
        self.quota_of: Callable[[str], TenantQuota] = lambda _tenant: UNLIMITED
        self._dispatches = 0

    def __len__(self) -> int:
        return sum(len(q) for q in self.lanes.values())

    def lane(self, model: str) -> FlowQueue:
        q = self.lanes.get(model)
        if q is None:
            q = self.lanes[model] = FlowQueue(self.counters, self.queue_size, self.queue_timeout_s)
        return q

    def over_quota(self, tenancy: RequestTenancy, prompt_tokens: int, now: float) -> Refusal | None:
        tenant = tenancy.tenant_id
        if tenant is None:
            return None
        refusal = self.quotas.check(tenant, self.quota_of(tenant), prompt_tokens, now)
        if refusal is not None:
            QUOTA_REFUSED.labels(tenant, refusal.limit).inc()
        return refusal

    def dispatched(self, tenancy: RequestTenancy, prompt_tokens: int, now: float) -> int | None:
        """A request is dispatched for the first time: charged and counted. Returns the
        ``priority`` its engine gets (None: no ``engine_priority``)."""
        prio = None
        h = self.holdings
        if h is not None:
            if self.engine_priority:
                prio = engine_priority(
                    tenancy.priority.rank,
                    h.over_share(tenancy.flow, tenancy.weight, prompt_tokens),
                )
            h.add(tenancy.flow, tenancy.weight, prompt_tokens)
        self.counters.dispatched(tenancy.flow, tenancy.weight, prompt_tokens)
        tenant = tenancy.tenant_id
        if tenant is not None and limited(self.quota_of(tenant)):
            self.quotas.admitted(tenant, prompt_tokens, now)
        self._dispatches += 1
        if self._dispatches % 4096 == 0 and len(self.counters.counters) > 1024:
            self._forget()
        return prio

    def protected(self, tenancy: RequestTenancy, prompt_tokens: int) -> bool:
        """Does the prefill room protect this request (critical, or under its share of the
        work in flight with its ``prompt_tokens`` added)?"""
        h = self.holdings
        return is_protected(
            tenancy.priority,
            h is None or h.over_share(tenancy.flow, tenancy.weight, prompt_tokens),
        )

    def arrived(self, tenancy: RequestTenancy, prompt_tokens: int, now: float) -> bool:
        """A request arrives (not a retry): its tenant is active in the holdings' share test;
        with the room on, a protected one's prompt counts in the protected load. Returns
        whether it is protected (False: room off)."""
        if self.holdings is not None:
            self.holdings.arrived(tenancy.flow, tenancy.weight, now)
        if self.room is None or not self.protected(tenancy, prompt_tokens):
            return False
        self.room.arrived(now, protected_prompt_s(self.prefill_coef, prompt_tokens, PROMPT_BUDGET))
        return True

    def ended(
        self, tenancy: RequestTenancy, prompt_tokens: int, completion_tokens: int, now: float
    ) -> None:
        """A request dispatched with ``prompt_tokens`` (as passed to :meth:`dispatched`) ended
        having generated ``completion_tokens``."""
        if self.holdings is not None:
            self.holdings.remove(tenancy.flow, prompt_tokens)
        self.counters.completed(tenancy.flow, tenancy.weight, completion_tokens)
        tenant = tenancy.tenant_id
        if tenant is not None and limited(self.quota_of(tenant)):
            self.quotas.ended(tenant, completion_tokens, now)

    def _forget(self) -> None:
        """Drop the counters of flows that came and went (bounded memory)."""
        backlogged: set[str] = set()
        floors = []
        for q in self.lanes.values():
            backlogged.update(q.backlogged())
            f = q.floor()
            if f is not None:
                floors.append(f)
        self.counters.forget(min(floors) if floors else None, backlogged)
        for model in [m for m, q in self.lanes.items() if not q]:
            del self.lanes[model]


def limited(q: TenantQuota) -> bool:
    """Does ``q`` limit anything the quota book counts?"""
    return not (
        q.requests_per_min is None
        and q.input_tokens_per_min is None
        and q.output_tokens_per_min is None
        and q.concurrent_requests is None
    )


def shed(priority: Priority, reason: str) -> None:
    SHED.labels(priority.value, reason).inc()
