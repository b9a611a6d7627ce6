"""The router's Prometheus metrics (process-wide default registry, served on GET /metrics).

Every metric is ``kvgate_router_*``. All are updated from the router's event loop only, so they
are loop metrics (``services.common.loop_metrics``: plain numbers per request, turned into
prometheus-client's families at a scrape; a request's dozen updates cost ~1 µs instead of ~5).
``kv_cache_hit_rate`` and ``request_timeout_total`` are kept as aliases of
``kvgate_router_kv_cache_hit_ratio`` and ``kvgate_router_timeouts_total`` (the names of the
first release; same values).
"""

from __future__ import annotations

from collections import deque

from services.common.loop_metrics import LoopCounter, LoopGauge, LoopHistogram

LAT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

REQUESTS = LoopCounter(
    "kvgate_router_requests_total",
    "Requests by policy, worker and status",
    ["policy", "worker", "status"],
)
TTFT = LoopHistogram(
    "kvgate_router_ttft_seconds", "Time to first token (streaming)", ["policy"], buckets=LAT_BUCKETS
)
E2E = LoopHistogram(
    "kvgate_router_e2e_seconds", "End-to-end request time", ["policy"], buckets=LAT_BUCKETS
)
ITL = LoopHistogram(
    "kvgate_router_itl_seconds",
    "Mean inter-token latency of a streamed answer: (end - first token) / (tokens - 1)",
    ["policy"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1),
)
ARM_REQUESTS = LoopCounter(
    "kvgate_router_arm_requests_total",
    "Requests by canary arm (control | candidate) and status: the arms side by side",
    ["arm", "status"],
)
ARM_TTFT = LoopHistogram(
    "kvgate_router_arm_ttft_seconds",
    "Time to first token by canary arm (a non-streamed answer counts its whole time)",
    ["arm"],
    buckets=LAT_BUCKETS,
)
DECISION = LoopHistogram(
    "kvgate_router_decision_seconds",
    "Routing decision time (tokenize, keys, index match, policy)",
    buckets=(25e-6, 50e-6, 100e-6, 150e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05),
)
HIT_RATIO = LoopGauge(
    "kvgate_router_kv_cache_hit_ratio",
    "Prompt tokens served from KV cache / prompt tokens, over the last 1000 requests, 0-1 "
    "(kind: predicted by the router, reported by the workers)",
    ["kind"],
)
HIT_RATE = LoopGauge(  # alias (first release's name)
    "kv_cache_hit_rate", "Alias of kvgate_router_kv_cache_hit_ratio", ["kind"]
)
PROMPT_TOKENS = LoopCounter("kvgate_router_prompt_tokens_total", "Prompt tokens routed")
CACHED_TOKENS = LoopCounter("kvgate_router_cached_tokens_total", "Cached prompt tokens", ["kind"])
PREFIX_TOKENS = LoopCounter(
    "kvgate_router_prefix_tokens_total",
    "Reuse attribution of answered requests, in prompt tokens (kind: available = the most any "
    "eligible worker held cached, captured = the chosen worker's, delivered = the engine's "
    "report, unpredicted = delivered beyond captured)",
    ["kind"],
)
PREFIX_LOST = LoopCounter(
    "kvgate_router_prefix_tokens_lost_total",
    "Cached prompt tokens available but not delivered, by why (services/core/policy/"
    "attribution.py: unhealthy, breaker, drain, capacity, filtered, tie, load, slo, policy; "
    "retry, engine) and canary arm",
    ["reason", "arm"],
)
ENGINES_NEEDED = LoopGauge(
    "kvgate_fleet_engines_needed",
    "Engines the fleet needs to meet its SLOs at the arrival rate this router sees (sum over "
    "routers), from the latency model and the queue (services/core/scaling.py)",
)
ARRIVAL_RATE = LoopGauge(
    "kvgate_router_arrival_rate",
    "Requests arriving per second at this router (double-smoothed over --scaling-window)",
)
TIMEOUTS = LoopCounter("kvgate_router_timeouts_total", "Requests that timed out at the router")
TIMEOUTS_ALIAS = LoopCounter(  # alias (first release's name)
    "request_timeout_total", "Alias of kvgate_router_timeouts_total"
)
QUEUE_LEN = LoopGauge("kvgate_router_queue_length", "Requests waiting for capacity in the router")
QUEUE_REJECTED = LoopCounter(
    "kvgate_router_queue_rejected_total", "429s: queue full or wait expired", ["reason"]
)
RETRIES = LoopCounter(
    "kvgate_router_retries_total", "Requests re-sent to another worker before any output"
)
MIGRATIONS = LoopCounter(
    "kvgate_router_migrations_total", "Streams moved to another worker mid-way", ["result"]
)
STREAM_STALLS = LoopCounter(
    "kvgate_router_stream_stalls_total",
    "Streams whose worker went silent after the first token, treated as broken (they migrate) "
    "(bound: predicted = the stall bound from the latency model, idle_timeout = "
    "--stream-idle-timeout)",
    ["bound"],
)
BREAKER = LoopGauge(
    "kvgate_router_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open", ["worker"]
)
BREAKER_OPENINGS = LoopCounter(
    "kvgate_router_breaker_openings_total",
    "Times the worker's circuit opened (the first opening of an incident and each re-opening "
    "after failed half-open trials or a relapse)",
    ["worker"],
)
OUTLIER_EJECTED = LoopGauge(
    "kvgate_router_outlier_ejected",
    "1 while the worker is ejected as a latency outlier",
    ["worker"],
)
OUTLIER_EJECTIONS = LoopCounter(
    "kvgate_router_outlier_ejections_total",
    "Times the worker was ejected as a latency outlier",
    ["worker"],
)
OUTCOMES_DROPPED = LoopCounter(
    "kvgate_router_outcomes_dropped_total",
    "Outcomes not published (buffer_full, publish_error, too_large)",
    ["reason"],
)
POLICY_UPDATES = LoopCounter(
    "kvgate_router_policy_updates_total", "policy.updated notices", ["result"]
)
REPLICAS = LoopCounter(
    "kvgate_router_replicas_total",
    "One-token copies of requests sent to copy a hot prefix to more workers",
    ["outcome"],
)
HOLDS = LoopCounter(
    "kvgate_router_follower_holds_total",
    "Requests held until the request computing their prefix had its first token",
    ["outcome"],
)
HOLD_SECONDS = LoopHistogram(
    "kvgate_router_follower_hold_seconds", "Time requests were held", buckets=LAT_BUCKETS
)
INFLIGHT = LoopGauge("kvgate_router_inflight", "Requests in flight through this router")
WORKERS = LoopGauge("kvgate_router_workers", "Routable workers")
PEER_ROUTERS = LoopGauge(
    "kvgate_router_peer_routers",
    "Other routers heard on the bus (in-flight counts shared with them; see /health)",
)


_children: dict[tuple, object] = {}


PD_REQUESTS = LoopCounter(
    "kvgate_router_pd_requests_total",
    "Disaggregated (P/D) requests by handshake (nixl | bootstrap) and what their prefill did "
    "(prefilled, prefill_failed: retried on another prefill worker or colocated)",
    ["handshake", "result"],
)
PD_PREFILL = LoopHistogram(
    "kvgate_router_pd_prefill_seconds",
    "P/D: time from sending the prefill request to its answer",
    buckets=LAT_BUCKETS,
)
PD_HANDOFF = LoopHistogram(
    "kvgate_router_pd_handoff_seconds",
    "P/D: time from the prefill's answer to the decoder's first token (the KV transfer, the "
    "decoder's queue and its first step)",
    buckets=LAT_BUCKETS,
)
PD_TRANSFER_PREDICTED = LoopHistogram(
    "kvgate_router_pd_transfer_predicted_seconds",
    "P/D: the decision's predicted KV transfer time",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
)


def child(metric, *labels: str):
    """Cached ``metric.labels(*labels)`` (the label lookup is a hot-path cost)."""
    key = (id(metric), labels)
    c = _children.get(key)
    if c is None:
        c = _children[key] = metric.labels(*labels)
    return c


class HitRate:
    """Rolling cached/prompt token ratio over the last ``n`` requests."""

    def __init__(self, kind: str, n: int = 1000) -> None:
        self.kind = kind
        self.window: deque[tuple[int, int]] = deque(maxlen=n)
        self.cached = 0
        self.prompt = 0
        self._cached_c = CACHED_TOKENS.labels(kind)
        # the ratio is computed when scraped, not at every request
        HIT_RATIO.labels(kind).set_function(self.ratio)
        HIT_RATE.labels(kind).set_function(self.ratio)

    def ratio(self) -> float:
        return self.cached / self.prompt if self.prompt else 0.0

    def add(self, cached: int, prompt: int) -> None:
        if len(self.window) == self.window.maxlen:
            c, p = self.window[0]
            self.cached -= c
            self.prompt -= p
        self.window.append((cached, prompt))
        self.cached += cached
        self.prompt += prompt
        self._cached_c.inc(cached)
