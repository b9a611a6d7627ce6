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
- an outlier is ejected, then returns with no samples (it must be slow again on fresh
  requests to be ejected again). The *n*-th ejection of one incident lasts ``n × eject_s``,
  at most ``max_eject_s`` (Envoy's outlier ejection: base time × ejection count, capped);
- an incident runs from a worker's first ejection until it has been back in rotation a
  whole ``window_s`` without being ejected again (judged on a full window of fresh samples):
  then its ejection count restarts from zero (an :class:`Ejection` with ``recovered``).

Cost: a worker keeps at most its last ``MAX_SAMPLES`` samples of the window (the median of
the last thousand is as good a judge as of all, and a busy router finishes thousands of
requests a second); medians are computed only when a fleet can be judged (three or more
workers with a latency).

Invariants: never more than a third of the workers with a latency are ejected at once (a
fleet-wide slowdown ejects nobody: each worker is compared with the others); a worker is
ejected or not, and each change is returned exactly once as an :class:`Ejection`; so is the
end of each incident, after the worker's last return.
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
    eject_s: float = 30.0  # the first ejection's length; the n-th of an incident n x this
    min_requests: int = 5  # samples a worker needs in the window to be judged
    max_eject_s: float = 300.0  # cap on one ejection's length

    def __post_init__(self) -> None:
        if self.ratio <= 1.0:
            raise ValueError("outlier ratio must be > 1")
        if self.window_s <= 0 or self.eject_s <= 0 or self.min_requests < 1:
            raise ValueError("outlier window_s, eject_s > 0 and min_requests >= 1 required")
        if self.max_eject_s < self.eject_s:
            raise ValueError("--outlier-max-eject-s must be >= --outlier-eject-s")


@dataclass(frozen=True)
class Ejection:
    """A change: ``ejected`` True (with the numbers that decided it) or False (it returned);
    ``recovered``: the incident is over (back a whole window without a new ejection)."""

    worker_id: str
    ejected: bool
    latency: float = 0.0  # the worker's median seconds per token
    fleet: float = 0.0  # the others' median
    until: float = 0.0
    count: int = 0  # this ejection is the incident's count-th
    recovered: bool = False


MAX_SAMPLES = 1024  # per worker: the most recent samples of the window


@dataclass
class OutlierDetector:
    config: OutlierConfig = field(default_factory=OutlierConfig)
    _samples: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)
    _ejected_until: dict[str, float] = field(default_factory=dict)
    _ejections: dict[str, int] = field(default_factory=dict)  # per incident
    _back_at: dict[str, float] = field(default_factory=dict)  # returned, incident still on

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
        changes: list[Ejection] = []
        for wid, back in list(self._back_at.items()):
            if now - back >= self.config.window_s:  # back a whole window: the incident ends
                del self._back_at[wid]
                if self._ejections.pop(wid, None) is not None:
                    changes.append(Ejection(wid, False, recovered=True))
        for wid, until in list(self._ejected_until.items()):
            if now >= until:
                del self._ejected_until[wid]
                self._back_at[wid] = now
                changes.append(Ejection(wid, False, count=self._ejections.get(wid, 0)))
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
                count = self._ejections.get(wid, 0) + 1
                until = now + min(self.config.eject_s * count, self.config.max_eject_s)
                self._ejections[wid] = count
                self._back_at.pop(wid, None)
                self._ejected_until[wid] = until
                self._samples.pop(wid, None)
                changes.append(Ejection(wid, True, value, fleet, until, count))
                budget -= 1
        return changes

    def forget(self, worker_id: str) -> None:
        self._samples.pop(worker_id, None)
        self._ejected_until.pop(worker_id, None)
        self._ejections.pop(worker_id, None)
        self._back_at.pop(worker_id, None)


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
        "how long a latency outlier stays out of rotation the first time in an incident; "
        "the n-th ejection of the same incident lasts n times this (seconds; the incident "
        "ends after the worker was back a whole --outlier-window-s without a new ejection)",
        env="KVGATE_ROUTER_OUTLIER_EJECT_S",
    ),
    S.option(
        "outlier_max_eject_s",
        300.0,
        "the longest one latency-outlier ejection lasts (seconds)",
        env="KVGATE_ROUTER_OUTLIER_MAX_EJECT_S",
    ),
    S.option(
        "outlier_min_requests",
        5,
        "finished requests a worker needs in the window before its latency is judged",
        env="KVGATE_ROUTER_OUTLIER_MIN_REQUESTS",
    ),
)
