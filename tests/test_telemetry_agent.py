"""The telemetry agent against real NATS, engine-like HTTP endpoints, and a fake NVML library
substituted at the module boundary (``sys.modules["pynvml"]``)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from collections.abc import Callable

import pytest
from prometheus_client import REGISTRY, generate_latest

from services.common.bus import Bus
from services.common.schemas import Alert, WorkerCapacity, WorkerHeartbeat, WorkerLoad
from services.telemetry import fake_nvml
from services.telemetry.app import Agent, AgentConfig
from services.telemetry.targets import parse_targets
from tests.telemetry_util import endpoint, trtllm_text, vllm_text

GiB = 2**30


async def next_matching(q: asyncio.Queue, pred: Callable, timeout: float = 10.0):
    """Next queued item satisfying ``pred`` (event-driven; deadline only as a failure bound)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        left = deadline - loop.time()
        if left <= 0:
            raise AssertionError("no matching message before the deadline")
        item = await asyncio.wait_for(q.get(), left)
        if pred(item):
            return item


async def collect(bus: Bus, subject: str, typ) -> asyncio.Queue:
    q: asyncio.Queue = asyncio.Queue()

    async def on(msg, _raw) -> None:
        q.put_nowait(msg)

    await bus.subscribe(subject, typ, on)
    return q


@pytest.fixture
def fake_pynvml(monkeypatch):
    """Two fake H100s, injected where the agent imports NVML from."""
    gpus = [
        fake_nvml.FakeGpu(
            sm_util=87,
            mem_util=41,
            mem_used=71 * GiB,
            temperature=63,
            power_mw=512_345,
            sm_clock=1755,
            mem_clock=2619,
        ),
        fake_nvml.FakeGpu(sm_util=3, mem_util=1, mem_used=2 * GiB),
    ]
    mod = fake_nvml.make_module(gpus)
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    return mod


async def start_agent(bus: Bus, **kw) -> Agent:
    cfg = AgentConfig(**{"interval_s": 0.05, "scrape_timeout_s": 0.5, **kw})
    agent = Agent(bus, cfg)
    await agent.start()
    return agent


async def test_publishes_engine_and_nvml_values_then_stale_never_zeros(
    bus: Bus, fake_pynvml
) -> None:
    async with endpoint(
        vllm_text(3, 5, 0.42, blocks=160, block_size=16, queries=100, hits=40)
    ) as ep:
        q = await collect(bus, bus.subjects.telemetry("w-a"), WorkerLoad)
        agent = await start_agent(
            bus, static_targets=parse_targets(f"w-a={ep.url}@vllm"), gpu_map={"w-a": (1, 0)}
        )
        try:
            load = await next_matching(q, lambda m: not m.stale and len(m.gpus) == 2)
            assert (load.running, load.waiting, load.source) == (3, 5, "vllm")
            assert load.kv_usage == pytest.approx(0.42)
            assert (load.kv_capacity_tokens, load.tokens_per_block) == (2560, 16)
            assert abs(load.ts - time.time()) < 5
            g0 = next(g for g in load.gpus if g.index == 0)
            assert g0.sm_util_pct == 87 and g0.mem_bw_util_pct == 41
            assert g0.mem_used_bytes == 71 * GiB and g0.mem_total_bytes == 80 * GiB
            assert g0.mem_free_bytes == 9 * GiB
            assert g0.mem_util_pct == pytest.approx(100 * 71 / 80)
            assert g0.uuid == "GPU-fake-0000" and g0.name.startswith("NVIDIA")

            # PCIe counters advance at 3 GB/s: the published rate is derived from them
            fake_pynvml.devices[0].pcie_rx_rate = 3e9
            load = await next_matching(
                q, lambda m: any((g.pcie_rx_bytes_s or 0) > 1e9 for g in m.gpus)
            )
            rx = next(g for g in load.gpus if g.index == 0).pcie_rx_bytes_s
            assert rx == pytest.approx(3e9, rel=0.3)
            assert next(g for g in load.gpus if g.index == 1).pcie_rx_bytes_s == 0
            # the slower fields arrive too (read every gpu_slow_every samples)
            assert g0.temperature_c == 63 and g0.power_w == pytest.approx(512.345)
            assert g0.sm_clock_mhz == 1755 and g0.xid_errors == 0 and g0.ecc_errors == 0

            # the engine fails: stale with the error, values None (not 0), GPUs still real
            ep.status = 500
            stale = await next_matching(q, lambda m: m.stale)
            assert stale.error and "HTTP 500" in stale.error
            assert stale.running is None and stale.waiting is None and stale.kv_usage is None
            assert {g.index for g in stale.gpus} == {0, 1}
            # and it recovers by itself
            ep.status = 200
            ep.text = vllm_text(1, 0, 0.1)
            back = await next_matching(q, lambda m: not m.stale and m.running == 1)
            assert back.waiting == 0

            # Prometheus view of the agent
            text = generate_latest(REGISTRY).decode()
            assert 'gpu_utilization_percent{gpu="0",worker="w-a"} 87.0' in text  # alias
            assert 'kvgate_gpu_sm_utilization_ratio{gpu="0",worker="w-a"} 0.87' in text
            assert 'kvgate_gpu_memory_used_bytes{gpu="0",worker="w-a"}' in text
            assert 'kvgate_gpu_sm_clock_hertz{gpu="0",worker="w-a"} 1.755e+09' in text
            # error counts are counters (Prometheus: rate() / increase() work on them)
            assert "# TYPE kvgate_gpu_xid_errors_total counter" in text
            assert 'kvgate_gpu_xid_errors_total{gpu="0",worker="w-a"} 0.0' in text
            assert "# TYPE kvgate_gpu_ecc_uncorrected_errors_total counter" in text
            assert 'kvgate_telemetry_scrape_errors_total{reason="http",worker="w-a"}' in text
        finally:
            await agent.stop()


async def test_connection_refused_and_timeout_are_stale(bus: Bus, unused_port: int) -> None:
    from aiohttp import web

    from services.common.embedded import free_port
    from services.common.service import start_http

    release = asyncio.Event()

    async def slow(_r):
        await release.wait()
        return web.Response(text=vllm_text(1, 0, 0.1))

    app = web.Application()
    app.router.add_get("/metrics", slow)
    slow_port = free_port()
    runner = await start_http(app, "127.0.0.1", slow_port)
    qa = await collect(bus, bus.subjects.telemetry("down"), WorkerLoad)
    qb = await collect(bus, bus.subjects.telemetry("slow"), WorkerLoad)
    agent = await start_agent(
        bus,
        use_nvml=False,
        scrape_timeout_s=0.2,
        static_targets=parse_targets(
            f"down=http://127.0.0.1:{unused_port}; slow=http://127.0.0.1:{slow_port}@vllm"
        ),
    )
    try:
        a = await next_matching(qa, lambda m: m.stale)
        assert "cannot connect" in a.error and a.running is None and a.gpus == []
        b = await next_matching(qb, lambda m: m.stale)
        assert "timed out" in b.error
        assert agent.nvml_reason.startswith("GPU collection disabled")
    finally:
        release.set()
        await agent.stop()
        await runner.cleanup()


async def test_no_nvml_library_means_engine_metrics_only(bus: Bus, monkeypatch) -> None:
    monkeypatch.setitem(
        sys.modules,
        "pynvml",
        fake_nvml.make_module([], init_error=fake_nvml.NVML_ERROR_LIBRARY_NOT_FOUND),
    )
    async with endpoint(vllm_text(2, 0, 0.2)) as ep:
        q = await collect(bus, bus.subjects.telemetry("w"), WorkerLoad)
        agent = await start_agent(bus, static_targets=parse_targets(f"w={ep.url}"))
        try:
            assert agent.gpu is None and "NVML unavailable" in agent.nvml_reason
            load = await next_matching(q, lambda m: not m.stale)
            assert load.running == 2 and load.gpus == []
        finally:
            await agent.stop()
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml.make_module([]))
    agent = await start_agent(bus)
    try:
        assert agent.gpu is None and "no GPU devices" in agent.nvml_reason
    finally:
        await agent.stop()


async def test_gpu_mapped_by_engine_pid_from_nvml_process_list(bus: Bus, fake_pynvml) -> None:
    """The endpoint is served by this process: its pid listens on the port, and fake GPU 1
    runs this pid, so the worker gets GPU 1 with no --gpu-map."""
    fake_pynvml.devices[1].pids = [os.getpid()]
    async with endpoint(vllm_text(1, 0, 0.1)) as ep:
        q = await collect(bus, bus.subjects.telemetry("p"), WorkerLoad)
        agent = await start_agent(bus, static_targets=parse_targets(f"p={ep.url}"))
        try:
            await agent.refresh_mapping()
            assert agent.assignment.gpus_of("p") == [1]
            load = await next_matching(q, lambda m: len(m.gpus) == 1)
            assert load.gpus[0].index == 1 and load.gpus[0].sm_util_pct == 3
        finally:
            await agent.stop()


async def test_heartbeat_discovery_uses_capacity(bus: Bus) -> None:
    async with endpoint(vllm_text(4, 0, 0.3).replace("vllm:cache_config_info", "x_info")) as ep:
        q = await collect(bus, bus.subjects.telemetry("hb-1"), WorkerLoad)
        agent = await start_agent(bus, use_nvml=False)
        try:
            hb = WorkerHeartbeat(
                worker_id="hb-1",
                instance_id=uuid.uuid4().hex[:8],
                url=ep.url,
                model="m",
                capacity=WorkerCapacity(
                    block_size=16, num_gpu_blocks=160, max_num_seqs=64, max_model_len=4096
                ),
                engine="sim",
            )
            await bus.publish(bus.subjects.heartbeat("hb-1"), hb)
            load = await next_matching(q, lambda m: not m.stale)
            assert load.source == "sim" and load.running == 4
            assert load.max_batch == 64 and load.kv_capacity_tokens == 2560
        finally:
            await agent.stop()


def heartbeat(worker: str, url: str) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker,
        instance_id=uuid.uuid4().hex[:8],
        url=url,
        model="m",
        engine="vllm",
        capacity=WorkerCapacity(
            block_size=16, num_gpu_blocks=160, max_num_seqs=64, max_model_len=4096
        ),
    )


@pytest.mark.parametrize("how", ["globs", "local_only"])
async def test_worker_filter_leaves_other_workers_to_their_agents(bus: Bus, how: str) -> None:
    """With one agent per node, an agent scrapes only the discovered workers it is given
    (worker-id globs) or whose engine runs on its own node; static targets always."""
    async with endpoint(vllm_text(2, 0, 0.1)) as mine, endpoint(vllm_text(7, 0, 0.1)) as other:
        q = await collect(bus, bus.subjects.telemetry("node1-a"), WorkerLoad)
        if how == "globs":
            kw: dict = {"workers": ("node1-*", "static-x")}
            other_url = other.url  # served here, but its id does not match
        else:
            kw = {"local_only": True}
            other_url = f"http://198.51.100.7:{other.port}"  # an address of another node
        agent = await start_agent(
            bus, use_nvml=False, static_targets=parse_targets(f"st={mine.url}@vllm"), **kw
        )
        try:
            # the other node's worker heartbeats first: by the time the own worker's first
            # sample arrives (same publisher, ordered), its heartbeat has been handled too
            await bus.publish(bus.subjects.heartbeat("node2-b"), heartbeat("node2-b", other_url))
            await bus.publish(bus.subjects.heartbeat("node1-a"), heartbeat("node1-a", mine.url))
            load = await next_matching(q, lambda m: not m.stale)
            assert load.running == 2
            assert set(agent.workers) == {"st", "node1-a"}  # static target kept
            assert other.hits == 0
            # a later heartbeat of the skipped worker does not add it either (the handler,
            # called directly: nothing to wait for)
            await agent._on_heartbeat(heartbeat("node2-b", other_url), None)
            assert "node2-b" not in agent.workers and other.hits == 0
        finally:
            await agent.stop()


def test_worker_filter_and_slow_series_settings() -> None:
    import argparse

    from services.common import settings as S
    from services.telemetry.cli import OPTIONS, add_arguments, agent_config

    env = {
        "KVGATE_TELEMETRY_WORKERS": "node1-*, gpu-a",
        "KVGATE_TELEMETRY_LOCAL_ONLY": "true",
        "KVGATE_TELEMETRY_ENGINE_SLOW_EVERY": "5",
    }
    cfg = agent_config(S.resolve(None, OPTIONS, env))
    assert cfg.workers == ("node1-*", "gpu-a") and cfg.local_only is True
    assert cfg.engine_slow_every == 5
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = agent_config(S.resolve(parser.parse_args(["--workers", "x-?"]), OPTIONS, {}))
    assert cfg.workers == ("x-?",) and cfg.local_only is False


async def test_seed_001_trtllm_raises_kv_starved_alert_then_resolves(bus: Bus) -> None:
    """8 active, 1 scheduled, KV blocks nearly all used: alert with the TRT-LLM remedy,
    read back from NATS; once the batch schedules again the alert resolves."""
    alerts = await collect(bus, bus.subjects.alert_signal("telemetry"), Alert)
    async with endpoint(trtllm_text(8, 1, max_batch=64, used=39, total=40, tpb=64)) as ep:
        agent = await start_agent(
            bus,
            use_nvml=False,
            static_targets=parse_targets(f"trt-0={ep.url}@trtllm"),
            detect_interval_s=0.1,
            clear_s=0.3,
            detectors={"kv_starved": {"window_s": 0.6}},
        )
        try:
            a = await next_matching(alerts, lambda m: m.kind == "kv_starved")
            assert a.state == "firing" and a.fingerprint == "kv_starved:trt-0"
            assert a.source == "telemetry" and a.worker_id == "trt-0"
            assert "8 active but only 1 scheduled" in a.summary
            assert "max_tokens_in_paged_kv_cache" in a.remedy
            assert a.details["kv_capacity_tokens"] == 2560
            # stored durably in the alert-signals stream for the alert manager
            info = await bus.js.stream_info(bus.subjects.alert_signals_stream)
            assert info.state.messages >= 1
            ep.text = trtllm_text(8, 8, max_batch=64, used=20, total=40, tpb=64)
            r = await next_matching(alerts, lambda m: m.kind == "kv_starved")
            assert r.state == "resolved"
            assert (r.fingerprint, r.severity, r.worker_id) == (a.fingerprint, a.severity, "trt-0")
            assert r.ts > a.ts
        finally:
            await agent.stop()


async def test_xid_error_and_kv_event_counting(bus: Bus, fake_pynvml) -> None:
    alerts = await collect(bus, bus.subjects.alert_signal("telemetry"), Alert)
    async with endpoint(vllm_text(1, 0, 0.1)) as ep:
        q = await collect(bus, bus.subjects.telemetry("x"), WorkerLoad)
        agent = await start_agent(
            bus,
            static_targets=parse_targets(f"x={ep.url}"),
            gpu_map={"x": (0,)},
            detect_interval_s=0.1,
        )
        try:
            fake_pynvml.inject_xid(0, 79)
            load = await next_matching(q, lambda m: m.gpus and m.gpus[0].xid_errors == 1)
            assert load.gpus[0].last_xid == 79
            a = await next_matching(alerts, lambda m: m.kind == "xid_error")
            assert a.severity == "critical" and "XID 79" in a.summary
            await bus.publish_raw(bus.subjects.kv_events("x"), b"\x80")
            await bus.client.flush()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5
            # no event exists for "counted": poll the counter with a deadline
            while agent.kv_events.get("x", 0) < 1 and loop.time() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            assert agent.kv_events["x"] == 1
        finally:
            await agent.stop()


@pytest.mark.parametrize("mode", ["prometheus", "broken", "ignore"])
async def test_name_filter_is_used_where_honoured_and_dropped_where_not(
    bus: Bus, mode: str
) -> None:
    async with endpoint(vllm_text(6, 2, 0.5, queries=10, hits=5)) as ep:
        ep.name_filter = mode
        q = await collect(bus, bus.subjects.telemetry("f"), WorkerLoad)
        agent = await start_agent(
            bus, use_nvml=False, static_targets=parse_targets(f"f={ep.url}@vllm")
        )
        try:
            for _ in range(3):  # several scrapes: the fallback (if any) has happened by then
                load = await next_matching(q, lambda m: not m.stale)
                assert (load.running, load.waiting, load.kv_usage) == (6, 2, 0.5)
                assert (load.prefix_cache_queries, load.kv_capacity_tokens) == (10, 2560)
            assert "name[]=vllm:num_requests_running" in ep.queries[0]  # (decoded by aiohttp)
            filtered_last = "name[]" in ep.queries[-1]
            assert filtered_last is (mode != "broken")
        finally:
            await agent.stop()


async def test_slow_series_are_asked_for_every_nth_scrape_and_carried(bus: Bus) -> None:
    """Engine configuration and request-length histograms are asked for on every Nth scrape
    only; every record still carries what they say, and a change reaches the records."""
    async with endpoint(vllm_text(5, 1, 0.5, blocks=160, block_size=16, prompt=(900, 9))) as ep:
        ep.name_filter = "prometheus"
        q = await collect(bus, bus.subjects.telemetry("slow"), WorkerLoad)
        agent = await start_agent(
            bus,
            use_nvml=False,
            static_targets=parse_targets(f"slow={ep.url}@vllm"),
            engine_slow_every=3,
        )
        try:
            for _ in range(8):
                load = await next_matching(q, lambda m: not m.stale)
                assert (load.running, load.waiting, load.kv_usage) == (5, 1, 0.5)
                assert (load.kv_capacity_tokens, load.tokens_per_block) == (2560, 16)
                assert (load.kv_blocks_total, load.kv_blocks_free) == (160, 80)
                assert load.prefix_caching is True
            fast = [x for x in ep.queries if "cache_config_info" not in x]
            assert fast and "num_requests_running" in fast[0]
            assert len(fast) >= len(ep.queries) / 2  # most scrapes ask for the fast ones only
            ep.text = vllm_text(5, 1, 0.25, blocks=320, block_size=16)
            load = await next_matching(q, lambda m: m.kv_capacity_tokens == 5120)
            assert (load.kv_blocks_total, load.kv_blocks_free, load.kv_usage) == (320, 240, 0.25)
        finally:
            await agent.stop()


async def test_stop_completes_even_if_a_library_swallows_the_cancellation(
    bus: Bus, unused_port: int, monkeypatch
) -> None:
    """Python 3.11's asyncio.wait_for (used by nats-py's request) can lose a cancellation when
    the reply lands at the same moment; the agent must still stop."""
    from services.telemetry import publish as publish_mod

    entered = asyncio.Event()

    async def swallowing_raise_alert(_bus, _alert) -> None:
        entered.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            return  # the reply "won the race": the cancellation is lost

    monkeypatch.setattr(publish_mod, "raise_alert", swallowing_raise_alert)
    agent = await start_agent(
        bus,
        use_nvml=False,
        static_targets=parse_targets(f"gone=http://127.0.0.1:{unused_port}"),
        detect_interval_s=0.05,
        detectors={"stale_telemetry": {"after_s": 0.1}},
    )
    await asyncio.wait_for(entered.wait(), 10)
    await asyncio.wait_for(agent.stop(), 8)
    assert all(t.done() for t in agent._tasks) or not agent._tasks


@pytest.mark.slow
async def test_alerts_reach_operators_through_the_api_alert_manager(
    bus: Bus, fresh_database_url: str
) -> None:
    """Detector -> alerting.signals.telemetry -> the admin API's alert manager (real Postgres)
    -> alerts.<severity>.<kind>: firing once while the condition holds, then resolved."""
    from services.api.alerting import AlertManager
    from services.api.db import Database
    from services.api.testing import migrate

    await migrate(fresh_database_url)
    db = Database(fresh_database_url)
    manager = AlertManager(db, bus)
    await manager.start()
    managed = await collect(bus, bus.subjects.alert("warning", "kv_starved"), Alert)
    async with endpoint(trtllm_text(8, 1, max_batch=64, used=39, total=40, tpb=64)) as ep:
        agent = await start_agent(
            bus,
            use_nvml=False,
            static_targets=parse_targets(f"trt-9={ep.url}@trtllm"),
            detect_interval_s=0.1,
            clear_s=0.3,
            detectors={"kv_starved": {"window_s": 0.6}},
        )
        try:
            a = await next_matching(managed, lambda m: m.worker_id == "trt-9", timeout=15)
            assert a.state == "firing" and a.alert_id and a.source == "telemetry"
            assert "max_tokens_in_paged_kv_cache" in a.remedy
            ep.text = trtllm_text(8, 8, max_batch=64, used=20, total=40, tpb=64)
            r = await next_matching(managed, lambda m: m.worker_id == "trt-9", timeout=15)
            assert r.state == "resolved" and r.alert_id == a.alert_id
        finally:
            await agent.stop()
            await manager.stop()
            await db.close()


async def test_identical_answers_are_parsed_once_and_a_change_is_seen(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle engine answers the same bytes every tick: the reading is reused (at most one
    parse per path), and the first different answer is parsed and published."""
    import services.telemetry.scrape as scrape_mod

    calls = {"n": 0}
    real_parse = scrape_mod.parse_metrics

    def counting(text: str, engine: str | None = None):
        calls["n"] += 1
        return real_parse(text, engine)

    monkeypatch.setattr(scrape_mod, "parse_metrics", counting)
    q = await collect(bus, bus.subjects.telemetry("w-idle"), WorkerLoad)
    async with endpoint(vllm_text(3, 1, 0.25)) as ep:
        agent = await start_agent(
            bus, use_nvml=False, static_targets=parse_targets(f"w-idle={ep.url}@vllm")
        )
        try:
            for _ in range(6):
                load = await next_matching(q, lambda m: not m.stale)
                assert (load.running, load.waiting) == (3, 1)
            assert 1 <= calls["n"] <= 2  # first scrape (task path) + first callback answer
            ep.text = vllm_text(9, 4, 0.5)
            load = await next_matching(q, lambda m: not m.stale and m.running == 9)
            assert load.waiting == 4 and load.kv_usage == pytest.approx(0.5)
        finally:
            await agent.stop()


def _refused(reason: str) -> float:
    return (
        REGISTRY.get_sample_value("kvgate_telemetry_heartbeats_refused_total", {"reason": reason})
        or 0.0
    )


async def test_heartbeat_cannot_move_a_workers_scrape_url(bus: Bus) -> None:
    """A stolen worker credential must not point the agent's HTTP requests at another host:
    the URL of the first accepted heartbeat is pinned, a heartbeat naming another one is
    refused (counted) and the engine keeps being scraped where it was; once the worker is
    forgotten, its next heartbeat may name a new URL."""
    async with endpoint(vllm_text(3, 0, 0.1)) as real, endpoint(vllm_text(9, 0, 0.1)) as other:
        q = await collect(bus, bus.subjects.telemetry("pin-a"), WorkerLoad)
        agent = await start_agent(bus, use_nvml=False)
        try:
            await agent._on_heartbeat(heartbeat("pin-a", real.url), None)
            assert (await next_matching(q, lambda m: not m.stale)).running == 3
            before = _refused("url_changed")
            await agent._on_heartbeat(heartbeat("pin-a", other.url), None)
            assert _refused("url_changed") == before + 1
            for _ in range(3):  # later scrapes still go to the pinned engine only
                assert (await next_matching(q, lambda m: not m.stale)).running == 3
            assert other.hits == 0
            assert agent.workers["pin-a"].target.url.startswith(real.url)
            # forgotten (no accepted heartbeat for forget_after_s): the pin goes with it
            await agent.detect_once(time.time() + agent.cfg.forget_after_s + 1)
            assert "pin-a" not in agent.workers
            await agent._on_heartbeat(heartbeat("pin-a", other.url), None)
            assert (await next_matching(q, lambda m: not m.stale and m.running == 9)).running == 9
        finally:
            await agent.stop()


async def test_url_allowlist_admits_moves_and_bounds_discovery(bus: Bus) -> None:
    from services.core.url_pin import parse_allowlist

    async with endpoint(vllm_text(3, 0, 0.1)) as first, endpoint(vllm_text(5, 0, 0.1)) as moved:
        q = await collect(bus, bus.subjects.telemetry("pin-b"), WorkerLoad)
        agent = await start_agent(bus, use_nvml=False, url_allow=parse_allowlist("127.0.0.1"))
        try:
            before = _refused("url_not_allowed")
            await agent._on_heartbeat(heartbeat("pin-c", "http://198.51.100.9:8000"), None)
            assert "pin-c" not in agent.workers
            assert _refused("url_not_allowed") == before + 1
            await agent._on_heartbeat(heartbeat("pin-b", first.url), None)
            assert (await next_matching(q, lambda m: not m.stale)).running == 3
            await agent._on_heartbeat(heartbeat("pin-b", moved.url), None)  # inside the list
            assert (await next_matching(q, lambda m: not m.stale and m.running == 5)).running == 5
        finally:
            await agent.stop()


def test_worker_url_allow_option_is_checked() -> None:
    from services.common import settings as S
    from services.telemetry.cli import OPTIONS, agent_config

    cfg = agent_config(
        S.resolve(None, OPTIONS, {"KVGATE_TELEMETRY_WORKER_URL_ALLOW": "10.0.0.0/8"})
    )
    assert cfg.url_allow.allows("http://10.1.2.3:8000")
    with pytest.raises(SystemExit, match="invalid --worker-url-allow"):
        agent_config(S.resolve(None, OPTIONS, {"KVGATE_TELEMETRY_WORKER_URL_ALLOW": "a b"}))
