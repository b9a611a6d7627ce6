"""Prometheus metrics of the telemetry agent.

GPU and worker gauges are produced by a custom collector from the agent's latest readings at
scrape time, so a 10 Hz sampling loop pays nothing for them (no per-sample ``.labels().set()``).
Counters (scrapes, scrape errors, alerts) are ordinary prometheus-client counters.

GPU gauges (labels ``gpu``, ``worker``; ``worker`` is the comma-joined list of workers mapped to
the GPU, empty when unmapped): ``gpu_utilization_percent`` (SM), ``gpu_memory_utilization_percent``
(occupancy), ``gpu_memory_bandwidth_utilization_percent``, ``gpu_memory_used_bytes``,
``gpu_memory_total_bytes``, ``gpu_memory_free_bytes``, ``gpu_pcie_rx_bytes_per_second``,
``gpu_pcie_tx_bytes_per_second``, ``gpu_sm_clock_mhz``, ``gpu_memory_clock_mhz``,
``gpu_temperature_celsius``, ``gpu_power_watts``, ``gpu_xid_errors`` and
``gpu_ecc_uncorrected_errors``. Worker gauges (label ``worker``): ``kv_cache_hit_rate``,
``kvgate_telemetry_kv_usage_ratio``, ``kvgate_telemetry_requests_running``,
``kvgate_telemetry_requests_waiting``, ``kvgate_telemetry_sample_age_seconds``,
``kvgate_telemetry_stale``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.schemas import GpuSample, WorkerLoad

SCRAPES = Counter("kvgate_telemetry_scrapes_total", "Engine metric scrapes", ["result"])
SCRAPE_ERRORS = Counter(
    "kvgate_telemetry_scrape_errors_total", "Failed engine metric scrapes", ["worker", "reason"]
)
ALERTS = Counter(
    "kvgate_telemetry_alerts_total", "Alert signals raised by the detectors", ["kind", "state"]
)
ALERT_SEND_ERRORS = Counter(
    "kvgate_telemetry_alert_send_errors_total", "Alert signals that could not be sent (retried)"
)
PUBLISH_ERRORS = Counter(
    "kvgate_telemetry_publish_errors_total", "WorkerLoad messages that could not be published"
)
SCRAPE_SECONDS = Histogram(
    "kvgate_telemetry_scrape_seconds",
    "Wall time of one engine metrics scrape",
    buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)

_GPU_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("gpu_utilization_percent", "SM utilisation (NVML utilization.gpu)", "sm_util_pct"),
    ("gpu_memory_utilization_percent", "Device memory occupancy, used/total", "mem_util_pct"),
    (
        "gpu_memory_bandwidth_utilization_percent",
        "Share of time device memory was read or written (NVML utilization.memory)",
        "mem_bw_util_pct",
    ),
    ("gpu_memory_used_bytes", "Device memory used", "mem_used_bytes"),
    ("gpu_memory_total_bytes", "Device memory total", "mem_total_bytes"),
    ("gpu_memory_free_bytes", "Device memory free", "mem_free_bytes"),
    ("gpu_pcie_rx_bytes_per_second", "PCIe receive throughput", "pcie_rx_bytes_s"),
    ("gpu_pcie_tx_bytes_per_second", "PCIe transmit throughput", "pcie_tx_bytes_s"),
    ("gpu_sm_clock_mhz", "SM clock", "sm_clock_mhz"),
    ("gpu_memory_clock_mhz", "Memory clock", "mem_clock_mhz"),
    ("gpu_temperature_celsius", "GPU temperature", "temperature_c"),
    ("gpu_power_watts", "Power draw", "power_w"),
    ("gpu_xid_errors", "Critical XID errors seen since the agent started", "xid_errors"),
    ("gpu_ecc_uncorrected_errors", "Volatile uncorrected ECC errors", "ecc_errors"),
)


class TelemetryCollector(Collector):
    """Reads ``gpus()`` -> [(sample, workers)] and ``loads()`` -> {worker: WorkerLoad}."""

    def __init__(
        self,
        gpus: Callable[[], Iterable[tuple[GpuSample, list[str]]]],
        loads: Callable[[], dict[str, WorkerLoad]],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._gpus = gpus
        self._loads = loads
        self._clock = clock

    def describe(self) -> list[Any]:  # no eager collect at registration
        return []

    def collect(self) -> Iterable[Any]:
        fams = {
            name: GaugeMetricFamily(name, doc, labels=["gpu", "worker"])
            for name, doc, _ in _GPU_GAUGES
        }
        for g, workers in self._gpus():
            labels = [str(g.index), ",".join(workers)]
            for name, _, attr in _GPU_GAUGES:
                value = getattr(g, attr)
                if value is not None:
                    fams[name].add_metric(labels, float(value))
        yield from fams.values()
        hit = GaugeMetricFamily("kv_cache_hit_rate", "Prefix-cache hit rate", labels=["worker"])
        kv = GaugeMetricFamily(
            "kvgate_telemetry_kv_usage_ratio", "KV cache usage", labels=["worker"]
        )
        run = GaugeMetricFamily(
            "kvgate_telemetry_requests_running", "Requests running", labels=["worker"]
        )
        wait = GaugeMetricFamily(
            "kvgate_telemetry_requests_waiting", "Requests waiting", labels=["worker"]
        )
        age = GaugeMetricFamily(
            "kvgate_telemetry_sample_age_seconds", "Age of the last sample", labels=["worker"]
        )
        stale = GaugeMetricFamily(
            "kvgate_telemetry_stale", "1 when the last sample is stale", labels=["worker"]
        )
        now = self._clock()
        for w, load in self._loads().items():
            for fam, value in (
                (hit, load.cache_hit_rate),
                (kv, load.kv_usage),
                (run, load.running),
                (wait, load.waiting),
            ):
                if value is not None:
                    fam.add_metric([w], float(value))
            age.add_metric([w], max(0.0, now - load.ts))
            stale.add_metric([w], 1.0 if load.stale else 0.0)
        yield from (hit, kv, run, wait, age, stale)


_registered: list[TelemetryCollector] = []


def register(collector: TelemetryCollector) -> None:
    """Register on the default registry (replacing an earlier agent's, e.g. in tests)."""
    for old in _registered:
        try:
            REGISTRY.unregister(old)
        except KeyError:
            pass
    _registered.clear()
    REGISTRY.register(collector)
    _registered.append(collector)


def unregister(collector: TelemetryCollector) -> None:
    if collector in _registered:
        try:
            REGISTRY.unregister(collector)
        except KeyError:
            pass
        _registered.remove(collector)
