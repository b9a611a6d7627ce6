"""Whether this router may take traffic: it knows the cluster, and it is not draining.

A router that has just started knows no worker: every heartbeat is still to come, so a
request for a served model looks like a request for a model nobody serves. Until the cluster
is **known** the router answers such requests 503 with ``Retry-After`` (never 404 "model not
served"), and ``/ready`` answers 503. The cluster is known once, since the router subscribed
to heartbeats, either

- one heartbeat interval has passed: some worker's heartbeat was heard twice (a worker that
  heartbeats as often was heard at least once in between), plus a quarter of that interval
  for the delivery jitter between workers; or
- ``worker_timeout`` has passed: every worker the router would count alive has been heard.

A router that got SIGTERM is **draining** (services.router.app ``serve``): ``/ready`` answers
503 at once and for good, while the HTTP server finishes what is in progress
(services.router.http_server ``Server.drain``).

``/ready`` is 200 only when the cluster is known, the index replica has made its first sync
(a snapshot loaded, or no indexer answered within its start timeout: the router then routes
without KV awareness and catches up; the body says ``"index": "catching_up"``), and the router
is not draining. ``/health`` is liveness: 200 while the process serves, draining or not.

Invariant: once known the cluster stays known, and once draining the router never becomes
ready again; both only read local state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import Counter, Gauge

from services.common import settings as S
from services.router.http_server import Request, Response, json_response
from services.router.public_surface import openai_error

# 25 s: the drain and the router's own close (bus, outcomes: < 5 s) end within the 30 s that
# docker compose (stop_grace_period) and Kubernetes (terminationGracePeriodSeconds) wait
# before SIGKILL by default; `kvgate up` waits for the router this long plus a margin
DEFAULT_DRAIN_TIMEOUT_S = 25.0

OPTIONS = (
    S.option(
        "drain_timeout_s",
        DEFAULT_DRAIN_TIMEOUT_S,
        "on SIGTERM: seconds the router keeps answering the requests and streams in progress "
        "(no new connection is accepted, /ready answers 503) before it cuts them and exits; "
        "keep it below the orchestrator's grace period (compose stop_grace_period, k8s "
        "terminationGracePeriodSeconds) minus ~5 s. A second SIGTERM or SIGINT cuts at once",
        env="KVGATE_ROUTER_DRAIN_TIMEOUT_S",
    ),
)

JITTER_FRACTION = 0.25  # of the heartbeat interval, for the spread of workers' phases
# two heartbeats closer than this are a duplicate (a re-sent or relayed one), not an interval
MIN_INTERVAL_S = 0.05

READY = Gauge(
    "kvgate_router_ready",
    "1 when this router answers /ready 200 (cluster known, index synced, not draining)",
)
STARTING_REFUSED = Counter(
    "kvgate_router_starting_refused_total",
    "Requests answered 503 + Retry-After because the router did not know the cluster yet "
    "(a model not seen so far, or the model list)",
)


def index_synced(index_source: Any) -> bool:
    """Has the index replica loaded a snapshot (``ready`` is an Event, or a bool)?"""
    ready = getattr(index_source, "ready", False)
    is_set = getattr(ready, "is_set", None)
    return bool(is_set()) if is_set is not None else bool(ready)


class Readiness:
    """The router's start-up and drain state; see the module docstring."""

    def __init__(
        self,
        worker_timeout_s: float,
        index_source: Any,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.worker_timeout_s = worker_timeout_s
        self.index_source = index_source
        self.clock = clock
        self.index_started = False  # the replica's first sync attempt is over
        self.draining = False
        self._first_heard: dict[str, float] = {}
        self._known_at: float | None = None  # when the cluster counts as known
        self._known = False
        READY.set(0)

    # ------------------------------------------------------------------ inputs
    def heartbeats_subscribed(self) -> None:
        self._known_at = self.clock() + self.worker_timeout_s

    def heard(self, worker_id: str) -> None:
        """A (trusted) heartbeat of ``worker_id`` arrived."""
        if self._known:
            return
        now = self.clock()
        first = self._first_heard.setdefault(worker_id, now)
        interval = now - first
        if interval >= MIN_INTERVAL_S and self._known_at is not None:
            self._known_at = min(self._known_at, now + JITTER_FRACTION * interval)

    def start_draining(self) -> None:
        self.draining = True
        READY.set(0)

    # ------------------------------------------------------------------ views
    def cluster_known(self) -> bool:
        if not self._known:
            at = self._known_at
            self._known = at is not None and self.clock() >= at
            if self._known:
                self._first_heard.clear()
        return self._known

    def ready(self) -> tuple[bool, dict[str, Any]]:
        known = self.cluster_known()
        synced = index_synced(self.index_source)
        ok = known and (synced or self.index_started) and not self.draining
        if self.draining:
            status = "draining"
        elif ok:
            status = "ready"
        else:
            status = "starting"
        READY.set(1 if ok else 0)
        return ok, {
            "status": status,
            "cluster_known": known,
            "index": "ready" if synced else ("catching_up" if self.index_started else "syncing"),
            "draining": self.draining,
        }

    async def handle(self, _r: Request) -> Response:
        """``GET /ready``: 200 ready, else 503 with ``Retry-After`` and the reason."""
        ok, body = self.ready()
        if ok:
            return json_response(body)
        return json_response(body, status=503, headers={"Retry-After": "1"})

    def starting_refusal(self) -> bool:
        """Should a negative answer (a model not seen, the model list) be a 503 for now?
        Counts it when so."""
        if self.cluster_known():
            return False
        STARTING_REFUSED.inc()
        return True


def model_list_gate(
    readiness: Readiness, models: Callable[[], Mapping[str, Any]], retry_after: float
) -> Callable[[Request], Response | None]:
    """A surface gate (services.router.public_surface): while the cluster is not known, a
    negative answer about models may only mean "not heard of yet", so an empty
    ``/v1/models`` list and the card of a model not seen (``/v1/models/<id>``, else 404)
    answer 503 + Retry-After instead. ``models``: the models heard of so far."""
    retry = str(retry_after)

    def gate(request: Request) -> Response | None:
        path = request.path
        if not path.startswith("/v1/models") or readiness.cluster_known():
            return None  # once known, no request pays for models()
        if path == "/v1/models":
            negative = not models()
        elif path.startswith("/v1/models/"):
            negative = path[len("/v1/models/") :] not in models()
        else:
            return None
        if not negative or not readiness.starting_refusal():
            return None
        return openai_error(
            503,
            f"the router is starting and has not heard from every worker yet; "
            f"retry after {retry} s",
            headers={"Retry-After": retry},
        )

    return gate
