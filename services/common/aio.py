"""Small asyncio helpers shared by the services."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from services.common.logging import get_logger

log = get_logger("aio")


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait for ``event`` at most ``timeout`` seconds; True if it was set.

    Use this, not ``asyncio.wait_for(event.wait(), t)``, in a task that may be cancelled:
    on Python 3.11 wait_for swallows a cancel that lands while the event is being set (the
    inner wait finished, so it returns normally), and a loop around it then runs on forever
    while its owner awaits it in stop(). ``asyncio.timeout`` runs the wait in the caller's own
    task, so a cancel always arrives.
    """
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], rounds: int = 20) -> None:
    """Cancel tasks and wait until they are done.

    nats-py can swallow a CancelledError raised inside a publish (it turns it into its own
    errors), and Python 3.11's asyncio.wait_for one that lands as its inner wait finishes, so
    a single cancel() may leave a task running: cancel again until it finishes.
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
