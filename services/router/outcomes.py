"""Outcome publishing off the request path: a bounded buffer and a background publisher.

Invariants: :meth:`OutcomePublisher.submit` never blocks and never raises; when the buffer
is full (NATS down for long, or too slow) the outcome is dropped and counted
(``kvgate_router_outcomes_dropped_total{reason="buffer_full"}``); while NATS is down the
publisher waits for the reconnect and then drains what is buffered.
"""

from __future__ import annotations

import asyncio
import contextlib

from services.common.aio import cancel_and_wait, wait_event
from services.common.bus import Bus
from services.common.logging import RateLimiter, get_logger
from services.common.schemas import RouterOutcome, encode
from services.router.metrics import OUTCOMES_DROPPED

log = get_logger("router.outcomes")


class OutcomePublisher:
    def __init__(self, bus: Bus, maxsize: int = 10_000, concurrency: int = 256) -> None:
        self.bus = bus
        self.queue: asyncio.Queue[RouterOutcome] = asyncio.Queue(maxsize=maxsize)
        self.concurrency = concurrency
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

    async def _publish(self, batch: list[RouterOutcome]) -> None:
        """Core publishes to ``router.outcomes`` (the OUTCOMES stream stores them); a JetStream
        ack per message would cost more than the request it describes. While the connection
        is being re-established nats-py buffers them."""
        subject = self.bus.subjects.router_outcomes
        nc = self.bus.client
        for i, o in enumerate(batch):
            try:
                await nc.publish(subject, encode(o))
                self.published += 1
            except Exception as exc:
                n = len(batch) - i
                self.dropped += n
                OUTCOMES_DROPPED.labels("publish_error").inc(n)
                if self._log.allow("err"):
                    log.warning("outcome publish failed", error=repr(exc))
                return

    async def _run(self) -> None:
        while True:
            first = await self.queue.get()
            batch = [first]
            while len(batch) < self.concurrency and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            while not self.bus.is_connected:
                await wait_event(self.bus.connected, 1.0)
            await self._publish(batch)
            for _ in batch:
                self.queue.task_done()
