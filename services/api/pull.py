"""A durable JetStream pull consumer loop that stops without cancelling a fetch.

Why not cancel: a pull ``fetch`` cancelled mid-wait leaves nats-py's subscription queue
un-joined, and the connection's later ``drain()`` then waits for its whole timeout. This loop
stops at the next fetch boundary instead (at most ``fetch_timeout_s`` later).

The handler gets the raw message and returns True to ack it, False to nak it for
redelivery after ``retry_s`` (e.g. Postgres is down), so nothing is lost while a dependency
is unavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from services.common.aio import cancel_and_wait, wait_event
from services.common.bus import Bus
from services.common.logging import RateLimiter, get_logger

log = get_logger("api.pull")

RawHandler = Callable[[Any], Awaitable[bool]]


class PullLoop:
    def __init__(
        self,
        bus: Bus,
        stream: str,
        subject: str,
        durable: str,
        handler: RawHandler,
        *,
        batch: int = 256,
        fetch_timeout_s: float = 0.5,
        retry_s: float = 1.0,
        ack_wait_s: float = 30.0,
    ) -> None:
        self.bus = bus
        self.stream = stream
        self.subject = subject
        self.durable = durable
        self.handler = handler
        self.batch = batch
        self.fetch_timeout_s = fetch_timeout_s
        self.retry_s = retry_s
        self.ack_wait_s = ack_wait_s
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._psub: Any = None
        self._log = RateLimiter(30.0)

    async def start(self) -> None:
        config = ConsumerConfig(
            durable_name=self.durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=self.ack_wait_s,
            max_ack_pending=max(self.batch * 4, 1024),
        )
        self._psub = await self.bus.js.pull_subscribe(
            self.subject, durable=self.durable, stream=self.stream, config=config
        )
        self._task = asyncio.create_task(self._loop(), name=f"pull:{self.durable}")

    async def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        if self._task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
        except (TimeoutError, asyncio.CancelledError):
            await cancel_and_wait([self._task])
        with contextlib.suppress(Exception):
            await self._psub.unsubscribe()

    async def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                msgs = await self._psub.fetch(self.batch, timeout=self.fetch_timeout_s)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except Exception as exc:  # disconnected, stream gone: back off and retry
                if self._log.allow("fetch"):
                    log.warning("fetch failed", durable=self.durable, error=repr(exc))
                await wait_event(self._stopping, 0.5)
                continue
            for raw in msgs:
                ok = False
                try:
                    ok = await self.handler(raw)
                except Exception as exc:
                    if self._log.allow("handler"):
                        log.warning("handler failed", durable=self.durable, error=repr(exc))
                    ok = True  # a message that breaks the handler will not get better
                with contextlib.suppress(Exception):
                    if ok:
                        await raw.ack()
                    else:
                        await raw.nak(delay=self.retry_s)
