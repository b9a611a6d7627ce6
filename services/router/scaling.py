"""The router's scaling signal: ``kvgate_fleet_engines_needed``, the engines the fleet needs to
meet its SLOs at the arrival rate this router sees (:mod:`services.core.scaling`), computed when
Prometheus scrapes it. Each router sees its share of the arrivals: the fleet's figure is the
sum over routers (``sum(kvgate_fleet_engines_needed)``; docs/deploy.md has KEDA and HPA
examples).

Inputs: arrivals (every parsed request), the engine each request was sent to, the answered
requests' prompt, uncached (prompt - the engine's reported cached tokens, else the router's
prediction) and output tokens, the requests waiting in this router's queue, the routable
workers, and the SLO targets and step coefficients of the control arm's policy: its own
``slo_ttft_ms`` / ``slo_tpot_ms`` (else 2 s / 50 ms, as :mod:`services.router.slo`) and, for
a policy with calibrated latency models (``slo_aware``), their mean over the routable
workers, else the engine model's defaults.

Invariant: the hooks cost O(1) per request (:class:`~services.core.scaling.DemandWindow`).
"""

from __future__ import annotations

import time
from typing import Any

from services.core.latency import StepCoefficients
from services.core.scaling import DemandWindow, Need, engines_needed
from services.router import metrics as M
from services.router.slo import DEFAULT_TPOT_MS, DEFAULT_TTFT_MS


class ScalingSignal:
    def __init__(self, policies: Any, state: Any, capacity: Any, window_s: float, margin: float):
        if not window_s > 0:
            raise ValueError("--scaling-window must be > 0")
        if not 0 < margin <= 1:
            raise ValueError("--scaling-margin must be in (0, 1]")
        self.policies = policies
        self.state = state
        self.capacity = capacity
        self.margin = margin
        self.window = DemandWindow(window_s)
        self.prior = StepCoefficients.from_engine()
        M.ENGINES_NEEDED.set_function(lambda: self.need().engines)
        M.ARRIVAL_RATE.set_function(lambda: self.window.demand(time.monotonic()).rate)

    def arrived(self) -> None:
        self.window.arrived(time.monotonic())

    def sent(self, worker_id: str) -> None:
        self.window.sent(time.monotonic(), worker_id)

    def answered(self, prompt: int, cached: int, output: int) -> None:
        self.window.answered(time.monotonic(), prompt, max(0, prompt - cached), output)

    def coefficients(self, policy: Any) -> list[float]:
        """The step coefficients: the mean of the policy's calibrated models over the routable
        workers, else the engine model's defaults."""
        models = policy.state.extra.get("slo_models") or {}
        states = self.state.states
        thetas = [m.theta for w, m in models.items() if w in states and states[w].routable]
        if not thetas:
            return self.prior.as_list()
        return [sum(col) / len(thetas) for col in zip(*thetas, strict=True)]

    def need(self) -> Need:
        policy = self.policies.control
        params = policy.params
        ttft = params.get("slo_ttft_ms", DEFAULT_TTFT_MS) / 1000.0
        tpot = params.get("slo_tpot_ms", DEFAULT_TPOT_MS) / 1000.0
        engines = self.state.routable_count()
        self.window.keep(self.state.states)
        demand = self.window.demand(time.monotonic(), self.capacity.waiting, engines)
        return engines_needed(demand, self.coefficients(policy), ttft, tpot, self.margin)
