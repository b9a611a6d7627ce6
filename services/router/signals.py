"""Signals between the request path and the background parts of the router.

- :class:`CapacitySignal`: requests waiting for capacity (in flow control's lines,
  services/router/flow_control.py) sleep on it; whatever may free capacity (a release, a
  heartbeat, telemetry, a closed circuit) calls ``notify``.
  Invariant: ``notify`` wakes every request waiting at that moment, and does nothing (costs
  nothing) while no request waits.
- :class:`Spawner`: fire-and-forget tasks kept referenced until done (so they cannot be
  garbage-collected mid-flight).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sized
from typing import Any


class CapacitySignal:
    def __init__(self, queue: Sized) -> None:
        self.queue = queue  # the requests waiting for capacity
        self.event = asyncio.Event()

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def notify(self) -> None:
        if not self.waiting:
            return
        ev = self.event
        self.event = asyncio.Event()
        ev.set()


class Spawner:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
