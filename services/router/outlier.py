"""Latency outlier ejection: a worker much slower than the rest of the fleet is taken out of
rotation for a while (the idea of Envoy's outlier detection, on latency instead of errors).

A pure state machine; time is passed in. Each finished request gives its worker a sample:
seconds per output token (the request's end-to-end time over its completion tokens, so long
and short answers compare). Every :meth:`OutlierDetector.evaluate`:

- a worker with at least ``min_requests`` samples in the last ``window_s`` seconds has a
  *latency*: the median of those samples;
- it is an outlier when its latency is at least ``ratio`` times the median latency of the
  *other* workers that have one (at least two others are needed: with fewer there is no
  fleet to compare with);
- an outlier is ejected for ``eject_s`` seconds, then returns with no samples (it must be
  slow again on fresh requests to be ejected again).

Cost: a worker keeps at most its last ``MAX_SAMPLES`` samples of the window (the median of
the last thousand is as good a judge as of all, and a busy router finishes thousands of
requests a second); medians are computed only when a fleet can be judged (three or more
workers with a latency).

Invariants: never more than a third of the workers with a latency are ejected at once (a
fleet-wide slowdown ejects nobody: each worker is compared with the others); a worker is
ejected or not, and each change is returned exactly once as an :class:`Ejection`.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from services.common import settings as S


@dataclass(frozen=True)
class OutlierConfig:
    ratio: float = 3.0  # latency >= ratio x the others' median -> outlier
    window_s: float = 30.0  # samples older than this are forgotten
    eject_s: float = 30.0  # how long an outlier stays out of rotation
    min_requests: int = 5  # samples a worker needs in the window to be judged

    def __post_init__(self) -> None:
        if self.ratio <= 1.0:
            raise ValueError("outlier ratio must be > 1")
        if self.window_s <= 0 or self.eject_s <= 0 or self.min_requests < 1:
            raise ValueError("outlier window_s, eject_s > 0 and min_requests >= 1 required")


@dataclass(frozen=True)
class Ejection:
    """A change: ``ejected`` True (with the numbers that decided it) or False (it returned)."""

    worker_id: str
    ejected: bool
    latency: float = 0.0  # the worker's median seconds per token
    fleet: float = 0.0  # the others' median
    until: float = 0.0


MAX_SAMPLES = 1024  # per worker: the most recent samples of the window


@dataclass
class OutlierDetector:
    config: OutlierConfig = field(default_factory=OutlierConfig)
    _samples: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)
    _ejected_until: dict[str, float] = field(default_factory=dict)

    def record(self, worker_id: str, now: float, seconds: float, tokens: int) -> None:
        """One successful request on ``worker_id`` took ``seconds`` for ``tokens`` tokens."""
        if worker_id in self._ejected_until or seconds <= 0:
            return
        q = self._samples.get(worker_id)
        if q is None:
            q = self._samples[worker_id] = deque(maxlen=MAX_SAMPLES)
        q.append((now, seconds / max(1, tokens)))
        self._trim(q, now)

    def _trim(self, q: deque[tuple[float, float]], now: float) -> None:
        horizon = now - self.config.window_s
        while q and q[0][0] < horizon:
            q.popleft()

    def is_ejected(self, worker_id: str) -> bool:
        return worker_id in self._ejected_until

    def latencies(self, now: float) -> dict[str, float]:
        """Each judged worker's median seconds per token over the window."""
        out = {}
        for wid, q in self._samples.items():
            self._trim(q, now)
            if len(q) >= self.config.min_requests:
                out[wid] = statistics.median(v for _, v in q)
        return out

    def evaluate(self, now: float) -> list[Ejection]:
        changes = [
            Ejection(wid, False)
            for wid, until in list(self._ejected_until.items())
            if now >= until and self._ejected_until.pop(wid, None) is not None
        ]
        if sum(len(q) >= self.config.min_requests for q in self._samples.values()) < 3:
            return changes  # no fleet to compare with (each one needs two others)
        lat = self.latencies(now)
        budget = len(lat) // 3 - len(self._ejected_until)
        # slowest first, so the budget goes to the worst
        for wid, value in sorted(lat.items(), key=lambda kv: -kv[1]):
            if budget <= 0:
                break
            others = [v for w, v in lat.items() if w != wid]
            if len(others) < 2:
                break
            fleet = statistics.median(others)
            if fleet > 0 and value >= self.config.ratio * fleet:
                until = now + self.config.eject_s
                self._ejected_until[wid] = until
                self._samples.pop(wid, None)
                changes.append(Ejection(wid, True, value, fleet, until))
                budget -= 1
        return changes

    def forget(self, worker_id: str) -> None:
        self._samples.pop(worker_id, None)
        self._ejected_until.pop(worker_id, None)


OPTIONS = (
    S.option(
        "outlier_ratio",
        3.0,
        "a worker whose median seconds per output token is this many times the other workers' "
        "median is ejected (0: no latency outlier ejection)",
        env="KVGATE_ROUTER_OUTLIER_RATIO",
    ),
    S.option(
        "outlier_window_s",
        30.0,
        "latency samples older than this are forgotten (seconds)",
        env="KVGATE_ROUTER_OUTLIER_WINDOW_S",
    ),
    S.option(
        "outlier_eject_s",
        30.0,
        "how long an ejected latency outlier stays out of rotation (seconds)",
        env="KVGATE_ROUTER_OUTLIER_EJECT_S",
    ),
    S.option(
        "outlier_min_requests",
        5,
        "finished requests a worker needs in the window before its latency is judged",
        env="KVGATE_ROUTER_OUTLIER_MIN_REQUESTS",
    ),
)
