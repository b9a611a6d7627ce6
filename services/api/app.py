"""The admin API service: wiring of Postgres, NATS, background loops and HTTP (I/O shell).

Background loops (each survives Postgres / NATS outages and resumes by itself):
outcome collector + canary evaluator, tenant usage collector, alert manager, worker-control
republisher, policy and tenant directory resync. None of them needs Postgres to be up when the API starts.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from services.api.alerting import AlertManager
from services.api.auth_throttle import AuthThrottle
from services.api.canary.runner import EvaluatorLoop, OutcomeCollector
from services.api.context import ApiContext
from services.api.db import Database
from services.api.framework import install
from services.api.publisher import PolicyPublisher
from services.api.routes import build_routes
from services.api.tenant_cache import TenantCacheView
from services.api.tenants import TenantPublisher
from services.api.tokens import TokenAuth
from services.api.ui import add_static
from services.api.usage import UsageCollector
from services.api.workers import ControlRepublisher, WorkerRegistry
from services.common import tracing
from services.common.aio import cancel_and_wait
from services.common.bus import Bus, NatsAuth
from services.common.logging import RateLimiter, get_logger
from services.common.schemas import PolicyRevisionRequest
from services.common.service import metrics_handler
from services.common.signing import Signer
from services.common.streams import require_policy_stream
from services.common.subjects import Subjects

log = get_logger("api")


@dataclass
class ApiConfig:
    database_url: str
    nats_url: str
    nats_auth: NatsAuth | None = None
    signing_seed: str = ""  # file: sign what the api publishes (services.common.signing)
    subject_prefix: str = ""
    admin_token: str = ""
    token_max_ttl_s: float = 0.0  # > 0: longest lifetime of a new token, and its default
    auth_fail_limit: int = 20  # failed authentications per address and window; 0: no limit
    auth_fail_window_s: float = 60.0
    auth_tracked_addresses: int = 10_000
    eval_interval_s: float = 1.0
    flush_interval_s: float = 0.5
    republish_s: float = 5.0
    # an uncordon is re-sent this long (the routers' --signed-max-age-s): a router that saw
    # neither a drain nor its uncordon must not take a replayed drain for the current order
    uncordon_resend_s: float = 300.0
    cache_budget_tick_s: float = 1.0  # how often tenants' cache budgets are checked (alerts)
    name: str = "api"


def policy_schemas() -> dict[str, dict[str, Any]]:
    from services.core.policy import POLICY_SCHEMAS

    return dict(POLICY_SCHEMAS)


class ApiService:
    """Owns the context and background loops of one API replica."""

    def __init__(self, cfg: ApiConfig) -> None:
        self.cfg = cfg
        self.ctx: ApiContext | None = None
        self.collector: OutcomeCollector | None = None
        self.evaluator: EvaluatorLoop | None = None
        self.alerts: AlertManager | None = None
        self.controls: ControlRepublisher | None = None
        self.usage: UsageCollector | None = None
        self._resync: asyncio.Task[None] | None = None
        self.app: web.Application | None = None

    async def start(self) -> web.Application:
        cfg = self.cfg
        bus = Bus(
            cfg.nats_url, cfg.name, Subjects(cfg.subject_prefix), auth=cfg.nats_auth, role="api"
        )
        if cfg.signing_seed:
            bus.signer = Signer.from_file(cfg.signing_seed)
        await bus.connect()
        db = Database(cfg.database_url)
        publisher = PolicyPublisher(db, bus)
        registry = WorkerRegistry()
        tenant_cache = TenantCacheView(db, bus, tick_s=cfg.cache_budget_tick_s)
        self.ctx = ctx = ApiContext(
            db=db,
            bus=bus,
            publisher=publisher,
            auth=TokenAuth(db, cfg.admin_token),
            registry=registry,
            policy_schemas=policy_schemas(),
            token_max_ttl_s=cfg.token_max_ttl_s,
            tenants=TenantPublisher(db, bus),
            tenant_cache=tenant_cache,
        )
        await registry.subscribe(bus)
        await tenant_cache.start()

        await bus.serve(
            bus.subjects.policy_revision,
            PolicyRevisionRequest,
            publisher.answer_revision,  # with ``repair``: re-publish over a poisoned stream
            queue="api",
        )
        await ctx.decisions.start(bus)
        await require_policy_stream(bus)
        self.collector = OutcomeCollector(db, bus, flush_s=cfg.flush_interval_s)
        await self.collector.start()
        self.usage = UsageCollector(db, bus)
        await self.usage.start()
        self.evaluator = EvaluatorLoop(db, publisher, tick_s=cfg.eval_interval_s, name=cfg.name)
        self.evaluator.start()
        self.alerts = AlertManager(db, bus)
        await self.alerts.start()
        self.controls = ControlRepublisher(
            db, bus, period_s=cfg.republish_s, uncordon_resend_s=cfg.uncordon_resend_s
        )
        self.controls.start()
        self._resync = asyncio.create_task(self._resync_loop(), name="policy-resync")
        app = web.Application(client_max_size=1024 * 1024)
        tracer = tracing.tracer("kvgate.api")
        if tracer is not None:  # a server span per handled request (not scrapes, probes, page)
            app.middlewares.append(
                tracing.aiohttp_middleware(
                    tracer, "api", skip=("/metrics", "/api/v1/health", "/ui")
                )
            )
        throttle = AuthThrottle(
            cfg.auth_fail_limit, cfg.auth_fail_window_s, cfg.auth_tracked_addresses
        )
        install(app, build_routes(ctx), ctx.auth.check, throttle)
        app.router.add_get("/metrics", metrics_handler)
        add_static(app)  # the operator page at /ui/ (its data comes from the routes above)
        ctx.auth.start()  # records the bootstrap token's row once Postgres answers
        self.app = app
        return app

    async def _resync_loop(self) -> None:
        assert self.ctx is not None
        limiter = RateLimiter(60.0)
        while True:
            await asyncio.sleep(self.cfg.republish_s)
            try:
                await self.ctx.publisher.resync()
            except Exception as exc:
                if limiter.allow("resync"):
                    log.warning("policy resync failed", error=repr(exc)[:200])
            try:
                await self.ctx.tenants.resync()
            except Exception as exc:
                if limiter.allow("tenants"):
                    log.warning("tenant directory resync failed", error=repr(exc)[:200])

    async def stop(self) -> None:
        if self._resync is not None:
            await cancel_and_wait([self._resync])
        parts = [
            p for p in (self.evaluator, self.controls, self.alerts, self.collector, self.usage) if p
        ]
        await asyncio.gather(*(p.stop() for p in parts), return_exceptions=True)
        if self.ctx is not None:
            await self.ctx.publisher.close()
            await self.ctx.auth.stop()
            if self.ctx.tenant_cache is not None:
                await self.ctx.tenant_cache.stop()
            await self.ctx.decisions.stop()
            await self.ctx.bus.close()
            await self.ctx.db.close()


async def serve(st, stop: asyncio.Event) -> None:
    from services.common.service import start_http

    service = ApiService(
        ApiConfig(
            database_url=st.database_url,
            nats_url=st.nats_url,
            nats_auth=NatsAuth.from_settings(st),
            signing_seed=st.signing_seed,
            subject_prefix=st.subject_prefix,
            admin_token=st.admin_token,
            token_max_ttl_s=st.token_max_ttl_s,
            auth_fail_limit=st.auth_fail_limit,
            auth_fail_window_s=st.auth_fail_window_s,
            auth_tracked_addresses=st.auth_tracked_addresses,
            eval_interval_s=st.canary_eval_interval_s,
            republish_s=st.republish_s,
            uncordon_resend_s=st.signed_max_age_s,
        )
    )
    app = await service.start()
    runner = await start_http(app, st.host, st.port)
    log.info("admin api listening", url=f"http://{st.host}:{st.port}/api/v1")
    await stop.wait()
    await runner.cleanup()
    await service.stop()
