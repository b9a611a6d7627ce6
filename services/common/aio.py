"""Small asyncio helpers shared by the services."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from services.common.logging import get_logger

log = get_logger("aio")


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], rounds: int = 20) -> None:
    """Cancel tasks and wait until they are done.

    nats-py can swallow a CancelledError raised inside a publish (it turns it into its own
    errors), so a single cancel() may leave a task running: cancel again until it finishes.
    """
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    for _ in range(rounds):
        if not pending:
            break
        for t in pending:
            t.cancel()
        _done, pending = await asyncio.wait(pending, timeout=0.25)
    for t in pending:  # pragma: no cover - a task that ignores 20 cancellations
        log.error("task did not stop", task=t.get_name())
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()  # retrieve, so asyncio does not log it as never retrieved
