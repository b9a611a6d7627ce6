"""Goodput's pieces, pure: SLO attainment of a run, the bisection over the arrival-rate
multiplier, a workload at a multiplier, and the ceiling :mod:`bench.latency_bound` proves.

Invariants:
- attainment counts *every* request of a run in its denominator; only requests that completed
  (status ``ok``) with TTFT and TPOT within the SLO count as met, so a refused, shed, errored or
  timed-out request is a miss (a policy cannot buy latency by rejecting);
- the bisection keeps a bracket ``lo`` (met) < ``hi`` (missed) that only narrows: ``lo`` never
  decreases, ``hi`` never increases, every point lies inside the bracket, and the goodput it
  returns is the highest multiplier it saw meet the target (``None`` when even ``min_rate``
  missed); with ``grow_to`` the upper end first doubles while met, so the bracket's ``lo``
  rises to the last doubling met and ``hi`` is set at the first missed, then only narrows. It assumes attainment falls as the rate grows; the evaluated points (the results'
  CSV and plot) show where a workload breaks that;
- the ceiling is a necessary condition for *any* policy: a multiplier above it cannot meet the
  target (see :func:`slo_ceiling` for what it assumes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.latency_bound import decode_alone_s, request_bounds
from bench.metrics import OK, RequestResult, tpot_s
from bench.workloads import BenchRequest, Workload, build_workload, workload_params
from services.core.engine import EngineConfig


def attainment(results: Sequence[RequestResult], ttft_s: float, tpot_max_s: float) -> float:
    """Share of all ``results`` that completed with TTFT <= ``ttft_s`` and TPOT <=
    ``tpot_max_s``; anything not completed (rejected, shed, timed out, error) is a miss."""
    if not results:
        return 0.0
    met = sum(
        1
        for r in results
        if r.status == OK
        and r.ttft_s is not None
        and r.ttft_s <= ttft_s
        and tpot_s(r) <= tpot_max_s
    )
    return met / len(results)


@dataclass
class Search:
    """One bisection: every multiplier it evaluated, in order, and what it concluded."""

    target: float
    min_rate: float
    max_rate: float
    points: list[tuple[float, float]] = field(default_factory=list)  # (multiplier, attainment)
    goodput: float | None = None  # highest multiplier seen meeting the target
    lo: float | None = None  # bracket: met here ...
    hi: float | None = None  # ... missed here (None: max_rate met)

    @property
    def outcome(self) -> str:
        """``at-max`` (met at max_rate: goodput >= it), ``below-min`` (missed at min_rate) or
        ``bracketed`` (goodput in [lo, hi))."""
        if self.goodput is None:
            return "below-min"
        return "at-max" if self.hi is None else "bracketed"


def bisect_rate(
    evaluate: Callable[[float], float],
    target: float,
    min_rate: float,
    max_rate: float,
    steps: int,
    on_point: Callable[[Search, float, float], None] | None = None,
    grow_to: float | None = None,
) -> Search:
    """The highest multiplier in [``min_rate``, ``max_rate``] whose attainment
    (``evaluate(m)``) is >= ``target``: ``max_rate`` first (met: done), then ``min_rate``
    (missed: none), then ``steps`` geometric halvings of the bracket (the resolution is
    (max_rate / min_rate) ** (1 / 2 ** steps)). ``on_point`` sees each point.

    ``grow_to`` (> ``max_rate``): when ``max_rate`` is met, the upper end doubles (capped at
    ``grow_to``) until a multiplier misses, and the ``steps`` halvings narrow that last
    doubling (resolution 2 ** (1 / 2 ** steps)); met at ``grow_to`` too: goodput >= it.
    ``Search.max_rate`` is then the highest multiplier evaluated."""
    if not 0 < min_rate < max_rate:
        raise ValueError("need 0 < min_rate < max_rate")
    if steps < 0:
        raise ValueError("steps must be >= 0")
    if grow_to is not None and grow_to <= max_rate:
        raise ValueError("grow_to must be above max_rate")
    s = Search(target, min_rate, max_rate)

    def probe(m: float) -> bool:
        a = evaluate(m)
        s.points.append((m, a))
        if on_point is not None:
            on_point(s, m, a)
        return a >= target

    if probe(max_rate):
        s.goodput = s.lo = max_rate
        while grow_to is not None and s.lo < grow_to and s.hi is None:
            m = s.max_rate = min(2.0 * s.lo, grow_to)
            if probe(m):
                s.goodput = s.lo = m
            else:
                s.hi = m
        if s.hi is None:
            return s
    else:
        s.hi = max_rate
        if not probe(min_rate):
            return s
        s.lo = min_rate
    for _ in range(steps):
        mid = math.sqrt(s.lo * s.hi)  # geometric: the same relative resolution at any rate
        if probe(mid):
            s.lo = mid
        else:
            s.hi = mid
    s.goodput = s.lo
    return s


# ------------------------------------------------------------------ the workload at a rate
def rate_knob(name: str, params: dict[str, Any]) -> tuple[str, float]:
    """Which parameter scales ``name``'s arrival rate, and its base value: ``rate`` (Poisson
    arrivals, x multiplier) or ``time_scale`` (trace replay, / multiplier)."""
    defaults = workload_params(name)
    if "rate" in defaults:
        base = float(params.get("rate", defaults["rate"]))
        if base <= 0 or math.isinf(base):
            raise ValueError(
                f"workload {name!r} sends everything at once (rate={base:g}): a goodput search "
                "needs arrivals at a rate; give --rate R or -p rate=R"
            )
        return "rate", base
    if "time_scale" in defaults:
        base = float(params.get("time_scale", defaults["time_scale"]))
        if base <= 0:
            raise ValueError("time_scale must be > 0")
        return "time_scale", base
    raise ValueError(f"workload {name!r} has no arrival rate to scale (no rate or time_scale)")


# a Poisson workload's count of conversations (always scaled with the rate), or of requests
# or groups of them (scaled with ``scale_count``)
COUNTS = ("sessions", "num_requests", "groups")


def workload_at(
    name: str, params: dict[str, Any], multiplier: float, scale_count: bool = False
) -> Workload:
    """``name`` built with its arrival rate x ``multiplier`` (same seed).

    A workload of conversations (a ``sessions`` parameter) gets ``multiplier`` x the sessions
    at ``multiplier`` x the session rate: the same window of session starts, ``multiplier``
    x the conversations in it. Scaling the session rate alone would only start the same
    conversations sooner; each waits for its own previous turn, so the load would stop
    growing once every conversation is under way.

    ``scale_count``: the same for a workload of a fixed count of requests (``num_requests``,
    or ``groups`` of them): ``multiplier`` x the count at ``multiplier`` x the rate, the same
    arrival window with ``multiplier`` x the requests. A burst (a window shorter than a
    request's life: every request in flight at once) needs it: at a fixed count a higher rate
    only shrinks the window, and once the whole burst is in flight it adds no load."""
    knob, base = rate_knob(name, params)
    value = base * multiplier if knob == "rate" else base / multiplier
    scaled: dict[str, Any] = {**params, knob: value}
    defaults = workload_params(name)
    if (knob == "rate" and "sessions" in defaults) or scale_count:
        key = count_key(name)
        scaled[key] = max(1, round(int(params.get(key, defaults[key])) * multiplier))
    return build_workload(name, scaled)


def count_key(name: str) -> str:
    """The parameter ``scale_count`` scales for ``name`` (:data:`COUNTS`); ValueError when it
    has none, or no Poisson rate to scale it with."""
    defaults = workload_params(name)
    key = next((k for k in COUNTS if k in defaults), None)
    if "rate" not in defaults or key is None:
        raise ValueError(
            f"workload {name!r} has no request count to scale with its rate "
            f"({' or '.join(COUNTS)} and rate)"
        )
    return key


def offered_rate(requests: Sequence[BenchRequest]) -> float:
    """Requests per second of scheduled arrivals: count / (last - first arrival)."""
    if len(requests) < 2:
        return 0.0
    span = requests[-1].arrival_s - requests[0].arrival_s
    return len(requests) / span if span > 0 else math.inf


# ------------------------------------------------------------------ the latency bound's ceiling
@dataclass(frozen=True, slots=True)
class Ceiling:
    """What :mod:`bench.latency_bound` proves about goodput at an SLO on one workload.

    ``possible_share``: at ``max_rate``, the requests whose own bounds (prefill alone on an
    idle engine, decode alone) meet the SLO, over all; no policy attains more there.
    ``multiplier``: the highest multiplier in [``min_rate``, ``max_rate``] at which the fleet
    can still compute the prefill of the cheapest ``target`` share of those requests between
    the first arrival and the last arrival + the TTFT SLO; above it no policy meets the target
    (0: not even at ``min_rate``; ``max_rate``: the bound does not bind in the range)."""

    possible_share: float
    multiplier: float
    prefill_work_s: float  # at ``multiplier``: engine-seconds of the cheapest target share
    binds: bool  # False: ``multiplier`` is ``max_rate`` and the bound allows it


def _fits(
    reqs: Sequence[BenchRequest],
    keys: Sequence[Sequence[int]],
    cfg: EngineConfig,
    workers: int,
    target: float,
    ttft_s: float,
    tpot_max_s: float,
) -> tuple[bool, float, float]:
    """(the bound allows the target here, the possible share, the target share's work)."""
    per = request_bounds(reqs, keys, cfg)
    works = []
    for r, (ttft, _e2e, work) in zip(reqs, per, strict=True):
        tpot = decode_alone_s(cfg, r.prompt_tokens, r.max_tokens) / max(1, r.max_tokens - 1)
        if ttft <= ttft_s and tpot <= tpot_max_s:
            works.append(work)
    n = len(reqs)
    need = math.ceil(target * n - 1e-9)
    if len(works) < need:
        return False, len(works) / n, math.inf
    work = sum(sorted(works)[:need])
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    return work / workers <= span + ttft_s, len(works) / n, work


def slo_ceiling(
    name: str,
    params: dict[str, Any],
    keys_of: Callable[[Sequence[BenchRequest]], Sequence[Sequence[int]]],
    cfg: EngineConfig,
    workers: int,
    target: float,
    ttft_s: float,
    tpot_max_s: float,
    min_rate: float,
    max_rate: float,
    steps: int = 12,
    scale_count: bool = False,
) -> Ceiling:
    """The ceiling (see :class:`Ceiling`), by geometric bisection over the multiplier like the
    policies' search (the work grows and the arrival span shrinks with the rate). Assumes
    requests are sent at their scheduled arrivals (open loop); a multi-turn turn sent later
    than scheduled (its previous turn still running) stretches the run, so there it is the
    bound at the schedule."""

    def at(m: float) -> tuple[bool, float, float]:
        reqs = workload_at(name, params, m, scale_count).requests
        if not reqs:
            raise ValueError("the workload has no requests")
        return _fits(reqs, keys_of(reqs), cfg, workers, target, ttft_s, tpot_max_s)

    ok, share, work = at(max_rate)
    if ok:
        return Ceiling(share, max_rate, work, False)
    ok, _, work_lo = at(min_rate)
    if not ok:
        return Ceiling(share, 0.0, work_lo, True)
    lo, hi = min_rate, max_rate
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        ok, _, w = at(mid)
        if ok:
            lo, work_lo = mid, w
        else:
            hi = mid
    return Ceiling(share, lo, work_lo, True)
