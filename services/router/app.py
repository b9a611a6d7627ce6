"""The live router, wired: constructs the parts (see ``services/router/__init__.py`` for the
map), subscribes them to the bus, starts and stops them, and builds the routes of its HTTP ports.

Inputs over NATS: worker heartbeats (capacity, url, model, state), telemetry (WorkerLoad),
worker control (cordon / drain / uncordon), other routers' in-flight counts (RouterLoad),
KV events through the index replica, and ``policy.updated`` (the newest one is read from the
POLICY stream at start). Outputs: the proxied HTTP response, one RouterOutcome per request
(``router.outcomes``), this router's RouterLoad, breaker alerts, Prometheus metrics.

Invariants:
- deciding never waits on the network: it reads local state only;
- every dispatched request holds exactly one ticket on its worker until it ends (in-flight
  counts and KV reservations are released in ``finally``);
- when NATS is down the router keeps routing on its last known state (workers do not time out
  while the bus is down) and nats-py reconnects by itself;
- lifecycle (services.router.readiness): until the router knows the cluster, a request for a
  model not seen yet is answered 503 + Retry-After, never 404; on SIGTERM ``/ready`` answers
  503 at once, the OpenAI port stops accepting and drains for ``--drain-timeout-s``, and the
  bus, index replica and outcome publisher stay up until the drain is over.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import signal
import ssl
import uuid
from collections.abc import Mapping
from typing import Any

import aiohttp
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.common.aio import cancel_and_wait
from services.common.bus import Bus, NatsAuth
from services.common.logging import get_logger
from services.common.replay_guard import DEFAULT_MAX_AGE_S, DEFAULT_MAX_SKEW_S, ReplayGuard
from services.common.schemas import (
    PolicyUpdated,
    RouterLoad,
    TenantsUpdated,
    WorkerControl,
    WorkerHeartbeat,
    WorkerLoad,
)
from services.common.signing import Verifier
from services.common.streams import raise_alert, require_outcomes_stream
from services.common.tenancy import RequestTenancy
from services.common.tokenizer import load_tokenizer
from services.core.cluster import ClusterState
from services.core.flow.prefill_room import DEFAULT_QUANTILE
from services.core.lifecycle import RequestLifecycle
from services.core.policy import DEFAULT_POLICY, build_policy
from services.core.url_pin import DEFAULT_KEEP_DEPARTED_S, UrlPins, parse_allowlist
from services.router import openai_extras
from services.router.admission import Admission
from services.router.breaker import Breaker, breaker_config
from services.router.cache_budget import CacheBudgetGuard
from services.router.canary import PolicySet
from services.router.circuits import Circuits
from services.router.cluster_feed import ClusterFeed
from services.router.debug import DebugViews
from services.router.decide import Decider
from services.router.dispatch import Dispatcher
from services.router.ejection import RouterOutliers, outlier_config
from services.router.flow_control import FlowControl
from services.router.handlers import Handlers
from services.router.holds import FirstTokenWaits
from services.router.http_server import Request, Response, Routes, Server
from services.router.index_feed import make_index_source
from services.router.load_share import LoadSharing
from services.router.metrics import HitRate
from services.router.migrate import Migrator
from services.router.outcomes import OutcomePublisher, OutcomeRecorder
from services.router.pd import PdSender
from services.router.policy_reload import PolicyReload
from services.router.public_surface import (
    operator_on_public_port,
    public_surface,
    server_ssl_context,
    start_operator_http,
    status_only_health,
)
from services.router.readiness import DEFAULT_DRAIN_TIMEOUT_S, Readiness, model_list_gate
from services.router.request_path import RequestPath
from services.router.scaling import ScalingSignal
from services.router.send import Sender
from services.router.signals import CapacitySignal, Spawner
from services.router.sweeper import Sweeper
from services.router.tenant_cache import TenantCacheFeed
from services.router.tenant_identity import TenantDirectory, bearer_key
from services.router.tenant_reload import TenantReload
from services.router.tokenize import RequestParser
from services.router.trust import BusTrust
from services.router.upstream import FastClient

# The young generation is collected after this many new container objects (CPython's default
# is 700). Each young collection walks every young object still alive, and a router under load
# keeps thousands alive in its in-flight requests: at 700 that was one collection per ~40
# requests and ~2 µs of CPU per request at 9,000 requests/s; the router makes almost no cyclic
# garbage, so collecting it rarely costs only memory (docs/benchmarks.md, proxy).
GC_YOUNG_OBJECTS = 10_000


def freeze_startup_heap() -> None:
    """Once started (the router, the EPP): what start-up built lives as long as the process,
    so the collector stops rescanning it (halved the router's garbage-collection CPU under
    load, docs/benchmarks.md), and young collections come every GC_YOUNG_OBJECTS objects."""
    gc.freeze()
    gc.set_threshold(GC_YOUNG_OBJECTS, *gc.get_threshold()[1:])


log = get_logger("router")
_json_decode = msgspec.json.decode


def parse_policy_option(text: str) -> dict[str, Any]:
    """``--policy``: a policy name (``slo_aware``) or a JSON spec (``{"name":..,"params":..}``)."""
    text = (text or "").strip()
    if text.startswith("{"):
        spec = _json_decode(text.encode())
    else:
        spec = {"name": text or DEFAULT_POLICY["name"], "params": {}}
    build_policy(spec)  # validate now: a bad flag fails at start, naming the field
    return spec


class Router:
    """The parts of one router process, wired together; :meth:`start` / :meth:`stop`."""

    def __init__(self, st: Any, bus: Bus, index_source: Any | None = None) -> None:
        self.st = st
        self.bus = bus
        self.router_id: str = st.router_id or f"router-{uuid.uuid4().hex[:8]}"
        self.state = ClusterState(
            worker_timeout=st.worker_timeout,
            telemetry_stale_s=st.telemetry_stale_s,
            pins=UrlPins(
                parse_allowlist(getattr(st, "worker_url_allow", "")),
                keep_departed_s=getattr(st, "worker_pin_keep_s", DEFAULT_KEEP_DEPARTED_S),
            ),
        )
        self.index_source = index_source if index_source is not None else make_index_source(bus)
        self.policies = PolicySet(build_policy(parse_policy_option(st.policy)))
        self.parser = RequestParser(
            load_tokenizer(st.tokenizer),
            st.hash_seed,
            st.default_max_tokens,
            is_lora=self.state.is_lora,
            context_len=lambda model: openai_extras.max_model_len(self.state, model),
        )
        self.lifecycle: RequestLifecycle[asyncio.Event] = RequestLifecycle(
            self.state, FirstTokenWaits()
        )
        self.flow = FlowControl(
            st.queue_size,
            st.queue_timeout,
            self.state.remote_ttl_s,
            bool(getattr(st, "engine_priority", False)),
            protect_quantile=(
                float(getattr(st, "protect_quantile", DEFAULT_QUANTILE))
                if getattr(st, "protect_prefill", False)
                else None
            ),
        )
        self.capacity = CapacitySignal(self.flow)
        self.spawner = Spawner()
        self.fast = FastClient(st.connect_timeout)
        self.session: aiohttp.ClientSession | None = None
        # beside the request path
        self.feed = ClusterFeed(self.state, self.capacity)
        self.load = LoadSharing(
            self.router_id, bus, self.state, self.capacity, st.load_interval, self.flow.quotas
        )
        self.reload = PolicyReload(bus, self.policies)
        self.circuits = Circuits(
            self.router_id,
            bus,
            self.state,
            self.capacity,
            self.spawner,
            breaker_config(st),
        )
        self.sweeper = Sweeper(bus, self.state, self.circuits, self.capacity)
        self.outcomes = OutcomePublisher(bus, maxsize=st.outcome_buffer)
        self.recorder = OutcomeRecorder(self.router_id, self.outcomes)
        # latency outlier ejection: fed by finished requests, evaluated by the sweeper
        self.outliers = RouterOutliers(
            self.router_id, bus, self.state, self.capacity, self.spawner, outlier_config(st)
        )
        self.recorder.outliers = self.sweeper.outliers = self.outliers
        # tenants and their keys, from the admin API (services.router.tenant_identity)
        self.tenants = TenantDirectory(trust_header=bool(getattr(st, "trust_tenant_header", False)))
        # the request path
        self.decider = Decider(self.lifecycle, self.index_source, self.parser)
        self.admission = Admission(self.decider, self.state, self.capacity, st, self.flow)
        self.dispatcher = Dispatcher(
            self.lifecycle, self.load, self.capacity, self.spawner, self.fast, st
        )
        # with --protect-prefill a first token ends a prompt: the room may reopen
        self.dispatcher.wake_on_first_token = self.flow.room is not None
        self.sender = Sender(self.state, self.circuits, self.dispatcher, self.fast, st)
        self.sender.migrator = Migrator(
            self.decider, self.dispatcher, self.sender, self.circuits, st.max_migrations
        )
        self.pd = PdSender(self.state, self.dispatcher, self.sender, self.fast, st)
        self.path = RequestPath(
            self.parser,
            self.policies,
            self.admission,
            self.dispatcher,
            self.sender,
            self.circuits,
            self.recorder,
            st.max_retries,
            max_prompt_chars=getattr(st, "max_prompt_chars", 0),
            pd=self.pd,
        )
        # the scaling signal (kvgate_fleet_engines_needed), fed by the request path
        self.scaling = ScalingSignal(
            self.policies,
            self.state,
            self.capacity,
            getattr(st, "scaling_window", 30.0),
            getattr(st, "scaling_margin", 0.4),
        )
        self.path.scaling = self.dispatcher.scaling = self.recorder.scaling = self.scaling
        self.handlers = Handlers(
            self.router_id,
            self.path,
            self.state,
            bus,
            self.index_source,
            self.policies,
            self.capacity,
        )
        self.debug = DebugViews(
            self.router_id,
            self.state,
            self.index_source,
            self.policies,
            self.circuits,
            self.parser,
            self.decider,
        )
        # what the router believes from the bus (heartbeat subjects, api signatures, revisions)
        self.trust = BusTrust(
            bus.subjects,
            Verifier((getattr(st, "trusted_signers", "") or "").split(",")),
            self.router_id,
            lambda alert: raise_alert(self.bus, alert),
            self.spawner.spawn,
            ReplayGuard(
                getattr(st, "signed_max_age_s", DEFAULT_MAX_AGE_S),
                getattr(st, "signed_max_skew_s", DEFAULT_MAX_SKEW_S),
            ),
        )
        self.feed.reject = self.trust.reject  # a heartbeat moving a pinned worker's URL
        self.tenant_reload = TenantReload(bus, self.tenants, self.trust)
        # identity on the request path, quotas in flow control: both read the directory
        self.path.tenancy_of = self._tenancy_of  # the directory's, cache budgets applied
        self.flow.quota_of = self.tenants.quota_of
        # per-tenant cache ledger: fed once the router knows a tenant
        self.tenant_cache = TenantCacheFeed(bus)
        # cache budgets: a tenant over its budget has its new requests in the sheddable band
        self.cache_budget = CacheBudgetGuard(self.tenant_cache.ledger, self.tenants)
        self.load.cache = self.cache_budget
        self.tenant_reload.on_applied = self._tenants_known
        self.path.cache_claim = self._claim_cache
        # start-up (cluster not known yet: 503, never 404) and drain state; /ready
        self.readiness = Readiness(st.worker_timeout, self.index_source)
        self.admission.starting = self.readiness.starting_refusal
        self._tasks: list[asyncio.Task[Any]] = []
        self._subs: list[Any] = []

    # ------------------------------------------------------------------ views (tests, bench)
    @property
    def queue_len(self) -> int:
        return self.capacity.waiting

    @property
    def waits(self) -> FirstTokenWaits:
        return self.dispatcher.waits

    @property
    def breakers(self) -> dict[str, Breaker]:
        return self.circuits.breakers

    def breaker_state(self, wid: str) -> str:
        return self.circuits.state_of(wid)

    @property
    def policy_applied(self) -> asyncio.Event:
        return self.reload.applied

    @property
    def hit_pred(self) -> HitRate:
        return self.recorder.hit_pred

    @property
    def hit_reported(self) -> HitRate:
        return self.recorder.hit_reported

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True),
            auto_decompress=False,
        )
        self.dispatcher.session = self.sender.session = self.session
        s = self.bus.subjects
        self._subs = [
            await self.bus.subscribe(
                s.heartbeat_all, WorkerHeartbeat, self.trust.guard_heartbeat(self._on_heartbeat)
            ),
            await self.bus.subscribe(s.telemetry_all, WorkerLoad, self.feed.on_load),
            await self.bus.subscribe(
                s.worker_control_all, WorkerControl, self.trust.guard_control(self.feed.on_control)
            ),
            await self.bus.subscribe(s.router_load_all, RouterLoad, self.load.on_router_load),
            await self.bus.subscribe(
                s.policy_updated,
                PolicyUpdated,
                self.trust.guard_policy(self.bus, self.reload.on_policy),
            ),
            await self.bus.subscribe(
                s.tenants_updated, TenantsUpdated, self.tenant_reload.on_tenants
            ),
        ]
        self.readiness.heartbeats_subscribed()
        await self.reload.load_latest(functools.partial(self.trust.stored_policy_ok, self.bus))
        await self.tenant_reload.load_latest()
        if self.tenants.trust_header:  # a gateway may name tenants the directory lacks
            await self.tenant_cache.start()
        await self.index_source.start()
        self.readiness.index_started = True
        self.outcomes.start()
        self._tasks = [
            asyncio.create_task(self.sweeper.run(), name="router-sweep"),
            asyncio.create_task(self.load.run(), name="router-load"),
            # the OUTCOMES stream is checked beside serving, not before it: a stream not yet
            # provisioned (or changed) is waited for, counted and alerted by require_stream,
            # and only the outcomes published meanwhile fail (counted by the publisher)
            asyncio.create_task(self._check_outcomes_stream(), name="router-outcomes-stream"),
        ]

    async def _check_outcomes_stream(self) -> None:
        with contextlib.suppress(Exception):
            await require_outcomes_stream(self.bus)

    def _tenants_known(self) -> None:
        if not self.tenant_cache.active and len(self.tenants):
            self.spawner.spawn(self.tenant_cache.start())

    def request_tenancy(self, headers: Mapping[str, str]) -> RequestTenancy:
        """A request's tenancy (the directory's, from its key or a trusted header) with the
        cache budgets applied: the router's request path and the EPP's picker both take it
        here. Raises TenancyError (an expired key, a bad band)."""
        return self.cache_budget.demote(self.tenants.request_tenancy(headers, bearer_key(headers)))

    def _tenancy_of(self, request: Any) -> RequestTenancy:
        return self.request_tenancy(request.headers)

    def _claim_cache(self, ctx: Any, wid: str) -> None:
        """The prompt's blocks past the worker's overlap: the worker computes them for the
        request's tenant (services.router.tenant_cache)."""
        if not self.tenant_cache.active:
            return
        st = self.state.states.get(wid)
        if st is None or not ctx.tenancy.tenant_id:
            return
        keys = self.parser.keys(ctx.parsed, st.capacity.block_size)
        tenant = self.recorder.tenants.label(ctx.tenancy.flow)
        self.tenant_cache.ledger.claim(wid, tenant, keys[ctx.overlaps.get(wid, 0) :])

    async def _on_heartbeat(self, hb: WorkerHeartbeat, raw: Any) -> None:
        self.readiness.heard(hb.worker_id)
        await self.feed.on_heartbeat(hb, raw)

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        await self.tenant_cache.stop()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await self.outcomes.stop()
        with contextlib.suppress(Exception):
            await self.index_source.stop()
        if self.session is not None:
            await self.session.close()
        await self.fast.close()

    def make_routes(self) -> Routes:
        """The OpenAI port's routes (served by services.router.http_server)."""
        h = self.handlers
        routes = Routes()
        routes.add("POST", "/v1/completions", h.completions)
        routes.add("POST", "/v1/chat/completions", h.chat)
        routes.add("GET", "/v1/models", h.models)
        routes.add("GET", "/health", h.health)
        routes.add("GET", "/ready", self.readiness.handle)
        if operator_on_public_port(self.st):
            self._add_operator_routes(routes)
        openai_extras.add_routes(routes, self.parser, self.state, self.path, self.st)
        return routes

    def operator_routes(self) -> Routes:
        """Health, metrics and debug views: the operator port's (services.router.public_surface)."""
        routes = Routes()
        routes.add("GET", "/health", self.handlers.health)
        routes.add("GET", "/ready", self.readiness.handle)
        self._add_operator_routes(routes)
        return routes

    def _add_operator_routes(self, routes: Routes) -> None:
        routes.add("GET", "/metrics", metrics_handler)
        routes.add("*", "/debug/route", self.debug.h_route)
        routes.add("GET", "/debug/state", self.debug.h_state)


async def metrics_handler(_r: Request) -> Response:
    return Response(generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def start_router_http(
    router: Router,
    host: str,
    port: int,
    shutdown_s: float = 5.0,
    reuse_port: bool = False,
    ssl_context: ssl.SSLContext | None = None,
) -> Server:
    """Serve the router's OpenAI port (https with ``ssl_context``); on stop, in-flight
    requests get ``shutdown_s`` to finish."""
    surface = public_surface(router.st, router.tenants)
    routes = router.make_routes()
    if not operator_on_public_port(router.st):  # the details are the operator port's
        routes.add("GET", "/health", status_only_health(router.handlers.health, surface))
    surface.gate = model_list_gate(router.readiness, router.state.models, router.st.retry_after)
    server = Server(routes, surface, shutdown_s=shutdown_s)
    return await server.start(host, port, ssl_context=ssl_context, reuse_port=reuse_port)


async def serve(st: Any, stop: asyncio.Event) -> None:
    from services.common.subjects import Subjects

    tls = server_ssl_context(getattr(st, "tls_cert", ""), getattr(st, "tls_key", ""))
    # the NATS connection, outcomes and load reports all name this replica by its id
    # (router-<hex> unless --router-id names it)
    st.router_id = st.router_id or f"router-{uuid.uuid4().hex[:8]}"
    bus = Bus(
        st.nats_url,
        st.router_id,
        Subjects(st.subject_prefix),
        auth=NatsAuth.from_settings(st),
        role="router",
    )
    await bus.connect()
    router = Router(st, bus)
    await router.start()
    server = await start_router_http(
        router, st.host, st.port, reuse_port=getattr(st, "reuse_port", False), ssl_context=tls
    )
    operator = await start_operator_http(st, router.operator_routes())
    freeze_startup_heap()
    log.info(
        "router listening",
        host=st.host,
        port=st.port,
        tls=tls is not None,
        router_id=router.router_id,
        policy=router.policies.control.spec,
    )
    await stop.wait()
    await drain(router, server, float(getattr(st, "drain_timeout_s", DEFAULT_DRAIN_TIMEOUT_S)))
    if operator is not None:
        await operator.stop()
    await router.stop()
    await bus.close()


async def drain(router: Router, server: Server, timeout_s: float) -> None:
    """SIGTERM: ``/ready`` 503 at once, no new connection, what is in progress finishes
    within ``timeout_s`` (a second SIGTERM or SIGINT cuts it short); the router's parts keep
    running meanwhile (heartbeats, migration, outcomes)."""
    router.readiness.start_draining()
    cut_now = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, cut_now.set)
    log.info(
        "router draining",
        in_flight=sum(1 for c in server.conns if c.busy),
        drain_timeout_s=timeout_s,
    )
    result = await server.drain(timeout_s, cut_now)
    said = log.warning if result.cut else log.info
    said(
        "router drained",
        in_flight=result.in_flight,
        cut=result.cut,
        seconds=round(result.seconds, 3),
        cut_short=cut_now.is_set(),
    )
