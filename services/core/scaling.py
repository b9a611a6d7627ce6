"""The scaling signal: how many engines the fleet needs to meet its latency SLOs at the current
arrival rate, from the latency model's step coefficients (:mod:`services.core.latency`) and the
router's queue. Pure; the live router (``kvgate_fleet_engines_needed``) and the simulator's
ramp (``python -m bench.scaling_ramp``) run the same code.

Model. One engine step costs ``overhead + the work in it`` (the latency model's terms). A mean
request brings ``work = prefill + output x decode`` engine-seconds of step work beyond the
steps' overhead: its prompt's uncached tokens (``prefill = prefill_token x u + prefill_attn x u
x (prompt - u/2)``) and one decode slot per output token (``decode = decode_seq +
decode_kv_token x context``, its context half-way through its output). At ``x`` requests/s per
engine the work fills a share ``rho = x x work`` of every step's time, so steps stretch to
``overhead / (1 - rho)`` (continuous batching shares each step among everything running: a
processor-sharing engine), and

    TPOT ~ overhead / (1 - rho)            TTFT ~ (overhead + prefill) / (1 - rho)

Both meet their targets while ``rho <= rho_max = min(1 - (overhead + prefill) / ttft_slo,
1 - overhead / tpot_slo)``, each target scaled by ``margin`` (the mean request then meets it
with room for the ones above the mean). The fleet needs

    engines = (rate + queued / ttft_slo) x work / rho_max

where ``queued`` (requests waiting in the router for capacity) counts as arrivals due within
one TTFT target. When even an idle engine misses a target (a mean prompt's prefill alone takes
longer than the TTFT target: more engines cannot fix that), ``rho_max`` is held at
``MIN_UTILIZATION`` and :attr:`Need.reachable` is False.

:class:`DemandWindow` keeps what the formula reads: the arrival rate, the answered requests'
mean prompt, uncached and output tokens and each engine's share of the requests sent, each an
exponentially weighted average over the last ``window_s`` seconds (of whatever clock the caller
passes: monotonic live, virtual in the simulator). The rate is double-smoothed (Brown's
``2 S1 - S2``): a plain average lags a steadily rising rate by ``slope x window_s``, which is
the very moment an autoscaler needs to see it.

Imbalance: the busiest engine must meet the targets, not the mean one, so the engines are
multiplied by ``max share x engines`` of the requests sent (1 when even).
"""

from __future__ import annotations

import math
from collections.abc import Container, Sequence
from dataclasses import dataclass

from services.core.latency import StepCoefficients

MIN_UTILIZATION = 0.1  # rho_max when the targets cannot be met even by an idle engine


@dataclass(frozen=True, slots=True)
class Demand:
    """The fleet's load, per second and per mean request."""

    rate: float  # requests arriving per second
    queued: int = 0  # requests waiting in the router for capacity now
    prompt: float = 0.0  # mean prompt tokens
    uncached: float = 0.0  # mean prompt tokens the engine computes (not cached there)
    output: float = 0.0  # mean output tokens
    # the busiest engine's share of the requests x the engines sharing them (1: even; a
    # cache-aware policy keeps prefixes where they are cached, so some engines take more)
    imbalance: float = 1.0


@dataclass(frozen=True, slots=True)
class Need:
    engines: float  # engines needed (fractional: an autoscaler rounds up)
    rho_max: float  # the share of step time the work may fill and still meet the targets
    work_s: float  # engine-seconds of step work per mean request
    reachable: bool  # False: an idle engine misses a target already


def engines_needed(
    demand: Demand,
    coefficients: StepCoefficients | Sequence[float],
    ttft_slo_s: float,
    tpot_slo_s: float,
    margin: float = 1.0,
) -> Need:
    """Engines the fleet needs for ``demand`` to meet the targets (module docstring)."""
    th = coefficients.as_list() if isinstance(coefficients, StepCoefficients) else coefficients
    ov, pt, pa, ds, dk = th
    u = max(0.0, demand.uncached)
    prefill = pt * u + pa * u * (demand.prompt - u / 2.0)
    decode = ds + dk * (demand.prompt + demand.output / 2.0)
    work = prefill + demand.output * decode
    ttft, tpot = ttft_slo_s * margin, tpot_slo_s * margin
    rho_max = min(1.0 - (ov + prefill) / ttft, 1.0 - ov / tpot)
    reachable = rho_max > MIN_UTILIZATION
    if not reachable:
        rho_max = MIN_UTILIZATION
    rate = demand.rate + demand.queued / ttft_slo_s
    return Need(rate * work * max(1.0, demand.imbalance) / rho_max, rho_max, work, reachable)


class DemandWindow:
    """Arrivals, engines' shares and answered requests' tokens, exponentially weighted over
    ``window_s``. O(1) per event: each event adds its weight ``exp((t - t_ref) / window_s)``
    (growing with time instead of decaying every sum), and reading scales the sums back to
    ``now``; ``t_ref`` moves forward (rescaling the sums) before the weights grow large."""

    RESCALE = 40.0  # window lengths between rescalings (exp(40) ~ 2e17: far from overflow)

    def __init__(self, window_s: float = 30.0) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self.window_s = window_s
        self._inv_w = 1.0 / window_s
        self._rescale_after = self.RESCALE * window_s
        self._start: float | None = None
        self._ref = 0.0  # t_ref
        self._last = 0.0  # the last event's time (for S2)
        self._arrivals = 0.0  # S1 x window (the arrivals' EWMA), scaled by exp(t_ref)
        self._smoothed = 0.0  # S2 x window: S1 smoothed once more (Brown's double smoothing)
        self._n = 0.0  # answered requests, and their token sums
        self._prompt = 0.0
        self._uncached = 0.0
        self._output = 0.0
        self._sent: dict[str, float] = {}  # requests sent per engine

    def _weight(self, now: float) -> float:
        """The weight of an event at ``now`` (and S2's catch-up to it)."""
        if self._start is None:
            self._start = self._ref = self._last = now
        dt = now - self._last
        if dt > 0:
            # S2 follows S1: dS2/dt = (S1 - S2) / window; scaled, S1 stays put between events
            # and S2 gains S1 x dt / window
            self._smoothed += self._arrivals * dt * self._inv_w
            self._last = now
            if now - self._ref > self._rescale_after:
                self._rescale(now)
        return math.exp((now - self._ref) * self._inv_w)

    def _rescale(self, now: float) -> None:
        k = math.exp(-(now - self._ref) / self.window_s)
        self._arrivals *= k
        self._smoothed *= k
        self._n *= k
        self._prompt *= k
        self._uncached *= k
        self._output *= k
        for w in self._sent:
            self._sent[w] *= k
        self._ref = now

    def arrived(self, now: float) -> None:
        """A request arrived at ``now``."""
        self._arrivals += self._weight(now)

    def sent(self, now: float, engine: str) -> None:
        """A request was sent to ``engine`` (its share of the load: :attr:`Demand.imbalance`)."""
        self._sent[engine] = self._sent.get(engine, 0.0) + self._weight(now)

    def keep(self, engines: Container[str]) -> None:
        """Forget the engines not in ``engines`` (they left the fleet)."""
        for w in [w for w in self._sent if w not in engines]:
            del self._sent[w]

    def answered(self, now: float, prompt: int, uncached: int, output: int) -> None:
        """A request was answered: its prompt, the part the engine computed, its output."""
        g = self._weight(now)
        self._n += g
        self._prompt += g * prompt
        self._uncached += g * uncached
        self._output += g * output

    def demand(self, now: float, queued: int = 0, engines: int = 0) -> Demand:
        """The load at ``now`` on a fleet of ``engines``: the arrival rate (corrected for a
        window not yet full since the first event), the mean request and the busiest engine's
        share of what was sent, times ``engines`` (0: the engines sent to)."""
        if self._start is None:
            return Demand(0.0, queued)
        self._weight(now)  # S2 caught up to now
        sent = self._sent
        total = sum(sent.values())
        n = engines or len(sent)
        imbalance = max(sent.values()) * n / total if total > 0 and n else 1.0
        # each average corrected for a window not yet full since the first event (a steady
        # rate then reads as itself from the start), then 2 S1 - S2: an EWMA lags a rate that
        # rises steadily by slope x window, and S2 lags S1 by as much again
        w = self.window_s
        x = (now - self._start) / w
        e = math.exp(-x)
        fill1, fill2 = 1.0 - e, 1.0 - e * (1.0 + x)
        back = math.exp(-(now - self._ref) / w)
        s1 = self._arrivals * back / (w * fill1) if fill1 > 1e-9 else 0.0
        s2 = self._smoothed * back / (w * fill2) if fill2 > 1e-9 else s1
        rate = max(0.0, 2.0 * s1 - s2)
        a = self._n
        if a <= 0:
            return Demand(rate, queued, imbalance=imbalance)
        p, u, o = self._prompt / a, self._uncached / a, self._output / a
        return Demand(rate, queued, p, u, o, imbalance)
