"""Coarse deadlines: a late wait fails no earlier than its deadline and at most one tick
after it; finished waits are forgotten; the checking task runs only while something waits."""

from __future__ import annotations

import asyncio

import pytest

from services.common.deadlines import Deadlines


async def test_a_wait_past_its_deadline_times_out_within_a_tick() -> None:
    d = Deadlines(tick_s=0.02)
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    t0 = loop.time()
    with pytest.raises(TimeoutError):
        await d.wait(fut, t0 + 0.1)
    took = loop.time() - t0
    assert took >= 0.1
    assert took <= 0.1 + 0.02 + 0.05  # one tick, plus the loop's own scheduling slack
    assert fut.done() and isinstance(fut.exception(), TimeoutError)
    assert len(d) == 0


async def test_finished_waits_are_forgotten_and_the_checker_stops() -> None:
    d = Deadlines(tick_s=0.01)
    loop = asyncio.get_running_loop()
    futs = [loop.create_future() for _ in range(50)]
    waits = [asyncio.ensure_future(d.wait(f, loop.time() + 60)) for f in futs]
    await asyncio.sleep(0)  # every wait registered
    assert len(d) == 50 and d._task is not None
    for f in futs:
        f.set_result(None)
    await asyncio.gather(*waits)
    assert len(d) == 0
    checker = d._task
    assert checker is not None
    await checker  # ends by itself at its next tick: nothing waits
    assert d._task is None


async def test_an_early_answer_wins_and_a_cancelled_wait_is_dropped() -> None:
    d = Deadlines(tick_s=0.01)
    loop = asyncio.get_running_loop()
    answered = loop.create_future()
    loop.call_soon(answered.set_result, None)
    await d.wait(answered, loop.time() + 0.05)  # no TimeoutError
    left = loop.create_future()
    w = asyncio.ensure_future(d.wait(left, loop.time() + 0.03))
    await asyncio.sleep(0)
    w.cancel()
    with pytest.raises(asyncio.CancelledError):
        await w
    assert len(d) == 0 and left.cancelled()
    await d.close()
    assert d._task is None
