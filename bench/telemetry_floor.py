"""Reference loops for ``bench_telemetry --floor``: what the telemetry benchmark's work costs
when stripped to its bones, measured in the same run against the same endpoints.

These are *not* the agent; they are yardsticks that say how much of the agent's CPU is
overhead that better code could remove, and how much any CPython agent on this machine pays:

- ``io``: 64 keep-alive sockets; each tick reads the answer to the previous tick's GET with
  one non-blocking ``recv`` and sends the next GET. No HTTP parsing, no publishing. This is
  the system-call and wake-up floor of scraping 64 endpoints at 10 Hz.
- ``nvml``: only the three fake-NVML calls per GPU that the agent makes each tick: the cost
  of the (Python) fake library itself, which the benchmark charges to the agent.
- ``lean``: ``io`` plus the least a correct record needs: the HTTP status/length check, the
  vLLM values picked out of the body with one regex, a ``WorkerLoad`` with one ``GpuSample``
  (three fake-NVML calls per GPU, as the agent makes), msgpack encoding and one NATS publish
  per worker. No stale/error handling, no slow series, no detectors, no bookkeeping.

Both run one tick per interval on the event loop (one wake-up per tick), like the agent.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from typing import Any

_HEAD = re.compile(
    rb"HTTP/1\.1 (\d{3}) [^\r]*\r\n(?:[^\r]*\r\n)*?[Cc]ontent-[Ll]ength: *(\d+)\r\n"
    rb"(?:[^\r]*\r\n)*?\r\n"
)
_PAIR = re.compile(rb"\n(vllm:[a-z_]+)(?:\{[^\n]*\})?[ \t]+([^ \t\n]+)")


def _connect(ports: list[int]) -> list[socket.socket]:
    socks = []
    for p in ports:
        s = socket.create_connection(("127.0.0.1", p))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(False)
        socks.append(s)
    return socks


def _opt(v: bytes | None, kind: Any) -> Any:
    return None if v is None else kind(float(v))


async def measure_floor(
    kind: str, nats_url: str, ports: list[int], gpus: int, hz: float, warmup: float, duration: float
) -> dict[str, Any]:
    """CPU % of one core of the ``kind`` ('io', 'nvml' or 'lean') loop over ``duration`` s."""
    import nats

    from services.common.schemas import GpuSample, WorkerLoad, encode
    from services.telemetry import fake_nvml
    from services.telemetry.engines import filter_query

    socks = _connect(ports)
    req = f"GET /metrics?{filter_query('vllm', True)} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    lib = fake_nvml.make_module(
        [
            fake_nvml.FakeGpu(
                sm_util=50, mem_util=30, mem_used=40 * 2**30, pcie_rx_rate=1e9, pcie_tx_rate=5e8
            )
            for _ in range(gpus)
        ]
    )
    lib.nvmlInit()
    handles = [lib.nvmlDeviceGetHandleByIndex(i) for i in range(gpus)]
    fields = [
        lib.NVML_FI_DEV_PCIE_COUNT_RX_BYTES,
        lib.NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
        lib.NVML_FI_DEV_POWER_INSTANT,
    ]
    last: list[tuple[float, int, int] | None] = [None] * gpus
    subjects = [f"floor{id(socks)}.telemetry.w{i}" for i in range(len(socks))]
    nc = await nats.connect(nats_url)
    publish = nc.publish
    published = 0

    def gpu_samples() -> list[GpuSample]:
        out = []
        for i, h in enumerate(handles):
            u = lib.nvmlDeviceGetUtilizationRates(h)
            m = lib.nvmlDeviceGetMemoryInfo(h)
            fv = lib.nvmlDeviceGetFieldValues(h, fields)
            t, rx, tx = fv[0].timestamp / 1e6, fv[0].value.ullVal, fv[1].value.ullVal
            prev, last[i] = last[i], (t, rx, tx)
            dt = t - prev[0] if prev else 0.0
            out.append(
                GpuSample(
                    index=i,
                    sm_util_pct=float(u.gpu),
                    mem_util_pct=100.0 * m.used / m.total,
                    mem_used_bytes=m.used,
                    mem_total_bytes=m.total,
                    mem_free_bytes=m.free,
                    mem_bw_util_pct=float(u.memory),
                    pcie_rx_bytes_s=(rx - prev[1]) / dt if prev and dt > 0 else None,
                    pcie_tx_bytes_s=(tx - prev[2]) / dt if prev and dt > 0 else None,
                    power_w=fv[2].value.uiVal / 1000.0,
                )
            )
        return out

    async def tick() -> None:
        nonlocal published
        if kind == "nvml":
            for h in handles:
                lib.nvmlDeviceGetUtilizationRates(h)
                lib.nvmlDeviceGetMemoryInfo(h)
                lib.nvmlDeviceGetFieldValues(h, fields)
            return
        now = time.time()
        gs = gpu_samples() if kind == "lean" else []
        for i, s in enumerate(socks):
            try:
                data = s.recv(65536)
            except BlockingIOError:
                continue
            s.send(req)
            if kind != "lean":
                continue
            head = _HEAD.match(data)
            if head is None or head[1] != b"200":
                continue
            get = dict(_PAIR.findall(b"\n" + data[head.end() :])).get
            load = WorkerLoad(
                worker_id=f"w{i}",
                ts=now,
                source="vllm",
                running=_opt(get(b"vllm:num_requests_running"), int),
                waiting=_opt(get(b"vllm:num_requests_waiting"), int),
                kv_usage=_opt(get(b"vllm:kv_cache_usage_perc"), float),
                prefix_cache_queries=_opt(get(b"vllm:prefix_cache_queries_total"), float),
                prefix_cache_hits=_opt(get(b"vllm:prefix_cache_hits_total"), float),
                gpus=gs[i : i + 1],
            )
            await publish(subjects[i], encode(load))
            published += 1

    try:
        for s in socks:
            s.send(req)
        loop = asyncio.get_running_loop()
        interval = 1.0 / hz
        next_at = loop.time()
        t_end_warm = time.monotonic() + warmup
        c0 = t0 = 0.0
        p0 = 0
        measuring = False
        while True:
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            if not measuring and time.monotonic() >= t_end_warm:
                measuring, t0, c0, p0 = True, time.monotonic(), time.process_time(), published
            if measuring and time.monotonic() - t0 >= duration:
                break
            await tick()
        wall, cpu = time.monotonic() - t0, time.process_time() - c0
    finally:
        await nc.close()
        for s in socks:
            s.close()
    return {
        "kind": kind,
        "cpu_pct_of_one_core": round(100.0 * cpu / wall, 2),
        "publishes_per_s": round((published - p0) / wall, 1),
    }
