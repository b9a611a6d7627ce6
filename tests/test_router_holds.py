"""``FirstTokenWaits``: the router's record of dispatched requests without a first token, which
held followers wait on (``Decision.after``)."""

from __future__ import annotations

import asyncio

from services.router.holds import FirstTokenWaits


async def test_nothing_to_wait_for_when_the_leader_is_not_in_flight() -> None:
    w = FirstTokenWaits()
    assert await w.wait("nobody", 30.0) == "none"
    w.sent("a")
    w.done("a")  # its first token came before anybody waited
    assert await w.wait("a", 30.0) == "none" and len(w) == 0


async def test_every_waiter_wakes_at_the_first_token() -> None:
    w = FirstTokenWaits()
    w.sent("lead")
    waiters = [asyncio.create_task(w.wait("lead", 30.0)) for _ in range(3)]
    await asyncio.sleep(0)  # one loop turn: the waiters start and wait (no time passes)
    assert len(w._pending["lead"]) == 3 and not any(t.done() for t in waiters)
    w.done("lead")
    assert await asyncio.gather(*waiters) == ["token"] * 3
    assert not w.pending("lead")


async def test_a_waiter_gives_up_at_its_timeout() -> None:
    w = FirstTokenWaits()
    w.sent("stuck")
    assert await w.wait("stuck", 0.01) == "timeout"
    assert w.pending("stuck")  # still in flight: a later follower may still wait for it
