"""Feeds canaries from router outcomes and applies the evaluator's decisions (I/O shell).

- :class:`OutcomeCollector` reads ``router.outcomes`` with a durable JetStream consumer
  shared by all API replicas (each replica gets a share), buffers outcomes that carry a
  canary id, and every ``flush_s`` adds per-arm counts to the canary's current window in
  Postgres (additive upserts, so replicas' shares sum up). While Postgres is down the buffer
  is kept (bounded) and flushed when it returns.
- :class:`EvaluatorLoop` wakes every ``tick_s`` and takes running canaries that are due
  with ``SELECT ... FOR UPDATE SKIP LOCKED``: a canary being evaluated by one replica is
  skipped by the others, and ``next_eval_at`` keeps the next replica from evaluating the same
  state again right after. A restarted API simply finds its running canaries in Postgres.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import Counter
from sqlalchemy import select

from services.api.canary import machine
from services.api.canary.stats import ArmStats
from services.api.db import Database
from services.api.models import Canary, CanaryDecision
from services.api.publisher import PolicyPublisher
from services.api.pull import PullLoop
from services.common.aio import cancel_and_wait
from services.common.bus import Bus
from services.common.logging import RateLimiter, get_logger
from services.common.schemas import RouterOutcome, SchemaError, decode_all
from services.common.streams import require_outcomes_stream

log = get_logger("api.canary")

OUTCOMES = Counter(
    "kvgate_api_canary_outcomes_total", "Router outcomes seen by the canary collector", ["result"]
)
DECISIONS = Counter("kvgate_api_canary_decisions_total", "Canary decisions applied", ["action"])


@dataclass(frozen=True)
class _Outcome:
    canary_id: str
    arm: str
    ts: float
    status: str
    ttft_s: float | None
    prompt_tokens: int
    cached_tokens: int | None


class OutcomeCollector:
    def __init__(self, db: Database, bus: Bus, flush_s: float = 0.5, max_buffer: int = 200_000):
        self.db = db
        self.bus = bus
        self.flush_s = flush_s
        self.buffer: deque[_Outcome] = deque(maxlen=max_buffer)
        self.flushed = asyncio.Event()  # set after each successful flush (tests await it)
        self._log = RateLimiter(30.0)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await require_outcomes_stream(self.bus)
        s = self.bus.subjects
        self._pull = PullLoop(
            self.bus,
            s.outcomes_stream,
            s.router_outcomes,
            s.durable("api_canary_outcomes"),
            self._on_raw,
        )
        await self._pull.start()
        self._task = asyncio.create_task(self._loop(), name="canary-flush")

    async def stop(self) -> None:
        await self._pull.stop()
        if self._task is not None:
            await cancel_and_wait([self._task])
        with contextlib.suppress(Exception):
            await self.flush()

    async def _on_raw(self, raw) -> bool:
        try:
            outcomes = decode_all(RouterOutcome, raw.data)  # a router's tick: an array of them
        except SchemaError as exc:
            OUTCOMES.labels("invalid").inc()
            if self._log.allow("invalid"):
                log.warning("invalid router outcome dropped", error=str(exc))
            return True
        for outcome in outcomes:
            await self._on_outcome(outcome)
        return True

    async def _on_outcome(self, o: RouterOutcome) -> None:
        if not o.canary_id:
            OUTCOMES.labels("no_canary").inc()
            return
        if len(self.buffer) == self.buffer.maxlen:
            OUTCOMES.labels("dropped_buffer_full").inc()
        self.buffer.append(
            _Outcome(
                o.canary_id[:36],
                o.arm,
                o.ts,
                o.status,
                # a non-streamed answer's first byte arrives with its last: use e2e there
                o.ttft_s if o.ttft_s is not None else o.e2e_s,
                o.prompt_tokens,
                o.cached_tokens,
            )
        )

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            try:
                await self.flush()
            except Exception as exc:
                if self._log.allow("flush"):
                    log.warning(
                        "outcome flush failed; keeping buffer",
                        error=repr(exc)[:300],
                        buffered=len(self.buffer),
                    )

    async def flush(self) -> int:
        """Add the buffered outcomes to their canaries' current windows; returns how many."""
        if not self.buffer:
            self.flushed.set()
            return 0
        batch = self.buffer
        self.buffer = deque(maxlen=batch.maxlen)
        try:
            used = await self._write(batch)
        except BaseException:
            batch.extend(self.buffer)  # keep order: older first; bounded (oldest dropped)
            self.buffer = batch
            raise
        OUTCOMES.labels("counted").inc(used)
        self.flushed.set()
        return used

    async def _write(self, batch: deque[_Outcome]) -> int:
        async with self.db.transaction() as s:
            rows = (
                await s.execute(
                    select(Canary.id, Canary.window, Canary.window_started_at).where(
                        Canary.state == "running"
                    )
                )
            ).all()
            windows = {r.id: (r.window, r.window_started_at) for r in rows}
            acc: dict[tuple[str, int, str], ArmStats] = {}
            used = 0
            for o in batch:
                w = windows.get(o.canary_id)
                if w is None or o.ts < w[1]:
                    OUTCOMES.labels("outside_window").inc()
                    continue
                st = acc.setdefault((o.canary_id, w[0], o.arm), ArmStats())
                st.add(o.status, o.ttft_s, o.prompt_tokens, o.cached_tokens)
                used += 1
            for (cid, window, arm), st in acc.items():
                await machine.add_stats(s, cid, window, arm, st)
        return used


class EvaluatorLoop:
    def __init__(
        self,
        db: Database,
        publisher: PolicyPublisher | None,
        tick_s: float = 1.0,
        name: str = "evaluator",
    ) -> None:
        self.db = db
        self.publisher = publisher
        self.tick_s = tick_s
        self.name = name
        self._log = RateLimiter(30.0)
        self._task: asyncio.Task[None] | None = None
        self.ticks = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"canary-{self.name}")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception as exc:
                if self._log.allow("tick"):
                    log.warning("canary evaluation failed", error=repr(exc)[:300])
            self.ticks += 1
            await asyncio.sleep(self.tick_s)

    async def tick(self, now: float | None = None) -> list[tuple[str, str]]:
        """Evaluate every due running canary this replica can lock; returns (id, action) of
        the transitions applied."""
        now = time.time() if now is None else now
        applied: list[tuple[str, str]] = []
        publish = False
        async with self.db.transaction() as s:
            due = (
                (
                    await s.execute(
                        select(Canary)
                        .where(Canary.state == "running", Canary.next_eval_at <= now)
                        .with_for_update(skip_locked=True)
                    )
                )
                .scalars()
                .all()
            )
            for c in due:
                control, candidate, extra = await machine.evaluation_inputs(s, c)
                decision = machine.evaluate(c, control, candidate, now)
                numbers = {**decision.numbers, **extra}
                c.next_eval_at = now + self.tick_s * 0.9
                if decision.action == "hold":
                    if decision.reason.startswith("step window over") and not await _held(s, c):
                        await machine.apply(s, c, "hold", decision.reason, numbers, self.name)
                    continue
                publish |= await machine.apply(
                    s, c, decision.action, decision.reason, numbers, self.name, now=now
                )
                applied.append((c.id, decision.action))
        for cid, action in applied:
            DECISIONS.labels(action).inc()
            log.info("canary decision", canary=cid, action=action, by=self.name)
        if publish and self.publisher is not None:
            await self.publisher.publish_current()
        return applied


async def _held(s, c: Canary) -> bool:
    """Whether a 'hold' for lack of samples was already recorded in this window."""
    return (
        await s.execute(
            select(CanaryDecision.id)
            .where(
                CanaryDecision.canary_id == c.id,
                CanaryDecision.window == c.window,
                CanaryDecision.action == "hold",
            )
            .limit(1)
        )
    ).first() is not None
