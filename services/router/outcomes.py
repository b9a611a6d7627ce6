"""A request's outcome: its metrics and one ``RouterOutcome``, published off the request path
through a bounded buffer and a background publisher that sends what gathered per tick
(``tick_s``, 20 ms) as one bus message (a msgpack array of outcomes, cut at ``message_bytes``):
the OUTCOMES stream stores one message per tick instead of one per request, which cost the
broker ~5 % of a core and the router a few µs per request at 8,000 requests/s
(docs/benchmarks.md, proxy).

Invariants: :meth:`OutcomeRecorder.record` runs exactly once per request (the request path
calls it in ``finally``); :meth:`OutcomePublisher.submit` never blocks and never raises; when the buffer
is full (NATS down for long, or too slow) the outcome is dropped and counted
(``kvgate_router_outcomes_dropped_total{reason="buffer_full"}``); while NATS is down the
publisher waits for the reconnect and then drains what is buffered.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import nats.errors

from services.common.aio import cancel_and_wait, wait_event
from services.common.bus import Bus
from services.common.logging import RateLimiter, get_logger
from services.common.schemas import RouterOutcome, encode, encode_batch
from services.router import metrics as M
from services.router import slo
from services.router.metrics import OUTCOMES_DROPPED
from services.router.proxy import Ctx
from services.router.tenant_metrics import TenantMetrics

log = get_logger("router.outcomes")

RECONNECT_POLL_S = 0.05  # while the bus has not yet seen its client's disconnection


class OutcomePublisher:
    def __init__(
        self,
        bus: Bus,
        maxsize: int = 10_000,
        batch: int = 4096,
        tick_s: float = 0.02,
        message_bytes: int = 256 * 1024,
    ) -> None:
        self.bus = bus
        self.queue: asyncio.Queue[RouterOutcome] = asyncio.Queue(maxsize=maxsize)
        self.batch = batch
        self.tick_s = tick_s
        # a bus message carries outcomes up to this size (and never more than the server's
        # max_payload); one larger outcome goes alone
        self.message_bytes = message_bytes
        self.messages = 0  # bus messages sent
        self.published = 0
        self.dropped = 0
        self._task: asyncio.Task[None] | None = None
        self._log = RateLimiter(30.0)

    def submit(self, outcome: RouterOutcome) -> None:
        try:
            self.queue.put_nowait(outcome)
        except asyncio.QueueFull:
            self.dropped += 1
            OUTCOMES_DROPPED.labels("buffer_full").inc()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="outcomes")

    async def stop(self, drain_s: float = 2.0) -> None:
        if self._task is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.queue.join(), drain_s)
        await cancel_and_wait([self._task])

    def _messages(self, batch: list[RouterOutcome], limit: int) -> list[tuple[int, bytes]]:
        """``batch`` as bus messages of at most ``limit`` bytes: (outcomes, payload)."""
        out: list[tuple[int, bytes]] = []
        parts: list[bytes] = []
        size = 0
        for o in batch:
            b = encode(o)
            if parts and size + len(b) > limit:
                out.append((len(parts), encode_batch(parts)))
                parts, size = [], 0
            parts.append(b)
            size += len(b)
        if parts:
            out.append((len(parts), encode_batch(parts)))
        return out

    async def _publish(self, batch: list[RouterOutcome]) -> None:
        """Core publishes to ``router.outcomes`` (the OUTCOMES stream stores them); a JetStream
        ack would cost a round trip per message. While the connection is being re-established
        nats-py buffers them."""
        subject = self.bus.subjects.router_outcomes
        nc = self.bus.client
        # 16 bytes for the array's own header
        limit = min(self.message_bytes, nc.max_payload - 16)
        msgs = self._messages(batch, limit)
        for i, (n, payload) in enumerate(msgs):
            try:
                await nc.publish(subject, payload)
                self.published += n
                self.messages += 1
            except nats.errors.MaxPayloadError:  # one outcome larger than the server takes
                self.dropped += n
                OUTCOMES_DROPPED.labels("too_large").inc(n)
                if self._log.allow("too_large"):
                    log.warning("outcome larger than the bus's max_payload", bytes=len(payload))
            except Exception as exc:
                lost = sum(k for k, _ in msgs[i:])
                self.dropped += lost
                OUTCOMES_DROPPED.labels("publish_error").inc(lost)
                if self._log.allow("err"):
                    log.warning("outcome publish failed", error=repr(exc))
                return

    async def _run(self) -> None:
        while True:
            first = await self.queue.get()
            # let the tick's outcomes gather: nats-py writes what was published between two
            # of its flushes in one go
            await asyncio.sleep(self.tick_s)
            batch = [first]
            while len(batch) < self.batch and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            while not self.bus.is_connected:
                # the bus's connected event lags the client: nats-py drops the connection
                # first and calls the disconnected callback later, so the event can still be
                # set here; waiting on a set event does not suspend, and this loop would spin
                # without ever letting that callback (or anything else) run
                if self.bus.connected.is_set():
                    await asyncio.sleep(RECONNECT_POLL_S)
                else:
                    await wait_event(self.bus.connected, 1.0)
            await self._publish(batch)
            for _ in batch:
                self.queue.task_done()


class OutcomeRecorder:
    """Metrics and the published outcome of each finished request."""

    def __init__(self, router_id: str, publisher: OutcomePublisher) -> None:
        self.router_id = router_id
        self.publisher = publisher
        self.hit_pred = M.HitRate("predicted")
        self.hit_reported = M.HitRate("reported")
        self.outliers: Any = None  # services.router.ejection.RouterOutliers, set by the router
        self.tenants = TenantMetrics()
        self.scaling: Any = None  # services.router.scaling.ScalingSignal, set by the router
        # per (policy, arm, worker, status): the labelled metric children a request of that
        # kind updates, found in one lookup (six label lookups were a µs per request)
        self._children: dict[tuple[str, str, str, str], tuple[Any, ...]] = {}
        # the reuse attribution's counters without a varying label, bound once
        self._available, self._captured, self._delivered, self._unpredicted = (
            M.PREFIX_TOKENS.labels(kind)
            for kind in ("available", "captured", "delivered", "unpredicted")
        )

    def _metric_children(self, pol: str, arm: str, wid: str, status: str) -> tuple[Any, ...]:
        key = (pol, arm, wid, status)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = (
                M.REQUESTS.labels(pol, wid, status),
                M.ARM_REQUESTS.labels(arm, status),
                M.E2E.labels(pol),
                M.ARM_TTFT.labels(arm),
                M.ITL.labels(pol),
                M.TTFT.labels(pol),
            )
        return c

    def record(self, ctx: Ctx) -> None:
        e2e = time.perf_counter() - ctx.t0
        prompt = len(ctx.parsed.token_ids)
        pol = ctx.arm.policy.name
        requests, arm_requests, e2e_h, arm_ttft, itl, ttft = self._metric_children(
            pol, ctx.arm.name, ctx.worker_id or "none", ctx.status
        )
        requests.inc()
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
        arm_requests.inc()
        if ctx.status == "ok":
            if self.outliers is not None:
                self.outliers.record(ctx, e2e)
            e2e_h.observe(e2e)
            arm_ttft.observe(ctx.ttft if ctx.ttft is not None else e2e)
            if ctx.ttft is not None and ctx.completion_tokens > 1:
                itl.observe((e2e - ctx.ttft) / (ctx.completion_tokens - 1))
            if ctx.ttft is not None:
                ttft.observe(ctx.ttft)
            if ctx.prefill_worker is not None:
                _observe_pd(ctx)
            M.PROMPT_TOKENS.inc(prompt)
            self.hit_pred.add(ctx.predicted_cached, prompt)
            if ctx.cached_reported is not None:
                self.hit_reported.add(ctx.cached_reported, prompt)
            self.attribute(ctx)
            if self.scaling is not None:
                cached = ctx.cached_reported
                self.scaling.answered(
                    prompt,
                    cached if cached is not None else ctx.predicted_cached,
                    ctx.completion_tokens,
                )
        elif ctx.status == "timeout":
            M.TIMEOUTS.inc()
            M.TIMEOUTS_ALIAS.inc()
        tenancy = ctx.tenancy
        self.tenants.record(tenancy, ctx.status, prompt, ctx.cached_reported, ctx.completion_tokens)
        self.publisher.submit(
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
                prompt_tokens=prompt,
                completion_tokens=ctx.completion_tokens,
                predicted_cached_tokens=ctx.predicted_cached,
                cached_tokens=ctx.cached_reported,
                ttft_s=ctx.ttft,
                e2e_s=e2e,
                retries=ctx.retries,
                migrated=ctx.migrated,
                stream=ctx.parsed.stream,
                prefill_worker=ctx.prefill_worker,
                prefill_s=ctx.pd_prefill_s,
                handoff_s=_handoff_s(ctx),
                available_cached_tokens=ctx.available_cached,
                lost_reason=ctx.lost_reason,
                tenant_id=tenancy.tenant_id,
                priority=tenancy.priority.value,
            )
        )

    def attribute(self, ctx: Ctx) -> None:
        """An answered request's reuse attribution, in prompt tokens: available >= captured
        (the decision's), delivered (the engine's report, when it gives one); what was
        available and not delivered is counted by why: the decision's reason for the part
        not captured, ``engine`` for the captured part the engine did not report as cached.
        Delivered beyond captured (the index had not yet heard of those blocks) is counted
        as ``unpredicted``."""
        available, captured = ctx.available_cached, ctx.predicted_cached
        arm = ctx.arm.name
        self._available.inc(available)
        self._captured.inc(captured)
        if available > captured:
            M.child(M.PREFIX_LOST, ctx.lost_reason or "filtered", arm).inc(available - captured)
        delivered = ctx.cached_reported
        if delivered is None:
            return
        self._delivered.inc(delivered)
        if delivered < captured:
            M.child(M.PREFIX_LOST, "engine", arm).inc(captured - delivered)
        elif delivered > captured:
            self._unpredicted.inc(delivered - captured)


def _handoff_s(ctx: Ctx) -> float | None:
    """P/D: from the prefill's answer to the decoder's first token (None: not both seen, or
    the first token came first, as SGLang's concurrent requests allow)."""
    if ctx.pd_prefill_done is None or ctx.ttft is None:
        return None
    gap = ctx.t0 + ctx.ttft - ctx.pd_prefill_done
    return gap if gap >= 0 else None


def _observe_pd(ctx: Ctx) -> None:
    handoff = _handoff_s(ctx)
    if handoff is not None:
        M.PD_HANDOFF.observe(handoff)
    if ctx.pd_transfer_predicted > 0:
        M.PD_TRANSFER_PREDICTED.observe(ctx.pd_transfer_predicted)
