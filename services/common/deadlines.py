"""Coarse deadlines for many short waits, checked by one task every ``tick_s``.

A timer per wait (``asyncio.timeout``) costs ~3.8 µs under uvloop (a libuv timer created and
cancelled); the router waits once per whole answer and once per chunk of a stream, and its
timeouts are seconds long. Here a wait costs a dict insert and delete, and one task wakes every
``tick_s`` while anything waits.

Invariant: a wait still pending ``tick_s`` after its deadline raises ``TimeoutError`` (so it
raises no earlier than its deadline and at most ``tick_s`` late); a wait that ended is
forgotten at once; the checking task runs only while something waits.
"""

from __future__ import annotations

import asyncio

TICK_S = 0.05


class Deadlines:
    def __init__(self, tick_s: float = TICK_S) -> None:
        self.tick_s = tick_s
        self._waiting: dict[asyncio.Future[None], float] = {}
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._waiting)

    async def wait(self, fut: asyncio.Future[None], deadline: float) -> None:
        """Await ``fut``; ``TimeoutError`` (``fut`` is then failed with it) once the loop's
        clock is past ``deadline``."""
        waiting = self._waiting
        waiting[fut] = deadline
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._check())
        try:
            await fut
        finally:
            waiting.pop(fut, None)

    async def _check(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._waiting:
                await asyncio.sleep(self.tick_s)
                now = loop.time()
                late = [f for f, d in self._waiting.items() if d <= now]
                for f in late:
                    if not f.done():
                        f.set_exception(TimeoutError())
        finally:
            self._task = None

    async def close(self) -> None:
        """Stop the checking task (pending waits then wait without a deadline)."""
        t = self._task
        if t is not None:
            t.cancel()
            try:
                await t
            except asyncio.CancelledError:
                pass
