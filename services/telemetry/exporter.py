"""Prometheus metrics of the telemetry agent.

GPU and worker gauges are produced by a custom collector from the agent's latest readings at
scrape time, so a 10 Hz sampling loop pays nothing for them (no per-sample ``.labels().set()``).
Counters (scrapes, scrape errors, alerts) are ordinary prometheus-client counters.

GPU metrics (labels ``gpu``, ``worker``; ``worker`` is the comma-joined list of workers mapped
to the GPU, empty when unmapped). They come from NVML on the node, and from the engines that
report their own GPU (the simulated workers' ``sim:gpu_*`` gauges), so the simulated stack has
GPU panels too. Prometheus conventions: base units, 0-1 ``_ratio`` gauges, ``_total`` counters.

- ``kvgate_gpu_sm_utilization_ratio``, ``kvgate_gpu_memory_utilization_ratio`` (occupancy),
  ``kvgate_gpu_memory_bandwidth_utilization_ratio``
- ``kvgate_gpu_memory_used_bytes``, ``kvgate_gpu_memory_total_bytes``,
  ``kvgate_gpu_memory_free_bytes``, ``kvgate_gpu_pcie_rx_bytes_per_second``,
  ``kvgate_gpu_pcie_tx_bytes_per_second``, ``kvgate_gpu_sm_clock_hertz``,
  ``kvgate_gpu_memory_clock_hertz``, ``kvgate_gpu_temperature_celsius``,
  ``kvgate_gpu_power_watts``
- counters ``kvgate_gpu_xid_errors_total`` (since the agent started) and
  ``kvgate_gpu_ecc_uncorrected_errors_total`` (NVML's volatile count)

Worker gauges (label ``worker``): ``kvgate_telemetry_prefix_cache_hit_ratio``,
``kvgate_telemetry_kv_usage_ratio``, ``kvgate_telemetry_requests_running``,
``kvgate_telemetry_requests_waiting``, ``kvgate_telemetry_sample_age_seconds``,
``kvgate_telemetry_stale``.

Aliases kept from the first release (same values, documented in docs/telemetry.md):
``gpu_utilization_percent`` (= 100 x ``kvgate_gpu_sm_utilization_ratio``) and
``kv_cache_hit_rate{worker}`` (= ``kvgate_telemetry_prefix_cache_hit_ratio``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.schemas import GpuSample, WorkerLoad

SCRAPES = Counter("kvgate_telemetry_scrapes_total", "Engine metric scrapes", ["result"])
HEARTBEATS_REFUSED = Counter(
    "kvgate_telemetry_heartbeats_refused_total",
    "Heartbeats refused because they moved a worker's pinned engine URL (or named one outside "
    "--worker-url-allow); the engine keeps being scraped at its pinned URL",
    ["reason"],
)
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

# (name, help, GpuSample attribute, scale to the exported unit)
_GPU_GAUGES: tuple[tuple[str, str, str, float], ...] = (
    (
        "kvgate_gpu_sm_utilization_ratio",
        "SM utilisation, 0-1 (NVML utilization.gpu)",
        "sm_util_pct",
        0.01,
    ),
    (
        "kvgate_gpu_memory_utilization_ratio",
        "Device memory occupancy, used/total, 0-1",
        "mem_util_pct",
        0.01,
    ),
    (
        "kvgate_gpu_memory_bandwidth_utilization_ratio",
        "Share of time device memory was read or written, 0-1 (NVML utilization.memory)",
        "mem_bw_util_pct",
        0.01,
    ),
    ("kvgate_gpu_memory_used_bytes", "Device memory used", "mem_used_bytes", 1.0),
    ("kvgate_gpu_memory_total_bytes", "Device memory total", "mem_total_bytes", 1.0),
    ("kvgate_gpu_memory_free_bytes", "Device memory free", "mem_free_bytes", 1.0),
    ("kvgate_gpu_pcie_rx_bytes_per_second", "PCIe receive throughput", "pcie_rx_bytes_s", 1.0),
    ("kvgate_gpu_pcie_tx_bytes_per_second", "PCIe transmit throughput", "pcie_tx_bytes_s", 1.0),
    ("kvgate_gpu_sm_clock_hertz", "SM clock", "sm_clock_mhz", 1e6),
    ("kvgate_gpu_memory_clock_hertz", "Memory clock", "mem_clock_mhz", 1e6),
    ("kvgate_gpu_temperature_celsius", "GPU temperature", "temperature_c", 1.0),
    ("kvgate_gpu_power_watts", "Power draw", "power_w", 1.0),
    # alias of the first release (seed names): percent, unprefixed
    (
        "gpu_utilization_percent",
        "Alias of kvgate_gpu_sm_utilization_ratio x 100 (kept for existing dashboards)",
        "sm_util_pct",
        1.0,
    ),
)
_GPU_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("kvgate_gpu_xid_errors", "Critical XID errors seen since the agent started", "xid_errors"),
    (
        "kvgate_gpu_ecc_uncorrected_errors",
        "Volatile uncorrected ECC errors (NVML; resets with the driver)",
        "ecc_errors",
    ),
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
            for name, doc, _, _ in _GPU_GAUGES
        }
        counters = {
            name: CounterMetricFamily(name, doc, labels=["gpu", "worker"])
            for name, doc, _ in _GPU_COUNTERS
        }
        for g, workers in self._gpus():
            labels = [str(g.index), ",".join(workers)]
            for name, _, attr, scale in _GPU_GAUGES:
                value = getattr(g, attr)
                if value is not None:
                    fams[name].add_metric(labels, float(value) * scale)
            for name, _, attr in _GPU_COUNTERS:
                value = getattr(g, attr)
                if value is not None:
                    counters[name].add_metric(labels, float(value))
        yield from fams.values()
        yield from counters.values()
        hit = GaugeMetricFamily(
            "kvgate_telemetry_prefix_cache_hit_ratio",
            "Prefix-cache hit ratio the engine reports (hits / queries), 0-1",
            labels=["worker"],
        )
        hit_alias = GaugeMetricFamily(
            "kv_cache_hit_rate",
            "Alias of kvgate_telemetry_prefix_cache_hit_ratio (kept for existing dashboards)",
            labels=["worker"],
        )
        kv = GaugeMetricFamily(
            "kvgate_telemetry_kv_usage_ratio", "KV cache usage, 0-1", labels=["worker"]
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
                (hit_alias, load.cache_hit_rate),
                (kv, load.kv_usage),
                (run, load.running),
                (wait, load.waiting),
            ):
                if value is not None:
                    fam.add_metric([w], float(value))
            age.add_metric([w], max(0.0, now - load.ts))
            stale.add_metric([w], 1.0 if load.stale else 0.0)
        yield from (hit, hit_alias, kv, run, wait, age, stale)


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
