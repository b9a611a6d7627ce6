"""Fault injection at run time: POST/GET /admin/faults, 503 rejection, slow-down, hang, crash
and restart as a new instance (seen on the bus), and fault flags through ``serve``."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from services.common.bus import Bus
from services.common.schemas import AllBlocksCleared, KvEventBatch
from services.common.streams import require_kv_events_stream
from services.worker_sim.faults import Faults
from tests.test_worker_sim_support import get_text, metric_values, one, post, sim_worker


def test_fault_patches_are_validated_all_or_nothing():
    f = Faults()
    f.update({"slow_factor": 3, "reject": 0.5})
    assert (f.slow_factor, f.reject) == (3.0, 0.5)
    for bad in (
        {"reject": 1.5},
        {"slow_factor": 0},
        {"hang": "yes"},
        {"explode": True},
        {"drop_kv": 0.2, "dup_kv": -1},
        [1],
    ):
        with pytest.raises(ValueError):
            f.update(bad)
    assert (f.slow_factor, f.reject, f.drop_kv) == (3.0, 0.5, 0.0)
    f.update({"reset": True})
    assert f == Faults()


async def test_admin_faults_reject_and_slow():
    async with sim_worker(worker_id="fa", speedup=5.0) as w:
        status, js, _ = await post(w.url + "/admin/faults", {"reject": 1.0})
        assert status == 200 and js["faults"]["reject"] == 1.0
        assert json.loads(await get_text(w.url + "/admin/faults"))["faults"]["reject"] == 1.0
        c = openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as err:
            await c.completions.create(model="m", prompt="hi", max_tokens=2)
        assert err.value.status_code == 503
        status, js, _ = await post(w.url + "/admin/faults", {"reject": 7})
        assert status == 400 and "reject" in js["error"]["message"]

        # slow-down: the same work takes slow_factor times the simulated GPU time, and longer
        # on the wall clock
        await post(w.url + "/admin/faults", {"reset": True})
        loop = asyncio.get_running_loop()

        async def timed(prompt: str) -> tuple[float, float]:
            busy, t = w.busy_sim_s, loop.time()
            await c.completions.create(model="m", prompt=prompt, max_tokens=30)
            return w.busy_sim_s - busy, loop.time() - t

        base_sim, base_wall = await timed("a" * 40)
        await post(w.url + "/admin/faults", {"slow_factor": 8.0})
        slow_sim, slow_wall = await timed("b" * 40)  # same lengths, nothing cached
        await c.close()
        assert slow_sim == pytest.approx(8 * base_sim)
        assert base_wall >= base_sim / 5 * 0.9  # the wall clock follows simulated time / speedup
        assert slow_wall > 2 * base_wall
        v = metric_values(await get_text(w.url + "/metrics"))
        assert one(v, "sim:busy_seconds_total") == pytest.approx(w.busy_sim_s)


async def test_hang_stops_progress_and_health_until_resumed():
    async with sim_worker(worker_id="fh") as w:
        await post(w.url + "/admin/faults", {"hang": True})
        c = openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="x", max_retries=0, timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            await c.completions.create(model="m", prompt="hi", max_tokens=2)
        async with aiohttp.ClientSession() as s:
            with pytest.raises(asyncio.TimeoutError):
                async with s.get(w.url + "/health", timeout=aiohttp.ClientTimeout(total=0.3)):
                    pass
        assert not w.beating
        pending = asyncio.create_task(
            c.with_options(timeout=10).completions.create(model="m", prompt="ok", max_tokens=2)
        )
        await post(w.url + "/admin/faults", {"hang": False})
        r = await pending
        assert r.usage.completion_tokens == 2 and w.beating
        await c.close()


async def test_crash_closes_the_port_and_restart_is_a_new_empty_instance(bus: Bus):
    await require_kv_events_stream(bus)
    q: asyncio.Queue[KvEventBatch] = asyncio.Queue()

    async def on(b: KvEventBatch, _raw) -> None:
        q.put_nowait(b)

    await bus.subscribe(bus.subjects.kv_events("fc"), KvEventBatch, on)
    async with sim_worker(bus, worker_id="fc") as w:
        first = await asyncio.wait_for(q.get(), 5)
        old_instance = first.instance_id
        c = openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="x", max_retries=0)
        await c.completions.create(model="m", prompt="x" * 100, max_tokens=2)
        # a long request is cut when the worker crashes
        long = asyncio.create_task(c.completions.create(model="m", prompt="y", max_tokens=3000))
        status, js, _ = await post(w.url + "/admin/faults", {"crash": True, "restart_after_s": 0.3})
        assert status == 200 and js["faults"]["crash"] is True
        with pytest.raises(openai.APIConnectionError):
            await long
        # the restarted instance announces itself with seq 0 = AllBlocksCleared
        while True:
            b = await asyncio.wait_for(q.get(), 10)
            if b.instance_id != old_instance:
                break
        assert b.seq == 0 and b.events == [AllBlocksCleared()]
        r = await c.completions.create(model="m", prompt="x" * 100, max_tokens=2)
        assert r.usage.prompt_tokens_details.cached_tokens == 0  # the cache was lost
        assert w.instance_id == b.instance_id and not w.faults.crash
        await c.close()


async def test_crash_without_restart_refuses_connections():
    async with sim_worker(worker_id="fd") as w:
        await w.apply_faults({"crash": True})
        c = openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="x", max_retries=0)

        async def refused() -> bool:
            try:
                await c.completions.create(model="m", prompt="x", max_tokens=1)
            except openai.APIConnectionError:
                return True
            return False

        from tests.test_worker_sim_support import until

        await until(refused, what="port closed")
        assert not w.beating
        await c.close()


async def test_fault_flags_apply_to_selected_workers(bus: Bus, nats_url: str, subject_prefix: str):
    """(``bus``: its teardown deletes this namespace's streams.)"""
    from services.common.embedded import free_port
    from services.worker_sim.app import serve
    from tests.test_worker_sim_bus import _free, sim_settings

    port = free_port()
    while not all(_free(port + i) for i in range(2)):
        port = free_port()
    st = sim_settings(
        nats_url,
        subject_prefix,
        count=2,
        port=port,
        worker_id="ff",
        fault_reject=1.0,
        fault_workers="1",
        speedup=100.0,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(serve(st, stop))
    try:
        from tests.test_worker_sim_support import until

        async def up() -> bool:
            try:
                await get_text(f"http://127.0.0.1:{port + 1}/health")
                return True
            except aiohttp.ClientError:
                return False

        await until(up, what="workers up")
        s0, _, _ = await post(f"http://127.0.0.1:{port}/v1/completions", {"prompt": "a"})
        s1, js, h = await post(f"http://127.0.0.1:{port + 1}/v1/completions", {"prompt": "a"})
        assert s0 == 200 and s1 == 503 and h["x-kvgate-served-by"] == "ff-1"
        assert js["error"]["code"] == 503
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
