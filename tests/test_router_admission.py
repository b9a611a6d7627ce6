"""Capacity and admission (seeds 001 / 003): never-fits 400 with numbers, the bounded wait
queue, 429 with Retry-After on queue timeout or a full queue."""

from __future__ import annotations

import asyncio

import aiohttp

from services.common.bus import Bus
from services.common.schemas import WorkerCapacity
from tests.test_router_support import Beats, FakeWorker, RouterProc, post, wait_until


async def test_never_fits_is_400_with_numbers(nats_url, subjects, bus: Bus) -> None:
    w = await FakeWorker(
        "w0",
        capacity=WorkerCapacity(
            block_size=16, num_gpu_blocks=100, max_num_seqs=4, max_model_len=100_000
        ),
    ).start(bus)
    beats = Beats(bus, [w]).start()
    router = await RouterProc(nats_url, subjects).start()
    try:
        await router.wait_workers(1)
        async with aiohttp.ClientSession() as s:
            st, _, body = await post(
                s,
                router.url + "/v1/completions",
                {"model": "m", "prompt": "x" * 1590, "max_tokens": 20},
            )
            assert st == 400
            msg = await asyncio.to_thread(lambda: body.decode())
            assert (
                "1590 prompt + 20 max_tokens" in msg
                and "101 KV blocks" in msg
                and "100 blocks" in msg
            )
            st, _, _ = await post(
                s,
                router.url + "/v1/completions",
                {"model": "m", "prompt": "x" * 1500, "max_tokens": 20},
            )
            assert st == 200
        assert not [x for x in w.served if len(x["body"]["prompt"]) == 1590]
    finally:
        await router.stop()
        await beats.stop()
        await w.stop()


async def test_queue_waits_for_capacity_then_429(nats_url, subjects, bus: Bus) -> None:
    hold = asyncio.Event()
    w = await FakeWorker(
        "w0",
        hold=hold,
        capacity=WorkerCapacity(
            block_size=16, num_gpu_blocks=1000, max_num_seqs=1, max_model_len=8192
        ),
    ).start(bus)
    beats = Beats(bus, [w]).start()
    router = await RouterProc(
        nats_url, subjects, queue_timeout=0.5, queue_size=2, retry_after=3
    ).start()
    r = router.router
    try:
        await router.wait_workers(1)
        async with aiohttp.ClientSession() as s:
            url = router.url + "/v1/completions"
            first = asyncio.create_task(
                post(s, url, {"model": "m", "prompt": "a", "max_tokens": 4})
            )
            await asyncio.wait_for(w.started.wait(), 10)
            # the worker is at max_num_seqs: the next request waits, then 429s with Retry-After
            st, h, body = await post(s, url, {"model": "m", "prompt": "b", "max_tokens": 4})
            assert st == 429 and h["Retry-After"] == "3", body
            assert b"within 0.5s" in body
            # queued requests are served as soon as capacity frees
            second = asyncio.create_task(
                post(s, url, {"model": "m", "prompt": "c", "max_tokens": 4})
            )
            await wait_until(lambda: r.queue_len == 1, what="second request queued")
            async with s.get(router.url + "/health") as resp:
                assert (await resp.json())["queue_length"] == 1
            # the queue holds 2: two more fill it, the fourth is refused at once
            third = asyncio.create_task(
                post(s, url, {"model": "m", "prompt": "d", "max_tokens": 4})
            )
            await wait_until(lambda: r.queue_len == 2, what="queue full")
            st, _, body = await post(s, url, {"model": "m", "prompt": "e", "max_tokens": 4})
            assert st == 429 and b"queue full" in body
            hold.set()
            results = await asyncio.gather(first, second, third)
            assert [x[0] for x in results] == [200, 200, 200]
    finally:
        await router.stop()
        await beats.stop()
        await w.stop()


async def test_kv_blocks_bound_admission(nats_url, subjects, bus: Bus) -> None:
    """Seed 001: a worker whose KV cache cannot hold another request gets no more, even with
    free sequence slots; the other worker takes it."""
    hold = asyncio.Event()
    small = WorkerCapacity(block_size=16, num_gpu_blocks=160, max_num_seqs=8, max_model_len=8192)
    w0 = await FakeWorker("w0", hold=hold, capacity=small).start(bus)
    w1 = await FakeWorker("w1", hold=hold, capacity=small).start(bus)
    beats = Beats(bus, [w0, w1]).start()
    router = await RouterProc(nats_url, subjects, policy="least_request", queue_timeout=0.3).start()
    try:
        await router.wait_workers(2)
        async with aiohttp.ClientSession() as s:
            url = router.url + "/v1/completions"
            # each request needs ceil((1000 + 1000) / 16) = 125 of 160 blocks
            body = {"model": "m", "prompt": "y" * 1000, "max_tokens": 1000}
            tasks = [
                asyncio.create_task(post(s, url, {**body, "prompt": f"{i}" + "y" * 999}))
                for i in range(2)
            ]
            await wait_until(lambda: len(w0.served) + len(w1.served) == 2, what="both dispatched")
            assert len(w0.served) == 1 and len(w1.served) == 1
            st, _, msg = await post(s, url, {**body, "prompt": "z" * 1000})
            assert st == 429 and b"KV full" in msg
            hold.set()
            assert [t[0] for t in await asyncio.gather(*tasks)] == [200, 200]
    finally:
        await router.stop()
        await beats.stop()
        await w0.stop()
        await w1.stop()
