"""The one module that talks to NVML (``nvidia-ml-py``, imported as ``pynvml``).

Everything else in the telemetry agent reads GPUs through :class:`GpuCollector`, so tests (and
the cost benchmark) substitute a fake NVML library at exactly this boundary: either by passing
``lib=`` to :func:`open_collector`, or by putting a fake module in ``sys.modules["pynvml"]``
before the agent starts (``import pynvml`` happens in :func:`load_library`, at open time).

Invariants:
- :func:`open_collector` never raises for a host without GPUs: it returns ``(None, reason)``
  (library missing, driver not loaded, zero devices) and the agent logs ``reason`` once and
  carries on with engine metrics only.
- A metric NVML cannot read on a device (NOT_SUPPORTED, GPU lost, ...) is ``None`` in the
  sample, never 0; the reason is counted per (gpu, field) in :attr:`GpuCollector.errors`.
- Static fields (name, uuid, memory total) are read once per device; fast-changing fields
  (utilisation, memory used, PCIe byte counters) on every :meth:`GpuCollector.sample`; slower
  ones (clocks, temperature, power, ECC) every ``slow_every`` samples (cached in between).
- PCIe throughput is derived from NVML's cumulative PCIe byte counters (field values), which do
  not block; ``nvmlDeviceGetPcieThroughput`` (which samples for 20 ms per call) is only a
  fallback on devices without those counters, read on the slow cadence.
- XID errors arrive through an NVML event set (critical XID events); each :meth:`sample`
  drains it without waiting, and ``xid_errors`` is the count seen since the collector opened.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from services.common.schemas import GpuSample


def load_library() -> ModuleType:
    """Import NVML's Python binding (the module boundary tests substitute)."""
    import pynvml

    return pynvml


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


@dataclass
class _Device:
    index: int
    handle: Any
    uuid: str = ""
    name: str = ""
    mem_total: int | None = None
    pcie_counters: bool = True  # field-value PCIe byte counters available
    power_field: bool = True  # field-value instant power available
    last_rx: tuple[float, int] | None = None  # (monotonic time, cumulative bytes)
    last_tx: tuple[float, int] | None = None
    slow: dict[str, Any] = field(default_factory=dict)
    healthy: bool = False  # answered every per-sample call last time (fast path)
    xid_count: int = 0
    last_xid: int | None = None


class GpuCollector:
    """Samples every visible GPU through one NVML library object (real or fake)."""

    def __init__(
        self, lib: Any, slow_every: int = 10, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.lib = lib
        self.slow_every = max(1, slow_every)
        self._clock = clock
        self._tick = 0
        self.errors: dict[tuple[int, str], str] = {}
        self.devices: list[_Device] = []
        self._events: Any = None
        count = lib.nvmlDeviceGetCount()
        for i in range(count):
            handle = lib.nvmlDeviceGetHandleByIndex(i)
            dev = _Device(index=i, handle=handle)
            dev.uuid = _text(self._try(dev, "uuid", lib.nvmlDeviceGetUUID, handle) or "")
            dev.name = _text(self._try(dev, "name", lib.nvmlDeviceGetName, handle) or "")
            self.devices.append(dev)
        self._open_events()
        self._fields = [
            lib.NVML_FI_DEV_PCIE_COUNT_RX_BYTES,
            lib.NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
            lib.NVML_FI_DEV_POWER_INSTANT,
        ]

    # ------------------------------------------------------------------ helpers
    def _try(self, dev: _Device, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Call NVML; on an NVML error record why and return None (never a made-up 0)."""
        try:
            value = fn(*args)
        except self.lib.NVMLError as exc:
            self.errors[(dev.index, what)] = str(exc) or type(exc).__name__
            return None
        self.errors.pop((dev.index, what), None)
        return value

    def _open_events(self) -> None:
        lib = self.lib
        try:
            self._events = lib.nvmlEventSetCreate()
        except lib.NVMLError as exc:
            self.errors[(-1, "xid_events")] = str(exc)
            return
        for dev in self.devices:
            self._try(
                dev,
                "xid_events",
                lib.nvmlDeviceRegisterEvents,
                dev.handle,
                lib.nvmlEventTypeXidCriticalError,
                self._events,
            )

    def _drain_xid(self) -> None:
        if self._events is None:
            return
        lib = self.lib
        by_handle = {id(d.handle): d for d in self.devices}
        for _ in range(1024):  # bounded: a storm of events cannot stall a sample
            try:
                data = lib.nvmlEventSetWait_v2(self._events, 0)
            except lib.NVMLError as exc:
                if getattr(exc, "value", None) != lib.NVML_ERROR_TIMEOUT:
                    self.errors[(-1, "xid_events")] = str(exc)
                return
            if not data.eventType & lib.nvmlEventTypeXidCriticalError:
                continue
            dev = by_handle.get(id(data.device))
            if dev is None:
                try:
                    idx = lib.nvmlDeviceGetIndex(data.device)
                except lib.NVMLError:
                    continue
                dev = self.devices[idx] if 0 <= idx < len(self.devices) else None
            if dev is not None:
                dev.xid_count += 1
                dev.last_xid = int(data.eventData)

    def _field_values(self, dev: _Device) -> tuple[dict[int, float | None], float]:
        """Field values by id, and when the PCIe counters were read (NVML's own timestamp
        when it gives one, so rates do not absorb scheduling jitter)."""
        lib = self.lib
        out: dict[int, float | None] = {}
        read_at = 0.0
        if not (dev.pcie_counters or dev.power_field):
            return out, read_at
        try:
            values = lib.nvmlDeviceGetFieldValues(dev.handle, self._fields)
        except lib.NVMLError as exc:
            self.errors[(dev.index, "field_values")] = str(exc) or type(exc).__name__
            if getattr(exc, "value", None) == lib.NVML_ERROR_NOT_SUPPORTED:
                dev.pcie_counters = dev.power_field = False  # for good: use the fallbacks
            return out, read_at  # (a lost GPU may come back: try the fields again then)
        self.errors.pop((dev.index, "field_values"), None)
        read_at = self._clock()
        for fv in values:
            if fv.nvmlReturn != lib.NVML_SUCCESS:
                out[fv.fieldId] = None
                continue
            if fv.fieldId == lib.NVML_FI_DEV_PCIE_COUNT_RX_BYTES and getattr(fv, "timestamp", 0):
                read_at = fv.timestamp / 1e6
            vt, v = fv.valueType, fv.value
            if vt == lib.NVML_VALUE_TYPE_DOUBLE:
                out[fv.fieldId] = float(v.dVal)
            elif vt == lib.NVML_VALUE_TYPE_UNSIGNED_INT:
                out[fv.fieldId] = float(v.uiVal)
            elif vt == lib.NVML_VALUE_TYPE_UNSIGNED_LONG:
                out[fv.fieldId] = float(v.ulVal)
            elif vt == lib.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
                out[fv.fieldId] = float(v.sllVal)
            else:
                out[fv.fieldId] = float(v.ullVal)
        if out.get(lib.NVML_FI_DEV_PCIE_COUNT_RX_BYTES) is None:
            dev.pcie_counters = False
        if out.get(lib.NVML_FI_DEV_POWER_INSTANT) is None:
            dev.power_field = False
        return out, read_at

    @staticmethod
    def _rate(prev: tuple[float, int] | None, now: float, total: int) -> float | None:
        if prev is None or now <= prev[0] or total < prev[1]:
            return None
        return (total - prev[1]) / (now - prev[0])

    def _read_slow(self, dev: _Device) -> None:
        """Clocks, temperature, ECC (and fallbacks) -- converted here, once a second, to what
        the samples carry (float MHz / degrees, int ECC count, None when refused)."""
        lib, h = self.lib, dev.handle
        s = dev.slow
        s["sm_clock"] = _opt_float(
            self._try(dev, "sm_clock", lib.nvmlDeviceGetClockInfo, h, lib.NVML_CLOCK_SM)
        )
        s["mem_clock"] = _opt_float(
            self._try(dev, "mem_clock", lib.nvmlDeviceGetClockInfo, h, lib.NVML_CLOCK_MEM)
        )
        s["temp"] = _opt_float(
            self._try(dev, "temperature", lib.nvmlDeviceGetTemperature, h, lib.NVML_TEMPERATURE_GPU)
        )
        if not dev.power_field:
            mw = self._try(dev, "power", lib.nvmlDeviceGetPowerUsage, h)
            s["power_w"] = None if mw is None else mw / 1000.0
        ecc = self._try(
            dev,
            "ecc",
            lib.nvmlDeviceGetTotalEccErrors,
            h,
            lib.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            lib.NVML_VOLATILE_ECC,
        )
        s["ecc"] = None if ecc is None else int(ecc)
        if not dev.pcie_counters:  # blocking 20 ms sampler: slow cadence only
            rx = self._try(
                dev, "pcie", lib.nvmlDeviceGetPcieThroughput, h, lib.NVML_PCIE_UTIL_RX_BYTES
            )
            tx = self._try(
                dev, "pcie", lib.nvmlDeviceGetPcieThroughput, h, lib.NVML_PCIE_UTIL_TX_BYTES
            )
            s["pcie_rx"] = None if rx is None else rx * 1024.0  # KB/s -> B/s
            s["pcie_tx"] = None if tx is None else tx * 1024.0

    # ------------------------------------------------------------------ public
    def sample(self) -> list[GpuSample]:
        """One reading of every device (blocking NVML calls: run it off the event loop).

        The common case -- a healthy device that answered everything last time -- costs
        three NVML calls and no error bookkeeping (64 GPUs at 10 Hz is 640 samples a
        second); a device that raised goes through :meth:`_sample_careful`, which records
        per field why it is None, until it answers everything again."""
        lib = self.lib
        slow = self._tick % self.slow_every == 0
        self._tick += 1
        self._drain_xid()
        get_util = lib.nvmlDeviceGetUtilizationRates
        get_mem = lib.nvmlDeviceGetMemoryInfo
        get_fields = lib.nvmlDeviceGetFieldValues
        nvml_error = lib.NVMLError
        fields = self._fields
        out: list[GpuSample] = []
        for dev in self.devices:
            if slow:
                self._read_slow(dev)
            if dev.healthy:
                h = dev.handle
                try:
                    util = get_util(h)
                    mem = get_mem(h)
                    fv = get_fields(h, fields)
                except nvml_error:
                    dev.healthy = False
                else:
                    sample = self._fast(dev, util, mem, fv)
                    if sample is not None:
                        out.append(sample)
                        continue
                    dev.healthy = False  # a field refused: read it the careful way
            out.append(self._sample_careful(dev))
        return out

    def _fast(self, dev: _Device, util: Any, mem: Any, values: Any) -> GpuSample | None:
        """A healthy device's sample from its three answers; None if a field was refused."""
        rx_fv, tx_fv, power_fv = values[0], values[1], values[2]
        if rx_fv.nvmlReturn or tx_fv.nvmlReturn or power_fv.nvmlReturn:
            return None
        now = rx_fv.timestamp / 1e6 if rx_fv.timestamp else self._clock()
        rx, tx = int(_fv_value(rx_fv)), int(_fv_value(tx_fv))
        last = dev.last_rx
        rx_rate = (
            (rx - last[1]) / (now - last[0]) if last and now > last[0] and rx >= last[1] else None
        )
        last = dev.last_tx
        tx_rate = (
            (tx - last[1]) / (now - last[0]) if last and now > last[0] and tx >= last[1] else None
        )
        dev.last_rx, dev.last_tx = (now, rx), (now, tx)
        used, total = int(mem.used), int(mem.total)
        s = dev.slow
        return GpuSample(
            index=dev.index,
            uuid=dev.uuid,
            name=dev.name,
            sm_util_pct=float(util.gpu),
            mem_util_pct=100.0 * used / total if total else None,
            mem_used_bytes=used,
            mem_total_bytes=total,
            mem_free_bytes=int(mem.free),
            mem_bw_util_pct=float(util.memory),
            pcie_rx_bytes_s=rx_rate,
            pcie_tx_bytes_s=tx_rate,
            sm_clock_mhz=s.get("sm_clock"),
            mem_clock_mhz=s.get("mem_clock"),
            temperature_c=s.get("temp"),
            power_w=_fv_value(power_fv) / 1000.0,
            xid_errors=dev.xid_count,
            ecc_errors=s.get("ecc"),
            last_xid=dev.last_xid,
        )

    def _sample_careful(self, dev: _Device) -> GpuSample:
        """One device, every call guarded: what NVML refuses is None (reason in errors)."""
        lib = self.lib
        h = dev.handle
        n_errors = len(self.errors)
        util = self._try(dev, "utilization", lib.nvmlDeviceGetUtilizationRates, h)
        mem = self._try(dev, "memory", lib.nvmlDeviceGetMemoryInfo, h)
        fv, now = self._field_values(dev)
        s = dev.slow
        rx_rate = tx_rate = None
        power_w = s.get("power_w")
        if dev.pcie_counters:
            rx = fv.get(lib.NVML_FI_DEV_PCIE_COUNT_RX_BYTES)
            tx = fv.get(lib.NVML_FI_DEV_PCIE_COUNT_TX_BYTES)
            if rx is not None:
                rx_rate = self._rate(dev.last_rx, now, int(rx))
                dev.last_rx = (now, int(rx))
            if tx is not None:
                tx_rate = self._rate(dev.last_tx, now, int(tx))
                dev.last_tx = (now, int(tx))
        else:
            rx_rate, tx_rate = s.get("pcie_rx"), s.get("pcie_tx")
        if dev.power_field:
            mw = fv.get(lib.NVML_FI_DEV_POWER_INSTANT)
            power_w = None if mw is None else mw / 1000.0
        used = total = free = None
        mem_pct = None
        if mem is not None:
            used, total, free = int(mem.used), int(mem.total), int(mem.free)
            mem_pct = 100.0 * used / total if total else None
        # healthy again (the fast path) once every call and field answered
        dev.healthy = (
            util is not None
            and mem is not None
            and dev.pcie_counters
            and dev.power_field
            and len(self.errors) <= n_errors
            and not any(k[0] == dev.index and k[1] in _FAST_CALLS for k in self.errors)
        )
        return GpuSample(
            index=dev.index,
            uuid=dev.uuid,
            name=dev.name,
            sm_util_pct=None if util is None else float(util.gpu),
            mem_util_pct=mem_pct,
            mem_used_bytes=used,
            mem_total_bytes=total,
            mem_free_bytes=free,
            mem_bw_util_pct=None if util is None else float(util.memory),
            pcie_rx_bytes_s=rx_rate,
            pcie_tx_bytes_s=tx_rate,
            sm_clock_mhz=s.get("sm_clock"),
            mem_clock_mhz=s.get("mem_clock"),
            temperature_c=s.get("temp"),
            power_w=power_w,
            xid_errors=dev.xid_count,
            ecc_errors=s.get("ecc"),
            last_xid=dev.last_xid,
        )

    def running_pids(self) -> dict[int, set[int]]:
        """GPU index -> pids of compute processes NVML sees on it (for pid-based mapping)."""
        lib = self.lib
        out: dict[int, set[int]] = {}
        for dev in self.devices:
            procs = self._try(
                dev, "processes", lib.nvmlDeviceGetComputeRunningProcesses, dev.handle
            )
            out[dev.index] = {int(p.pid) for p in procs or ()}
        return out

    def close(self) -> None:
        lib = self.lib
        if self._events is not None:
            try:
                lib.nvmlEventSetFree(self._events)
            except lib.NVMLError:
                pass
            self._events = None
        try:
            lib.nvmlShutdown()
        except lib.NVMLError:
            pass


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


_FAST_CALLS = ("utilization", "memory", "field_values")
# NVML_VALUE_TYPE_* (0 double, 1 unsigned int, 2 unsigned long, 3 unsigned long long,
# 4 signed long long, 5 signed int, 6 unsigned short) -> the member of nvmlValue_t holding it
_VALUE_MEMBER = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


def _fv_value(fv: Any) -> float:
    vt = fv.valueType
    return float(getattr(fv.value, _VALUE_MEMBER[vt] if 0 <= vt < 7 else "ullVal"))


def open_collector(lib: Any = None, slow_every: int = 10) -> tuple[GpuCollector | None, str]:
    """Initialise NVML; returns (collector, "") or (None, why there are no GPUs to read)."""
    if lib is None:
        try:
            lib = load_library()
        except ImportError as exc:
            return None, f"nvidia-ml-py is not installed ({exc}); engine metrics only"
    try:
        lib.nvmlInit()
    except lib.NVMLError as exc:
        return None, f"NVML unavailable ({exc or type(exc).__name__}); engine metrics only"
    except OSError as exc:
        return None, f"NVML unavailable ({exc}); engine metrics only"
    try:
        count = lib.nvmlDeviceGetCount()
        if count == 0:
            lib.nvmlShutdown()
            return None, "NVML found no GPU devices; engine metrics only"
        collector = GpuCollector(lib, slow_every=slow_every)
    except lib.NVMLError as exc:
        return None, f"NVML device enumeration failed ({exc}); engine metrics only"
    return collector, ""
