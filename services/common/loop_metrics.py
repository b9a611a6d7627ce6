"""Prometheus counters, gauges and histograms updated from one event-loop thread.

prometheus-client's metrics take a lock and go through a value object on every update (0.2 to
0.5 µs each); a router request makes a dozen of them. These keep each labelled child's numbers
as plain attributes (one thread updates them, so no lock) and hand them to prometheus-client
as metric families when the registry is collected (a scrape), so names, help, labels and the
exposition format are prometheus-client's own.

Invariant: every update happens on the thread that owns the metric (the service's event
loop); a scrape on the same loop reads a consistent view. Not for metrics updated from worker
threads: those stay prometheus-client's.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)


class CounterChild:
    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        self.value += amount


class GaugeChild:
    __slots__ = ("value", "source")

    def __init__(self) -> None:
        self.value = 0.0
        self.source: Callable[[], float] | None = None

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value

    def set_function(self, source: Callable[[], float]) -> None:
        """Read ``source()`` at each scrape instead of the last value set."""
        self.source = source

    def read(self) -> float:
        return self.source() if self.source is not None else self.value


class HistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; last: +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bucket ``le`` = bound holds values <= bound: the first bound >= value
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class _Metric:
    """A metric family and its children by label values (one child without labels)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        registry: CollectorRegistry | None = REGISTRY,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], object] = {}
        if not self.labelnames:
            self._only = self._new_child()
            self._children[()] = self._only
        if registry is not None:
            registry.register(self)

    def _new_child(self) -> object:  # pragma: no cover - each kind has its own
        raise NotImplementedError

    def labels(self, *values: str) -> object:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
        key = tuple(str(v) for v in values)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = self._new_child()
        return c

    def describe(self) -> list[Metric]:
        return [self._family()]

    def _family(self) -> Metric:  # pragma: no cover - each kind has its own
        raise NotImplementedError

    def collect(self) -> Iterator[Metric]:
        yield self._filled()

    def _filled(self) -> Metric:  # pragma: no cover - each kind has its own
        raise NotImplementedError


class LoopCounter(_Metric):
    def __init__(self, name: str, *args, **kwargs) -> None:
        # exposed as <name>_total (and <name>_created), as prometheus-client's Counter does
        super().__init__(name.removesuffix("_total"), *args, **kwargs)

    def _new_child(self) -> CounterChild:
        return CounterChild()

    def labels(self, *values: str) -> CounterChild:
        return super().labels(*values)  # type: ignore[return-value]

    def inc(self, amount: float = 1.0) -> None:
        self._only.inc(amount)  # type: ignore[attr-defined]

    @property
    def value(self) -> float:
        return self._only.value  # type: ignore[attr-defined]

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def _filled(self) -> CounterMetricFamily:
        f = self._family()
        for key, c in list(self._children.items()):
            f.add_metric(list(key), c.value, created=c.created)  # type: ignore[attr-defined]
        return f


class LoopGauge(_Metric):
    def _new_child(self) -> GaugeChild:
        return GaugeChild()

    def labels(self, *values: str) -> GaugeChild:
        return super().labels(*values)  # type: ignore[return-value]

    def inc(self, amount: float = 1.0) -> None:
        self._only.value += amount  # type: ignore[attr-defined]

    def dec(self, amount: float = 1.0) -> None:
        self._only.value -= amount  # type: ignore[attr-defined]

    def set(self, value: float) -> None:
        self._only.value = value  # type: ignore[attr-defined]

    def set_function(self, source: Callable[[], float]) -> None:
        """Read ``source()`` at each scrape (a gauge without labels)."""
        self._only.set_function(source)  # type: ignore[attr-defined]

    @property
    def value(self) -> float:
        return self._only.read()  # type: ignore[attr-defined]

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def _filled(self) -> GaugeMetricFamily:
        f = self._family()
        for key, c in list(self._children.items()):
            f.add_metric(list(key), c.read())  # type: ignore[attr-defined]
        return f


class LoopHistogram(_Metric):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        registry: CollectorRegistry | None = REGISTRY,
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> None:
        bounds = tuple(float(b) for b in buckets if b != float("inf"))
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"{name}: buckets must be increasing")
        self.bounds = bounds
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self.bounds)

    def labels(self, *values: str) -> HistogramChild:
        return super().labels(*values)  # type: ignore[return-value]

    def observe(self, value: float) -> None:
        self._only.observe(value)  # type: ignore[attr-defined]

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def _filled(self) -> HistogramMetricFamily:
        f = self._family()
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for key, c in list(self._children.items()):
            cum, buckets = 0, []
            for le, n in zip(les, c.counts, strict=True):  # type: ignore[attr-defined]
                cum += n
                buckets.append((le, cum))
            f.add_metric(list(key), buckets, c.sum)  # type: ignore[attr-defined]
        return f


__all__ = [
    "CounterChild",
    "GaugeChild",
    "HistogramChild",
    "LoopCounter",
    "LoopGauge",
    "LoopHistogram",
]
