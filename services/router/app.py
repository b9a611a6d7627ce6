"""The live router: an OpenAI-compatible proxy around the pure policy core (the I/O shell).

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
  while the bus is down) and nats-py reconnects by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from services.common.aio import cancel_and_wait, wait_event
from services.common.bus import Bus
from services.common.logging import RateLimiter, get_logger
from services.common.schemas import (
    Alert,
    PolicyUpdated,
    RouterLoad,
    RouterOutcome,
    SchemaError,
    WorkerControl,
    WorkerHeartbeat,
    WorkerLoad,
    decode,
)
from services.common.service import metrics_handler
from services.common.streams import ensure_outcomes_stream, ensure_policy_stream, raise_alert
from services.common.tokenizer import load_tokenizer
from services.core.policy import (
    Decision,
    Policy,
    PolicyError,
    RequestInfo,
    build_policy,
    decide,
)
from services.core.policy.types import ClusterSnapshot, replica_id
from services.router import metrics as M
from services.router import slo, sse
from services.router.breaker import STATE_VALUE, Breaker
from services.router.canary import PolicySet, spec_of
from services.router.holds import FirstTokenWaits
from services.router.index_feed import make_index_source
from services.router.proxy import (
    Ctx,
    StreamBroken,
    WorkerFailed,
    read_error,
    replica_body,
    upstream_body,
)
from services.router.state import ClusterState, Ticket
from services.router.tokenize import BadRequest, Parsed, RequestParser
from services.router.upstream import FastClient, UpstreamError

log = get_logger("router")
_json_decode = msgspec.json.decode
SESSION_HEADERS = ("x-session-id", "x-kvgate-session")


def parse_policy_option(text: str) -> dict[str, Any]:
    """``--policy``: a policy name (``kv_aware``) or a JSON spec (``{"name":..,"params":..}``)."""
    text = (text or "").strip()
    if text.startswith("{"):
        spec = _json_decode(text.encode())
    else:
        spec = {"name": text or "kv_aware", "params": {}}
    build_policy(spec)  # validate now: a bad flag fails at start, naming the field
    return spec


def _error(
    status: int, message: str, etype: str, headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": etype, "code": status}},
        status=status,
        headers=headers,
    )


class Router:
    def __init__(self, st: Any, bus: Bus, index_source: Any | None = None) -> None:
        self.st = st
        self.bus = bus
        self.router_id: str = st.router_id or f"router-{uuid.uuid4().hex[:8]}"
        self.state = ClusterState(
            worker_timeout=st.worker_timeout, telemetry_stale_s=st.telemetry_stale_s
        )
        self.index_source = index_source if index_source is not None else make_index_source(bus)
        self.policies = PolicySet(build_policy(parse_policy_option(st.policy)))
        self.parser = RequestParser(
            load_tokenizer(st.tokenizer),
            st.hash_seed,
            st.default_max_tokens,
            is_lora=self.state.is_lora,
        )
        self.breakers: dict[str, Breaker] = {}
        self.queue_len = 0
        self._cap_event = asyncio.Event()
        self._load_dirty = asyncio.Event()
        self._load_seq = 0
        self._tasks: list[asyncio.Task[Any]] = []
        self._bg: set[asyncio.Task[Any]] = set()
        self._subs: list[Any] = []
        self._alert_log = RateLimiter(30.0)
        self._policy_lock = asyncio.Lock()
        self.session: aiohttp.ClientSession | None = None
        from services.router.outcomes import OutcomePublisher

        self.outcomes = OutcomePublisher(bus, maxsize=st.outcome_buffer)
        self.hit_pred = M.HitRate("predicted")
        self.hit_reported = M.HitRate("reported")
        self.policy_applied = asyncio.Event()  # set on each applied policy.updated (tests)
        self.fast = FastClient(st.connect_timeout)
        self.waits = FirstTokenWaits()  # follower holds (Decision.after)
        self._t_stream = aiohttp.ClientTimeout(
            total=None, sock_connect=st.connect_timeout, sock_read=st.stream_idle_timeout
        )
        self._t_whole = aiohttp.ClientTimeout(
            total=st.request_timeout, sock_connect=st.connect_timeout, sock_read=st.request_timeout
        )

    # ================================================================== lifecycle
    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True),
            auto_decompress=False,
        )
        s = self.bus.subjects
        self._subs = [
            await self.bus.subscribe(s.heartbeat_all, WorkerHeartbeat, self._on_heartbeat),
            await self.bus.subscribe(s.telemetry_all, WorkerLoad, self._on_load),
            await self.bus.subscribe(s.worker_control_all, WorkerControl, self._on_control),
            await self.bus.subscribe(s.router_load_all, RouterLoad, self._on_router_load),
            await self.bus.subscribe(s.policy_updated, PolicyUpdated, self._on_policy),
        ]
        with contextlib.suppress(Exception):
            await ensure_outcomes_stream(self.bus)
        await self._load_latest_policy()
        await self.index_source.start()
        self.outcomes.start()
        self._tasks = [
            asyncio.create_task(self._sweeper(), name="router-sweep"),
            asyncio.create_task(self._load_publisher(), name="router-load"),
        ]

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await self.outcomes.stop()
        with contextlib.suppress(Exception):
            await self.index_source.stop()
        if self.session is not None:
            await self.session.close()
        await self.fast.close()

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self.h_completions)
        app.router.add_post("/v1/chat/completions", self.h_chat)
        app.router.add_get("/v1/models", self.h_models)
        app.router.add_get("/health", self.h_health)
        app.router.add_get("/metrics", metrics_handler)
        app.router.add_route("*", "/debug/route", self.h_debug_route)
        app.router.add_get("/debug/state", self.h_debug_state)
        return app

    # ================================================================== bus inputs
    async def _on_heartbeat(self, hb: WorkerHeartbeat, _raw: Any) -> None:
        if self.state.on_heartbeat(hb, time.monotonic()):
            log.info("worker up", worker=hb.worker_id, url=hb.url, model=hb.model)
            self._notify_capacity()

    async def _on_load(self, load: WorkerLoad, _raw: Any) -> None:
        self.state.on_load(load, time.monotonic())
        if self.queue_len:
            self._notify_capacity()

    async def _on_control(self, ctl: WorkerControl, _raw: Any) -> None:
        self.state.on_control(ctl, time.monotonic())
        log.info("worker control", worker=ctl.worker_id, action=ctl.action, by=ctl.by)
        self._notify_capacity()

    async def _on_router_load(self, rl: RouterLoad, _raw: Any) -> None:
        if rl.router_id == self.router_id:
            return
        self.state.on_router_load(rl.router_id, rl.inflight, rl.pending_prefill, time.monotonic())
        if self.queue_len:
            self._notify_capacity()

    async def _on_policy(self, msg: PolicyUpdated, _raw: Any) -> None:
        self._apply_policy(msg)

    def _apply_policy(self, msg: PolicyUpdated) -> bool:
        try:
            applied = self.policies.apply(msg)
        except PolicyError as exc:
            M.POLICY_UPDATES.labels("invalid").inc()
            log.error("policy.updated rejected", revision=msg.revision, error=str(exc))
            return False
        if applied:
            M.POLICY_UPDATES.labels("applied").inc()
            log.info(
                "policy applied",
                revision=msg.revision,
                policy=spec_of(msg.name, msg.spec),
                canary=msg.canary.canary_id if msg.canary else None,
            )
            self.policy_applied.set()
            self.policy_applied = asyncio.Event()
        else:
            M.POLICY_UPDATES.labels("stale").inc()
        return applied

    async def _load_latest_policy(self) -> None:
        """At start: the newest notice kept by the POLICY stream, if any (else --policy)."""
        try:
            stream = await ensure_policy_stream(self.bus)
            raw = await self.bus.js.get_last_msg(stream, self.bus.subjects.policy_updated)
        except Exception as exc:  # no message yet, or JetStream unavailable
            log.info(
                "no published policy; using --policy",
                policy=self.policies.control.spec,
                why=type(exc).__name__,
            )
            return
        try:
            self._apply_policy(decode(PolicyUpdated, raw.data))
        except SchemaError as exc:
            log.error("stored policy notice is invalid", error=str(exc))

    # ================================================================== background
    def _notify_capacity(self) -> None:
        if not self.queue_len:
            return
        ev = self._cap_event
        self._cap_event = asyncio.Event()
        ev.set()

    def _mark_load_dirty(self) -> None:
        self._load_dirty.set()

    async def _load_publisher(self) -> None:
        """Publish this router's in-flight counts on change (coalesced) and every interval."""
        while True:
            await wait_event(self._load_dirty, self.st.load_interval)
            self._load_dirty.clear()
            if not self.bus.is_connected:
                continue
            self._load_seq += 1
            msg = RouterLoad(
                router_id=self.router_id,
                ts=time.time(),
                seq=self._load_seq,
                inflight=self.state.local_inflight(),
                pending_prefill=self.state.local_prefill(),
            )
            try:
                await self.bus.publish(self.bus.subjects.router_load(self.router_id), msg)
            except Exception as exc:
                if self._alert_log.allow("load"):
                    log.warning("router load publish failed", error=repr(exc))
            await asyncio.sleep(0.005)  # coalesce bursts: at most ~200 load messages/s

    async def _sweeper(self) -> None:
        """Every 100 ms: age state (frozen while NATS is down), tick breakers, probe."""
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            if not self.bus.is_connected:
                self.state.keep_alive(now)  # keep serving from last known state while down
            if self.state.sweep(now):
                self._notify_capacity()
            M.WORKERS.set(self.state.routable_count())
            for wid, br in list(self.breakers.items()):
                before = br.state
                if br.tick(now) == "half_open" and not br.probing:
                    br.start_probe()
                    self.state.set_breaker_open(wid, True)
                    self._spawn(self._probe(wid))
                if before != br.state:
                    M.BREAKER.labels(wid).set(STATE_VALUE[br.state])

    async def _probe(self, wid: str) -> None:
        """Half-open probe: GET /health on the worker; success closes the breaker."""
        ws = self.state.states.get(wid)
        ok = False
        if ws is not None and self.session is not None:
            try:
                async with self.session.get(
                    ws.url + "/health",
                    timeout=aiohttp.ClientTimeout(total=self.st.connect_timeout + 1),
                ) as r:
                    ok = r.status == 200
            except Exception:
                ok = False
        if ok:
            self._breaker_success(wid)
        else:
            self._breaker_failure(wid, "health probe failed")

    def _spawn(self, coro: Any) -> None:
        """Fire-and-forget task, referenced until done (so it cannot be garbage-collected)."""
        t = asyncio.create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    # ================================================================== breakers
    def breaker_state(self, wid: str) -> str:
        br = self.breakers.get(wid)
        return "closed" if br is None else br.state

    def _breaker(self, wid: str) -> Breaker:
        br = self.breakers.get(wid)
        if br is None:
            br = self.breakers[wid] = Breaker(
                threshold=self.st.breaker_threshold, open_s=self.st.breaker_open_s
            )
            M.BREAKER.labels(wid).set(0)
        return br

    def _breaker_success(self, wid: str) -> None:
        br = self.breakers.get(wid)
        if br is None or (br.state == "closed" and br.failures == 0):
            return
        was = br.state
        br.success()
        if was != "closed":
            self.state.set_breaker_open(wid, False)
            M.BREAKER.labels(wid).set(0)
            log.info("circuit closed", worker=wid)
            self._alert(wid, "resolved", f"worker {wid} answers again; circuit closed")
            self._notify_capacity()

    def _breaker_failure(self, wid: str, reason: str) -> None:
        br = self._breaker(wid)
        was = br.state
        br.failure(time.monotonic())
        if br.state == "open":
            self.state.set_breaker_open(wid, True)
            M.BREAKER.labels(wid).set(2)
            if was == "closed":
                log.warning("circuit opened", worker=wid, reason=reason, failures=br.failures)
                self._alert(
                    wid,
                    "firing",
                    f"circuit open for worker {wid} after {br.failures} consecutive failures ({reason})",
                )

    def _alert(self, wid: str, state: str, summary: str) -> None:
        alert = Alert(
            fingerprint=f"circuit_open:{wid}",
            kind="circuit_open",
            severity="warning",
            state=state,  # type: ignore[arg-type]
            source="router",
            worker_id=wid,
            summary=summary,
            remedy="The router stopped sending new requests to this worker and probes it; "
            "check the engine's logs and health. Requests in flight were retried or migrated.",
            details={"router_id": self.router_id},
        )

        async def send() -> None:
            try:
                await raise_alert(self.bus, alert)
            except Exception as exc:
                if self._alert_log.allow(wid):
                    log.warning("alert not sent", worker=wid, error=repr(exc))

        self._spawn(send())

    # ================================================================== deciding
    def _overlaps(
        self, parsed: Parsed, states: dict, keys: tuple[int, ...] = (), keys_bs: int = 0
    ) -> dict[str, int]:
        """Leading matched blocks per worker: from ``keys`` (the prompt's whole chain at block
        size ``keys_bs``) when the caller already hashed it, else hashing lazily (stops where
        no worker matches)."""
        index = self.index_source.index
        sizes = self.state.block_sizes
        if not sizes:
            return {}
        match = getattr(index, "match_prompt", None)

        def one(bs: int) -> dict[str, int]:
            if keys and bs == keys_bs:
                return index.find_matches(keys)
            if match is not None:
                return match(parsed.token_ids, bs, parsed.seed)
            return index.find_matches(self.parser.keys(parsed, bs))

        if len(sizes) == 1:
            return one(next(iter(sizes)))
        out: dict[str, int] = {}
        for bs in sorted(sizes):
            for wid, n in one(bs).items():
                s = states.get(wid)
                if s is not None and s.capacity.block_size == bs:
                    out[wid] = n
        return out

    def decide_for(
        self,
        parsed: Parsed,
        request_id: str,
        session_id: str | None,
        policy: Policy,
        excluded: set[str],
        slo_targets: slo.SloTargets = slo.NO_TARGETS,
    ) -> tuple[Decision, dict[str, int]]:
        states = self.state.states
        if excluded:
            states = {k: v for k, v in states.items() if k not in excluded}
        keys: tuple[int, ...] = ()
        bs = 0
        if policy.params.get("routed_ttl") and len(self.state.block_sizes) == 1:
            # only policies that remember where they sent a prefix need the full key chain;
            # hashed once, it also answers the index match (no second hashing of the prompt)
            bs = next(iter(self.state.block_sizes))
            keys = tuple(self.parser.keys(parsed, bs))
        overlaps = self._overlaps(parsed, states, keys, bs)
        req = RequestInfo(
            request_id=request_id,
            model=parsed.model,
            prompt_tokens=len(parsed.token_ids),
            max_tokens=parsed.max_tokens,
            block_keys=keys,
            session_id=session_id,
            slo_ttft_s=slo_targets.ttft_s,
            slo_tpot_s=slo_targets.tpot_s,
        )
        now = time.monotonic()  # the policy's clock (prefill progress), as in first_token
        if excluded:
            snap = ClusterSnapshot(states, now)
        else:
            snap = self.state.snapshot
            snap.now = now
        return decide(policy, req, snap, overlaps), overlaps

    # ================================================================== HTTP
    async def h_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(request, chat=False)

    async def h_chat(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(request, chat=True)

    async def h_models(self, _r: web.Request) -> web.Response:
        now = int(time.time())
        data = [
            {"id": m, "object": "model", "created": now, "owned_by": "kvgate", "workers": n}
            for m, n in sorted(self.state.models().items())
        ]
        return web.json_response({"object": "list", "data": data})

    async def h_health(self, _r: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok",
                "router_id": self.router_id,
                "workers": self.state.routable_count(),
                "nats": self.bus.is_connected,
                "index_ready": bool(getattr(self.index_source, "ready", False)),
                "policy": self.policies.control.name,
                "policy_revision": self.policies.revision,
                "queue_length": self.queue_len,
            }
        )

    async def h_debug_state(self, _r: web.Request) -> web.Response:
        workers = {}
        for wid, s in sorted(self.state.states.items()):
            workers[wid] = {
                "url": s.url,
                "model": s.model,
                "routable": s.routable,
                "healthy": s.healthy,
                "cordoned": s.cordoned,
                "draining": s.draining,
                "circuit": self.breaker_state(wid),
                "inflight": s.inflight,
                "pending_prefill_tokens": s.pending_prefill_tokens,
                "kv_blocks_free": s.kv_blocks_free,
                "kv_usage": s.kv_usage,
                "telemetry_stale": s.telemetry_stale,
                "indexed_blocks": self.index_source.index.blocks_of(wid),
            }
        return web.json_response(
            {"router_id": self.router_id, "policy": self.policies.describe(), "workers": workers}
        )

    async def h_debug_route(self, request: web.Request) -> web.Response:
        """Explain a decision without sending anything: body (or query) like a request."""
        try:
            if request.can_read_body:
                body = _json_decode(await request.read())
            else:
                q = request.query
                body = {"prompt": q.get("prompt", ""), "model": q.get("model", "")}
                if "max_tokens" in q:
                    body["max_tokens"] = int(q["max_tokens"])
            chat = isinstance(body, dict) and "messages" in body
            parsed = await self.parser.parse(body, chat)
        except (BadRequest, msgspec.DecodeError, ValueError) as exc:
            return _error(400, f"bad request: {exc}", "invalid_request_error")
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        session_id = self._session_of(request, parsed)
        arm = self.policies.arm(rid, session_id)
        # decide on a copy of the policy state so explaining does not advance counters / RNG
        import copy

        policy = copy.copy(arm.policy)
        policy.state = copy.deepcopy(arm.policy.state)
        d, overlaps = self.decide_for(parsed, rid, session_id, policy, set())
        return web.json_response(
            {
                "request_id": rid,
                "policy": policy.name,
                "policy_version": policy.version,
                "params": policy.params,
                "arm": arm.name,
                "canary_id": arm.canary_id,
                "worker": d.worker_id,
                "reason": d.reason,
                "wait": d.wait,
                "never_fits": d.never_fits,
                "scores": d.scores,
                "overlap_blocks": overlaps,
                "predicted_cached_tokens": d.cached_tokens,
                "replicate_to": list(d.replicate_to),
                "after": d.after,
                "hold_s": d.hold_s,
                "filtered": d.filtered,
                "prompt_tokens": len(parsed.token_ids),
                "max_tokens": parsed.max_tokens,
            }
        )

    @staticmethod
    def _session_of(request: web.Request, parsed: Parsed) -> str | None:
        for h in SESSION_HEADERS:
            v = request.headers.get(h)
            if v:
                return v
        return None

    # ================================================================== the request path
    async def handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        t0 = time.perf_counter()
        try:
            body = _json_decode(await request.read())
            parsed = await self.parser.parse(body, chat)
        except msgspec.DecodeError as exc:
            return _error(400, f"request body is not valid JSON: {exc}", "invalid_request_error")
        except BadRequest as exc:
            return _error(400, str(exc), "invalid_request_error")
        try:
            targets = slo.parse(request.headers)
        except slo.BadSloHeader as exc:
            return _error(400, str(exc), "invalid_request_error")
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        session_id = self._session_of(request, parsed)
        arm = self.policies.arm(rid, session_id)
        ctx = Ctx(rid, parsed, arm, session_id, t0, request.path, slo=targets)
        so = parsed.body.get("stream_options")
        ctx.client_wants_usage = isinstance(so, dict) and bool(so.get("include_usage"))
        M.INFLIGHT.inc()
        try:
            return await self._route_and_send(request, ctx)
        finally:
            M.INFLIGHT.dec()
            self._finish(ctx)

    def _finish(self, ctx: Ctx) -> None:
        e2e = time.perf_counter() - ctx.t0
        pol = ctx.arm.policy.name
        M.child(M.REQUESTS, pol, ctx.worker_id or "none", ctx.status).inc()
        slo.record(
            pol,
            slo.result(
                ctx.slo,
                ctx.arm.policy.params,
                ctx.status,
                ctx.ttft,
                e2e,
                ctx.completion_tokens,
                ctx.shed,
            ),
        )
        if ctx.status == "ok":
            M.child(M.E2E, pol).observe(e2e)
            if ctx.ttft is not None:
                M.child(M.TTFT, pol).observe(ctx.ttft)
            prompt = len(ctx.parsed.token_ids)
            M.PROMPT_TOKENS.inc(prompt)
            self.hit_pred.add(ctx.predicted_cached, prompt)
            if ctx.cached_reported is not None:
                self.hit_reported.add(ctx.cached_reported, prompt)
        elif ctx.status == "timeout":
            M.TIMEOUTS.inc()
        self.outcomes.submit(
            RouterOutcome(
                request_id=ctx.request_id,
                router_id=self.router_id,
                ts=time.time(),
                policy=pol,
                policy_version=ctx.arm.policy_version,
                arm=ctx.arm.name,  # type: ignore[arg-type]
                canary_id=ctx.arm.canary_id,
                model=ctx.parsed.model,
                worker_id=ctx.worker_id,
                status=ctx.status,  # type: ignore[arg-type]
                http_status=ctx.http_status,
                prompt_tokens=len(ctx.parsed.token_ids),
                completion_tokens=ctx.completion_tokens,
                predicted_cached_tokens=ctx.predicted_cached,
                cached_tokens=ctx.cached_reported,
                ttft_s=ctx.ttft,
                e2e_s=e2e,
                retries=ctx.retries,
                migrated=ctx.migrated,
                stream=ctx.parsed.stream,
            )
        )

    def _reject(
        self, ctx: Ctx, status: int, message: str, etype: str, st: str, headers=None
    ) -> web.Response:
        ctx.status, ctx.http_status = st, status
        return _error(status, message, etype, headers)

    async def _decide_or_wait(self, ctx: Ctx) -> Decision | web.Response:
        """A decision with a worker, or the error response (400 / 404 / 429 / 503)."""
        deadline = None
        queued = False
        try:
            while True:
                td = time.perf_counter()
                d, ctx.overlaps = self.decide_for(
                    ctx.parsed,
                    ctx.request_id,
                    ctx.session_id,
                    ctx.arm.policy,
                    ctx.excluded,
                    ctx.slo,
                )
                M.DECISION.observe(time.perf_counter() - td)
                if d.worker_id is not None:
                    return d
                if d.shed:  # the policy predicts no worker meets the request's SLO
                    ctx.shed = True
                    return self._reject(
                        ctx,
                        429,
                        d.reason,
                        "rate_limit_error",
                        "rejected",
                        {"Retry-After": str(self.st.retry_after)},
                    )
                if d.never_fits:
                    return self._reject(ctx, 400, d.never_fits, "invalid_request_error", "rejected")
                if not d.wait and ctx.last_failure is not None:
                    f = ctx.last_failure
                    return self._reject(
                        ctx,
                        504 if f.timeout else 502,
                        f"every worker that could serve the request failed; last: {f}",
                        "upstream_error",
                        "timeout" if f.timeout else "error",
                    )
                if not d.wait:
                    if ctx.parsed.model and ctx.parsed.model not in {
                        s.model for s in self.state.states.values()
                    }:
                        return self._reject(
                            ctx,
                            404,
                            f"model {ctx.parsed.model!r} is not served by any worker",
                            "not_found_error",
                            "rejected",
                        )
                    return self._reject(
                        ctx,
                        503,
                        f"no worker available: {d.reason}",
                        "service_unavailable",
                        "error",
                        {"Retry-After": str(self.st.retry_after)},
                    )
                # every worker is at capacity: wait in the bounded queue
                if not queued:
                    if self.queue_len >= self.st.queue_size:
                        M.QUEUE_REJECTED.labels("full").inc()
                        return self._reject(
                            ctx,
                            429,
                            f"router queue full ({self.st.queue_size} waiting)",
                            "rate_limit_error",
                            "rejected",
                            {"Retry-After": str(self.st.retry_after)},
                        )
                    queued = True
                    self.queue_len += 1
                    M.QUEUE_LEN.set(self.queue_len)
                    deadline = time.monotonic() + self.st.queue_timeout
                left = deadline - time.monotonic()  # type: ignore[operator]
                if left <= 0:
                    M.QUEUE_REJECTED.labels("timeout").inc()
                    return self._reject(
                        ctx,
                        429,
                        f"no worker could take the request within {self.st.queue_timeout}s "
                        f"(all at capacity: {'; '.join(f'{k}: {v}' for k, v in sorted(d.filtered.items())[:8])})",
                        "rate_limit_error",
                        "rejected",
                        {"Retry-After": str(max(1, math.ceil(self.st.retry_after)))},
                    )
                await wait_event(self._cap_event, min(left, 0.5))
        finally:
            if queued:
                self.queue_len -= 1
                M.QUEUE_LEN.set(self.queue_len)

    async def _route_and_send(self, request: web.Request, ctx: Ctx) -> web.StreamResponse:
        last_error = "no attempt"
        while True:
            d = await self._decide_or_wait(ctx)
            if isinstance(d, web.Response):
                return d
            wid = d.worker_id
            assert wid is not None
            ctx.worker_id = wid
            ctx.predicted_cached = d.cached_tokens
            ticket = self.state.reserve(
                wid, len(ctx.parsed.token_ids), ctx.parsed.max_tokens, d.cached_tokens, time.time()
            )
            self._mark_load_dirty()
            self.waits.sent(ctx.request_id)
            for rw in d.replicate_to:
                self._spawn(self._replicate(ctx, rw))
            try:
                if d.after is not None:
                    await self._hold(d.after, d.hold_s)
                return await self._send(request, ctx, ticket)
            except WorkerFailed as exc:
                last_error = exc.reason
                ctx.last_failure = exc
                self._breaker_failure(exc.worker_id, exc.reason)
                ctx.excluded.add(exc.worker_id)
                if ctx.retries >= self.st.max_retries:
                    st = "timeout" if exc.timeout else "error"
                    code = 504 if exc.timeout else 502
                    return self._reject(
                        ctx,
                        code,
                        f"worker failed after {ctx.retries} retries: {last_error}",
                        "upstream_error",
                        st,
                    )
                ctx.retries += 1
                M.RETRIES.inc()
                log.info(
                    "retrying on another worker",
                    request_id=ctx.request_id,
                    failed=wid,
                    reason=exc.reason,
                )
            finally:
                self.waits.done(ctx.request_id)
                self.state.release(ticket)
                self._mark_load_dirty()
                self._notify_capacity()

    def _first_token(self, ctx: Ctx, ticket: Ticket) -> None:
        if ticket.prefilling:
            self.state.first_token(ticket, time.monotonic())
            self.waits.done(ctx.request_id)

    async def _hold(self, after: str, hold_s: float) -> None:
        """Follower hold: wait for ``after``'s first token (it computes the prefix this request
        needs on the same worker) so the engine does not start both in one step."""
        t0 = time.perf_counter()
        outcome = await self.waits.wait(after, hold_s)
        if outcome != "none":
            M.child(M.HOLDS, outcome).inc()
            M.HOLD_SECONDS.observe(time.perf_counter() - t0)

    async def _replicate(self, ctx: Ctx, wid: str) -> None:
        """Hot-prefix replication: a one-token copy of the request to ``wid``, counted there
        like any request, so that worker computes the prefix before users need it there.
        Best effort: a failure is counted and logged, the user's request is unaffected."""
        s = self.state.states.get(wid)
        if s is None or self.session is None:
            M.child(M.REPLICAS, "skipped").inc()
            return
        rid = replica_id(ctx.request_id, wid)
        cached = min(ctx.overlaps.get(wid, 0) * s.capacity.block_size, len(ctx.parsed.token_ids))
        ticket = self.state.reserve(wid, len(ctx.parsed.token_ids), 1, cached, time.time())
        self._mark_load_dirty()
        self.waits.sent(rid)
        body = replica_body(ctx)
        headers = {"x-request-id": rid}
        outcome = "ok"
        try:
            if s.url.startswith("http://"):
                resp = await self.fast.post(s.url, ctx.path, body, headers, self.st.request_timeout)
                status = resp.status
            else:
                async with self.session.post(
                    s.url + ctx.path,
                    data=body,
                    headers={"Content-Type": "application/json", **headers},
                    timeout=self._t_whole,
                ) as r:
                    await r.read()
                    status = r.status
            if status >= 400:
                outcome = "error"
                log.warning("replica failed", request_id=rid, worker=wid, status=status)
            else:
                self.state.first_token(ticket, time.monotonic())
        except (UpstreamError, aiohttp.ClientError, OSError, TimeoutError) as exc:
            outcome = "error"
            log.warning("replica failed", request_id=rid, worker=wid, error=str(exc))
        finally:
            M.child(M.REPLICAS, outcome).inc()
            self.waits.done(rid)
            self.state.release(ticket)
            self._mark_load_dirty()
            self._notify_capacity()

    def _headers(self, ctx: Ctx, wid: str) -> dict[str, str]:
        return {
            "x-kvgate-worker": wid,
            "x-kvgate-policy": ctx.arm.policy.name,
            "x-kvgate-arm": ctx.arm.name,
            "x-request-id": ctx.request_id,
        }

    async def _post(
        self, ctx: Ctx, wid: str, path: str, body: bytes, raw: bytes
    ) -> aiohttp.ClientResponse:
        """Open the upstream request; connect errors, timeouts and 503 raise WorkerFailed."""
        assert self.session is not None
        url = self.state.states[wid].url + path
        timeout = self._t_stream if ctx.parsed.stream else self._t_whole
        try:
            resp = await self.session.post(
                url,
                data=body or raw,
                headers={"Content-Type": "application/json", "x-request-id": ctx.request_id},
                timeout=timeout,
            )
        except TimeoutError as exc:
            raise WorkerFailed(wid, "timeout before response", timeout=True) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise WorkerFailed(wid, f"connect failed: {type(exc).__name__}") from exc
        if resp.status == 503 or resp.status >= 500:
            detail = (await read_error(resp))[:200].decode("utf-8", "replace")
            resp.release()
            if resp.status == 503:
                raise WorkerFailed(wid, f"503 from worker: {detail}")
            # other 5xx: counts against the breaker, passed through to the client
            self._breaker_failure(wid, f"{resp.status} from worker")
            raise _Upstream5xx(resp.status, detail)
        return resp

    async def _send(self, request: web.Request, ctx: Ctx, ticket: Ticket) -> web.StreamResponse:
        wid = ticket.worker_id
        raw_body = upstream_body(ctx, migrate=False)
        if not ctx.parsed.stream and self.state.states[wid].url.startswith("http://"):
            return await self._send_fast(ctx, wid, raw_body or await request.read(), ticket)
        try:
            resp = await self._post(ctx, wid, ctx.path, raw_body, await request.read())
        except _Upstream5xx as exc:
            ctx.status, ctx.http_status = "error", exc.status
            return _error(
                exc.status,
                f"worker {wid} failed: {exc.detail}",
                "upstream_error",
                self._headers(ctx, wid),
            )
        if not ctx.parsed.stream or resp.status != 200:
            return await self._send_whole(ctx, wid, resp, ticket)
        return await self._send_stream(request, ctx, wid, resp, ticket)

    async def _send_fast(self, ctx: Ctx, wid: str, body: bytes, ticket: Ticket) -> web.Response:
        """Non-streaming: one request / response on a kept-alive connection (upstream.py)."""
        try:
            resp = await self.fast.post(
                self.state.states[wid].url,
                ctx.path,
                body,
                {"x-request-id": ctx.request_id},
                self.st.request_timeout,
            )
        except UpstreamError as exc:
            if exc.kind == "timeout":
                raise WorkerFailed(wid, "timeout before response", timeout=True) from exc
            if exc.kind == "connect":
                raise WorkerFailed(wid, f"connect failed: {exc.detail}") from exc
            raise WorkerFailed(wid, f"response broken: {exc.detail}") from exc
        status = resp.status
        if status == 503:
            raise WorkerFailed(
                wid, f"503 from worker: {resp.body[:200].decode('utf-8', 'replace')}"
            )
        if status >= 500:
            self._breaker_failure(wid, f"{status} from worker")
            ctx.status = "error"
        else:
            self._breaker_success(wid)
            if status >= 400:
                ctx.status = "error"
        self._first_token(ctx, ticket)
        ctx.http_status = status
        if status < 400:
            try:
                usage = _json_decode(resp.body).get("usage") or {}
                ctx.completion_tokens = int(usage.get("completion_tokens") or 0)
                ctx.cached_reported = sse.cached_tokens_of(usage)
            except Exception:
                pass
        headers = self._headers(ctx, wid)
        headers["Content-Type"] = resp.headers.get("content-type", "application/json")
        return web.Response(body=resp.body, status=status, headers=headers)

    async def _send_whole(
        self, ctx: Ctx, wid: str, resp: aiohttp.ClientResponse, ticket: Ticket
    ) -> web.Response:
        try:
            data = await resp.read()
        except TimeoutError as exc:
            raise WorkerFailed(wid, "timeout reading response", timeout=True) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise WorkerFailed(wid, f"response broken: {type(exc).__name__}") from exc
        finally:
            resp.release()
        self._first_token(ctx, ticket)
        self._breaker_success(wid)
        ctx.http_status = resp.status
        if resp.status >= 400:
            ctx.status = "error"
        else:
            try:
                usage = _json_decode(data).get("usage") or {}
                ctx.completion_tokens = int(usage.get("completion_tokens") or 0)
                ctx.cached_reported = sse.cached_tokens_of(usage)
            except Exception:
                pass
        headers = self._headers(ctx, wid)
        return web.Response(
            body=data,
            status=resp.status,
            headers={
                **headers,
                "Content-Type": resp.headers.get("Content-Type", "application/json"),
            },
        )

    async def _send_stream(
        self, request: web.Request, ctx: Ctx, wid: str, resp: aiohttp.ClientResponse, ticket: Ticket
    ) -> web.StreamResponse:
        out = web.StreamResponse(
            status=200,
            headers={
                **self._headers(ctx, wid),
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
            },
        )
        ctx.out = out
        try:
            await self._pump(request, ctx, wid, resp, ticket, reframe=False)
        except StreamBroken as exc:
            await self._migrate(request, ctx, exc)
        except ClientGone:
            ctx.status, ctx.http_status = "cancelled", 499
        return out

    async def _pump(
        self,
        request: web.Request,
        ctx: Ctx,
        wid: str,
        resp: aiohttp.ClientResponse,
        ticket: Ticket,
        reframe: bool,
    ) -> None:
        """Copy SSE events from the worker to the client until [DONE]."""
        out = ctx.out
        assert out is not None
        chat = ctx.parsed.chat
        buf: list[bytes] = []
        seen_done = False
        try:
            async for line in resp.content:
                if line.strip():
                    buf.append(line)
                    continue
                if not buf:
                    continue
                event = b"".join(buf) + b"\n"
                buf = []
                payload = b"".join(
                    ln[5:].lstrip() for ln in event.split(b"\n") if ln.startswith(b"data:")
                )
                info = sse.inspect(payload, chat if not reframe else False)
                if info.done:
                    seen_done = True
                    if not out.prepared:
                        await out.prepare(request)
                    await _write(out, sse.DONE)
                    break
                if info.usage is not None:
                    ctx.cached_reported = sse.cached_tokens_of(info.usage)
                    if isinstance(info.usage.get("completion_tokens"), int):
                        ctx.completion_tokens = info.usage["completion_tokens"] + (
                            ctx.completion_tokens if reframe else 0
                        )
                if info.usage_only and not ctx.client_wants_usage:
                    continue
                if info.text and ctx.ttft is None:
                    ctx.ttft = time.perf_counter() - ctx.t0
                if info.text:
                    self._first_token(ctx, ticket)
                ctx.generated += info.text
                if reframe:
                    chunk = sse.as_client_chunk(info, chat, ctx.template)
                    if chunk is None:
                        continue
                    event = sse.event(chunk)
                elif ctx.template is None and info.data is not None:
                    ctx.template = info.data
                if not out.prepared:
                    await out.prepare(request)
                await _write(out, event)
        except TimeoutError as exc:
            resp.release()
            if not out.prepared:
                raise WorkerFailed(wid, "stream stalled before output", timeout=True) from exc
            raise StreamBroken(wid, "stream stalled") from exc
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, OSError) as exc:
            resp.release()
            if isinstance(exc, ConnectionResetError) and request.transport is None:
                raise
            if not out.prepared:
                raise WorkerFailed(
                    wid, f"stream broken before output: {type(exc).__name__}"
                ) from exc
            raise StreamBroken(wid, f"stream broken: {type(exc).__name__}") from exc
        resp.release()
        if not seen_done:
            if not out.prepared:
                raise WorkerFailed(wid, "stream ended before output")
            raise StreamBroken(wid, "stream ended without [DONE]")
        self._breaker_success(wid)
        await out.write_eof()

    async def _migrate(self, request: web.Request, ctx: Ctx, exc: StreamBroken) -> None:
        """Continue the client's stream on another worker from prompt + generated text."""
        broken = exc
        while True:
            self._breaker_failure(broken.worker_id, broken.reason)
            ctx.excluded.add(broken.worker_id)
            out = ctx.out
            assert out is not None
            if ctx.migrated >= self.st.max_migrations:
                M.MIGRATIONS.labels("gave_up").inc()
                ctx.status, ctx.http_status = "error", 502
                with contextlib.suppress(Exception):
                    await out.write(
                        sse.event(
                            {
                                "error": {
                                    "message": f"worker failed mid-stream: {broken.reason}",
                                    "type": "upstream_error",
                                }
                            }
                        )
                    )
                    await out.write_eof()
                return
            ctx.migrated += 1
            gen_tokens = len(self.parser.tokenizer.encode(ctx.generated)) if ctx.generated else 0
            ctx.completion_tokens = gen_tokens
            remaining = ctx.parsed.max_tokens - gen_tokens
            log.info(
                "migrating stream",
                request_id=ctx.request_id,
                failed=broken.worker_id,
                generated_tokens=gen_tokens,
            )
            if remaining <= 0:
                M.MIGRATIONS.labels("completed").inc()
                await out.write(sse.DONE)
                await out.write_eof()
                return
            # decide among the others for prompt + generated text
            cont = Parsed(
                body=ctx.parsed.body,
                chat=ctx.parsed.chat,
                model=ctx.parsed.model,
                prompt=ctx.parsed.prompt + ctx.generated,
                token_ids=self.parser.tokenizer.encode(ctx.parsed.prompt + ctx.generated),
                max_tokens=remaining,
                stream=True,
                seed=ctx.parsed.seed,
            )
            d, _ = self.decide_for(
                cont, ctx.request_id, ctx.session_id, ctx.arm.policy, ctx.excluded
            )
            if d.worker_id is None:
                M.MIGRATIONS.labels("no_worker").inc()
                ctx.status, ctx.http_status = "error", 503
                with contextlib.suppress(Exception):
                    await out.write(
                        sse.event(
                            {
                                "error": {
                                    "message": "worker failed mid-stream and no other worker can continue",
                                    "type": "upstream_error",
                                }
                            }
                        )
                    )
                    await out.write_eof()
                return
            wid = d.worker_id
            ctx.worker_id = wid
            ticket = self.state.reserve(
                wid, len(cont.token_ids), remaining, d.cached_tokens, time.time()
            )
            self._mark_load_dirty()
            try:
                body = upstream_body(ctx, migrate=True, max_tokens=remaining)
                try:
                    resp = await self._post(ctx, wid, "/v1/completions", body, b"")
                except (WorkerFailed, _Upstream5xx) as e:
                    broken = StreamBroken(wid, str(e))
                    continue
                if resp.status != 200:
                    resp.release()
                    broken = StreamBroken(wid, f"{resp.status} from worker")
                    continue
                try:
                    await self._pump(request, ctx, wid, resp, ticket, reframe=True)
                    M.MIGRATIONS.labels("completed").inc()
                    return
                except ClientGone:
                    ctx.status, ctx.http_status = "cancelled", 499
                    return
                except WorkerFailed as e:
                    broken = StreamBroken(wid, e.reason)
                except StreamBroken as e:
                    broken = e
            finally:
                self.state.release(ticket)
                self._mark_load_dirty()
                self._notify_capacity()


class ClientGone(Exception):
    """The client closed its connection while we were writing to it."""


async def _write(out: web.StreamResponse, data: bytes) -> None:
    try:
        await out.write(data)
    except (ConnectionResetError, aiohttp.ClientConnectionResetError, RuntimeError) as exc:
        raise ClientGone() from exc


class _Upstream5xx(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"{status}: {detail}")
        self.status = status
        self.detail = detail


async def start_router_http(
    router: Router, host: str, port: int, shutdown_s: float = 5.0, reuse_port: bool = False
) -> web.AppRunner:
    """Serve the router's app; on stop, in-flight requests get ``shutdown_s`` to finish."""
    runner = web.AppRunner(
        router.make_app(), access_log=None, handle_signals=False, shutdown_timeout=shutdown_s
    )
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True, reuse_port=reuse_port or None).start()
    return runner


async def serve(st: Any, stop: asyncio.Event) -> None:
    from services.common.subjects import Subjects

    bus = Bus(st.nats_url, f"router-{st.router_id or 'r'}", Subjects(st.subject_prefix))
    await bus.connect()
    router = Router(st, bus)
    await router.start()
    runner = await start_router_http(
        router, st.host, st.port, reuse_port=getattr(st, "reuse_port", False)
    )
    log.info(
        "router listening",
        host=st.host,
        port=st.port,
        router_id=router.router_id,
        policy=router.policies.control.spec,
    )
    await stop.wait()
    await runner.cleanup()
    await router.stop()
    await bus.close()
