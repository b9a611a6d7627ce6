"""The asyncio helpers every service's loops and stop() rely on."""

from __future__ import annotations

import asyncio

from services.common.aio import cancel_and_wait, wait_event


async def test_wait_event_reports_set_and_timeout() -> None:
    ev = asyncio.Event()
    assert await wait_event(ev, 0.01) is False
    ev.set()
    assert await wait_event(ev, 5.0) is True


async def _loop_on(ev: asyncio.Event, rounds: list[int]) -> None:
    # the shape of the services' background loops: wake on an event or every interval
    while True:
        await wait_event(ev, 30.0)
        ev.clear()
        rounds.append(1)


async def test_cancel_landing_as_the_event_is_set_stops_the_loop() -> None:
    """The race that hung Router.stop(): the event is set and the task cancelled in the same
    loop iteration. asyncio.wait_for on Python 3.11 returns normally then (its inner wait
    finished first) and the loop runs on; wait_event must let the cancel through."""
    for _ in range(20):
        ev = asyncio.Event()
        rounds: list[int] = []
        task = asyncio.create_task(_loop_on(ev, rounds))
        await asyncio.sleep(0)  # let it reach the wait
        ev.set()
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=2.0)
        assert task in done and task.cancelled(), "a cancel was swallowed"
        assert rounds == []


async def test_cancel_and_wait_recancels_a_task_that_swallows_one() -> None:
    swallowed = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            swallowed.set()  # as nats-py does inside a publish
        await asyncio.sleep(30)

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await cancel_and_wait([task])
    assert swallowed.is_set() and task.cancelled()
