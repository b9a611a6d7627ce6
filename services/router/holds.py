"""Which dispatched requests have not had their first token yet, and who waits for them.

``kv_aware`` may answer "send this request after request X's first token" (``Decision.after``):
X is computing, or waiting to compute, the prefix this request needs on the same worker, and
an engine that starts both in one step computes the prefix twice. The router marks every
request it sends (user requests and one-token replicas) with :meth:`FirstTokenWaits.sent`,
and :meth:`FirstTokenWaits.done` when its first token arrives or it ends, whichever is first.

Invariants: a request id is in ``_pending`` from ``sent`` to ``done``; every waiter of it is
woken by ``done`` (or gives up at its timeout); waiting on an id that is not pending returns
at once. No I/O; one event loop.
"""

from __future__ import annotations

import asyncio

from services.common.aio import wait_event


class FirstTokenWaits:
    def __init__(self) -> None:
        # request id -> the event its waiters wait on (None until somebody waits)
        self._pending: dict[str, asyncio.Event | None] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def sent(self, request_id: str) -> None:
        """``request_id`` was sent to a worker and has no first token yet."""
        if request_id not in self._pending:
            self._pending[request_id] = None

    def done(self, request_id: str) -> None:
        """``request_id`` has its first token, or ended: wake whoever waits for it."""
        ev = self._pending.pop(request_id, None)
        if ev is not None:
            ev.set()

    def pending(self, request_id: str) -> bool:
        return request_id in self._pending

    async def wait(self, request_id: str, timeout: float) -> str:
        """Wait until ``request_id`` is done: ``"none"`` when it was not pending (nothing to
        wait for), ``"token"`` when it became done, ``"timeout"`` after ``timeout`` seconds."""
        if request_id not in self._pending:
            return "none"
        ev = self._pending[request_id]
        if ev is None:
            ev = self._pending[request_id] = asyncio.Event()
        return "token" if await wait_event(ev, timeout) else "timeout"
