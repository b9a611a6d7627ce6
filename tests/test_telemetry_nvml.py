"""The NVML collector against the fake NVML library: the values it publishes per device, the
fast path for healthy devices, and None (never 0) for what a device refuses or when it is lost,
with recovery once it answers again."""

from __future__ import annotations

import time

import pytest

from services.telemetry import fake_nvml
from services.telemetry.nvml import GpuCollector

GiB = 2**30


def collector(gpus: list[fake_nvml.FakeGpu], slow_every: int = 10) -> tuple[GpuCollector, object]:
    lib = fake_nvml.make_module(gpus)
    lib.nvmlInit()
    return GpuCollector(lib, slow_every=slow_every), lib


def test_healthy_devices_publish_every_reading() -> None:
    g = fake_nvml.FakeGpu(
        sm_util=87,
        mem_util=41,
        mem_used=60 * GiB,
        pcie_rx_rate=2e9,
        pcie_tx_rate=5e8,
        temperature=63,
        power_mw=512_345,
        sm_clock=1755,
        mem_clock=2619,
        ecc_uncorrected=2,
    )
    c, _ = collector([g, fake_nvml.FakeGpu(sm_util=3)])
    first = c.sample()
    assert first[0].pcie_rx_bytes_s is None  # a rate needs two readings of the counters
    time.sleep(0.02)  # an interval for the rate (NVML stamps its counters in microseconds)
    s = c.sample()[0]
    assert (s.index, s.uuid, s.name) == (0, "GPU-fake-0000", "NVIDIA H100 80GB HBM3")
    assert (s.sm_util_pct, s.mem_bw_util_pct) == (87.0, 41.0)
    assert (s.mem_used_bytes, s.mem_total_bytes, s.mem_free_bytes) == (60 * GiB, 80 * GiB, 20 * GiB)
    assert s.mem_util_pct == pytest.approx(75.0)
    assert s.pcie_rx_bytes_s == pytest.approx(2e9, rel=1e-2)
    assert s.pcie_tx_bytes_s == pytest.approx(5e8, rel=1e-2)
    assert s.power_w == pytest.approx(512.345)
    assert (s.sm_clock_mhz, s.mem_clock_mhz, s.temperature_c) == (1755.0, 2619.0, 63.0)
    assert (s.ecc_errors, s.xid_errors, s.last_xid) == (2, 0, None)
    assert c.sample()[1].sm_util_pct == 3.0
    assert not c.errors
    # slow fields are re-read every slow_every samples, fast ones every sample
    g.temperature, g.sm_util = 70, 10
    for _ in range(9):
        s = c.sample()[0]
        if s.temperature_c == 70:
            break
    assert s.sm_util_pct == 10.0 and s.temperature_c == 70.0


def test_refused_readings_are_none_never_zero() -> None:
    no_ecc = fake_nvml.FakeGpu(sm_util=50, unsupported={"ecc"})
    no_counters = fake_nvml.FakeGpu(
        sm_util=20, pcie_rx_total=10 * 2**20, power_mw=90_000, unsupported={"pcie_counters"}
    )
    no_power_field = fake_nvml.FakeGpu(power_mw=250_000, unsupported={"power_field"})
    c, _ = collector([no_ecc, no_counters, no_power_field], slow_every=1)
    for _ in range(2):
        a, b, p = c.sample()
    assert a.ecc_errors is None and a.sm_util_pct == 50.0 and a.power_w == 100.0
    assert c.errors[(0, "ecc")] == "Not Supported"
    # no PCIe byte counters: NVML's throughput sampler (KB/s) on the slow cadence
    assert b.pcie_rx_bytes_s == (10 * 2**20 // 1024 % 10_000_000) * 1024.0
    assert b.sm_util_pct == 20.0 and b.power_w == 90.0
    # no instant-power field: nvmlDeviceGetPowerUsage (milliwatts)
    assert p.power_w == 250.0 and p.pcie_rx_bytes_s is not None


def test_lost_gpu_reads_none_then_recovers() -> None:
    g = fake_nvml.FakeGpu(sm_util=66, mem_used=GiB, pcie_rx_rate=1e9)
    c, _ = collector([g, fake_nvml.FakeGpu(sm_util=5)], slow_every=1)
    c.sample()
    g.lost = True
    lost, other = c.sample()
    assert lost.sm_util_pct is None and lost.mem_used_bytes is None
    assert lost.pcie_rx_bytes_s is None and lost.power_w is None
    assert lost.temperature_c is None and lost.ecc_errors is None
    assert other.sm_util_pct == 5.0  # the other device is unaffected
    assert c.errors[(0, "utilization")] == "GPU is lost"
    g.lost = False
    c.sample()
    time.sleep(0.02)  # an interval for the rate
    back = c.sample()[0]
    assert back.sm_util_pct == 66.0 and back.mem_used_bytes == GiB
    # the PCIe byte counters are used again (a lost GPU is not "no counters")
    assert back.pcie_rx_bytes_s == pytest.approx(1e9, rel=1e-2)
    assert (0, "utilization") not in c.errors
