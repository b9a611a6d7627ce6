"""A fake NVML library (the subset :mod:`services.telemetry.nvml` calls) for tests and the cost
benchmark, substituted at the module boundary: ``make_module(gpus)`` returns a module object
shaped like ``pynvml`` (functions, constants, ``NVMLError`` with ``.value``) whose devices
are plain :class:`FakeGpu` objects a test changes between samples.

It mirrors NVML's contracts that the collector depends on: PCIe byte counters are cumulative,
power is in milliwatts, ``nvmlEventSetWait_v2`` raises the TIMEOUT error when no event is
queued, unsupported readings raise NOT_SUPPORTED.
"""

from __future__ import annotations

import time
import types
from collections import deque
from dataclasses import dataclass, field
from typing import Any

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value

    def __str__(self) -> str:
        return {
            NVML_ERROR_NOT_SUPPORTED: "Not Supported",
            NVML_ERROR_TIMEOUT: "Timeout",
            NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
            NVML_ERROR_GPU_IS_LOST: "GPU is lost",
        }.get(self.value, f"NVML error {self.value}")


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = ""
    sm_util: int = 0
    mem_util: int = 0  # NVML utilization.memory (bandwidth busy %)
    mem_total: int = 80 * 2**30
    mem_used: int = 0
    pcie_rx_total: int = 0  # cumulative bytes (plus rate x time when a rate is set)
    pcie_tx_total: int = 0
    pcie_rx_rate: float = 0.0  # bytes/s the counters advance by, on the monotonic clock
    pcie_tx_rate: float = 0.0
    counters_at: float | None = None  # when the counters were last advanced
    sm_clock: int = 1980
    mem_clock: int = 2619
    temperature: int = 40
    power_mw: int = 100_000
    ecc_uncorrected: int = 0
    pids: list[int] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)  # e.g. {"pcie_counters", "ecc"}
    lost: bool = False


@dataclass
class _Value:
    dVal: float = 0.0
    uiVal: int = 0
    ulVal: int = 0
    ullVal: int = 0
    sllVal: int = 0


@dataclass
class _FieldValue:
    fieldId: int
    nvmlReturn: int
    valueType: int
    value: _Value
    timestamp: int = 0  # microseconds, like NVML's (here: on the monotonic clock)


@dataclass
class _EventData:
    device: Any
    eventType: int
    eventData: int


def make_module(gpus: list[FakeGpu] | None = None, *, init_error: int | None = None) -> Any:
    """A ``pynvml``-shaped module over ``gpus`` (``init_error``: nvmlInit raises it)."""
    mod = types.ModuleType("pynvml")
    devs = list(gpus or [])
    for i, g in enumerate(devs):
        if not g.uuid:
            g.uuid = f"GPU-fake-{i:04d}"
    events: deque[_EventData] = deque()
    state = {"init": False, "calls": 0}

    mod.NVMLError = NVMLError
    for k, v in list(globals().items()):
        if k.startswith("NVML_ERROR_") or k == "NVML_SUCCESS":
            setattr(mod, k, v)
    consts = {
        "NVML_FI_DEV_PCIE_COUNT_RX_BYTES": 198,
        "NVML_FI_DEV_PCIE_COUNT_TX_BYTES": 197,
        "NVML_FI_DEV_POWER_INSTANT": 186,
        "NVML_VALUE_TYPE_DOUBLE": 0,
        "NVML_VALUE_TYPE_UNSIGNED_INT": 1,
        "NVML_VALUE_TYPE_UNSIGNED_LONG": 2,
        "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG": 3,
        "NVML_VALUE_TYPE_SIGNED_LONG_LONG": 4,
        "NVML_CLOCK_SM": 1,
        "NVML_CLOCK_MEM": 2,
        "NVML_TEMPERATURE_GPU": 0,
        "NVML_MEMORY_ERROR_TYPE_UNCORRECTED": 1,
        "NVML_VOLATILE_ECC": 0,
        "NVML_PCIE_UTIL_TX_BYTES": 0,
        "NVML_PCIE_UTIL_RX_BYTES": 1,
        "nvmlEventTypeXidCriticalError": 0x8,
    }
    for k, v in consts.items():
        setattr(mod, k, v)

    def _dev(handle: Any) -> FakeGpu:
        state["calls"] += 1
        if not state["init"]:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if handle.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return handle

    def _need(g: FakeGpu, what: str) -> None:
        if what in g.unsupported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)

    def nvmlInit() -> None:
        if init_error is not None:
            raise NVMLError(init_error)
        state["init"] = True

    def nvmlShutdown() -> None:
        state["init"] = False

    def nvmlDeviceGetCount() -> int:
        if not state["init"]:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        return len(devs)

    def nvmlDeviceGetHandleByIndex(i: int) -> FakeGpu:
        return _dev(devs[i])

    def nvmlDeviceGetIndex(h: FakeGpu) -> int:
        return devs.index(_dev(h))

    def nvmlDeviceGetUUID(h: FakeGpu) -> str:
        return _dev(h).uuid

    def nvmlDeviceGetName(h: FakeGpu) -> str:
        return _dev(h).name

    def nvmlDeviceGetUtilizationRates(h: FakeGpu) -> Any:
        g = _dev(h)
        return types.SimpleNamespace(gpu=g.sm_util, memory=g.mem_util)

    def nvmlDeviceGetMemoryInfo(h: FakeGpu) -> Any:
        g = _dev(h)
        return types.SimpleNamespace(
            total=g.mem_total, used=g.mem_used, free=g.mem_total - g.mem_used
        )

    def nvmlDeviceGetFieldValues(h: FakeGpu, ids: list[int]) -> list[_FieldValue]:
        g = _dev(h)
        now = time.monotonic()
        if g.counters_at is not None:  # advance the cumulative counters at the current rates
            g.pcie_rx_total += int(g.pcie_rx_rate * (now - g.counters_at))
            g.pcie_tx_total += int(g.pcie_tx_rate * (now - g.counters_at))
        g.counters_at = now
        out = []
        for fid in ids:
            if fid in (198, 197) and "pcie_counters" in g.unsupported:
                out.append(_FieldValue(fid, NVML_ERROR_NOT_SUPPORTED, 3, _Value()))
            elif fid == 198:
                out.append(_FieldValue(fid, 0, 3, _Value(ullVal=g.pcie_rx_total), int(now * 1e6)))
            elif fid == 197:
                out.append(_FieldValue(fid, 0, 3, _Value(ullVal=g.pcie_tx_total), int(now * 1e6)))
            elif fid == 186 and "power_field" not in g.unsupported:
                out.append(_FieldValue(fid, 0, 1, _Value(uiVal=g.power_mw)))
            else:
                out.append(_FieldValue(fid, NVML_ERROR_NOT_SUPPORTED, 0, _Value()))
        return out

    def nvmlDeviceGetClockInfo(h: FakeGpu, kind: int) -> int:
        g = _dev(h)
        return g.sm_clock if kind == 1 else g.mem_clock

    def nvmlDeviceGetTemperature(h: FakeGpu, _sensor: int) -> int:
        return _dev(h).temperature

    def nvmlDeviceGetPowerUsage(h: FakeGpu) -> int:
        return _dev(h).power_mw

    def nvmlDeviceGetTotalEccErrors(h: FakeGpu, _t: int, _c: int) -> int:
        g = _dev(h)
        _need(g, "ecc")
        return g.ecc_uncorrected

    def nvmlDeviceGetPcieThroughput(h: FakeGpu, counter: int) -> int:
        g = _dev(h)
        _need(g, "pcie")
        return (g.pcie_rx_total if counter == 1 else g.pcie_tx_total) // 1024 % 10_000_000

    def nvmlDeviceGetComputeRunningProcesses(h: FakeGpu) -> list[Any]:
        g = _dev(h)
        return [types.SimpleNamespace(pid=p, usedGpuMemory=0) for p in g.pids]

    def nvmlEventSetCreate() -> Any:
        return events

    def nvmlDeviceRegisterEvents(h: FakeGpu, _types: int, _set: Any) -> None:
        _dev(h)

    def nvmlEventSetWait_v2(_set: Any, _timeout_ms: int) -> _EventData:
        if not events:
            raise NVMLError(NVML_ERROR_TIMEOUT)
        return events.popleft()

    def nvmlEventSetFree(_set: Any) -> None:
        events.clear()

    def inject_xid(index: int, xid: int) -> None:
        """Test hook: queue a critical XID event on device ``index``."""
        events.append(_EventData(devs[index], 0x8, xid))

    for fn in list(locals().values()):
        if callable(fn) and getattr(fn, "__name__", "").startswith(("nvml", "inject")):
            setattr(mod, fn.__name__, fn)
    mod.devices = devs
    mod.state = state
    return mod
