"""The scaling signal (services/core/scaling.py, services/router/scaling.py,
bench/scaling_ramp.py): the engines-needed formula, the demand window's rate on steady and
rising arrivals, the model against the simulated engines, the ramp (the signal exceeds the
fleet before attainment falls). The KEDA / HPA examples: tests/test_deploy_k8s.py."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from bench.metrics import OK, percentile, tpot_s
from bench.simcore import SimOptions, make_engine_config, simulate
from bench.workloads import build_workload
from services.core.latency import StepCoefficients
from services.core.scaling import MIN_UTILIZATION, Demand, DemandWindow, engines_needed

COEF = StepCoefficients(0.0065, 4.0e-5, 2.5e-9, 3.0e-5, 5.5e-8)


def test_engines_needed_by_hand() -> None:
    d = Demand(rate=20.0, prompt=2000, uncached=500, output=100)
    prefill = 4.0e-5 * 500 + 2.5e-9 * 500 * (2000 - 250)
    decode = 3.0e-5 + 5.5e-8 * (2000 + 50)
    work = prefill + 100 * decode
    # TPOT binds: 1 - 0.0065 / 0.05 = 0.87 < 1 - (0.0065 + prefill) / 2
    need = engines_needed(d, COEF, 2.0, 0.05)
    assert need.rho_max == pytest.approx(0.87)
    assert need.work_s == pytest.approx(work)
    assert need.engines == pytest.approx(20.0 * work / 0.87)
    assert need.reachable
    # the margin tightens both targets; the queue counts as arrivals due within one TTFT
    tight = engines_needed(d, COEF, 2.0, 0.05, margin=0.5)
    assert tight.rho_max == pytest.approx(1 - 0.0065 / 0.025)
    queued = engines_needed(Demand(20.0, 10, 2000, 500, 100), COEF, 2.0, 0.05)
    assert queued.engines == pytest.approx((20.0 + 10 / 2.0) * work / 0.87)
    # the busiest engine must meet the targets
    skew = engines_needed(Demand(20.0, 0, 2000, 500, 100, imbalance=1.5), COEF, 2.0, 0.05)
    assert skew.engines == pytest.approx(1.5 * need.engines)
    # monotone in the rate, zero without load
    assert engines_needed(Demand(40.0, 0, 2000, 500, 100), COEF, 2.0, 0.05).engines > need.engines
    assert engines_needed(Demand(0.0), COEF, 2.0, 0.05).engines == 0.0


def test_a_target_no_engine_can_meet_is_flagged() -> None:
    # a mean prompt whose prefill alone takes longer than the TTFT target
    need = engines_needed(Demand(5.0, 0, 60_000, 60_000, 10), COEF, 1.0, 0.05)
    assert not need.reachable and need.rho_max == MIN_UTILIZATION
    assert need.engines == pytest.approx(5.0 * need.work_s / MIN_UTILIZATION)


def _poisson(rng: random.Random, rate_at, until: float) -> list[float]:
    top = max(rate_at(0.0), rate_at(until))
    t, out = 0.0, []
    while True:
        t += rng.expovariate(top)
        if t >= until:
            return out
        if rng.random() * top <= rate_at(t):
            out.append(t)


def test_the_window_reads_a_steady_rate_from_the_start() -> None:
    rng = random.Random(1)
    w = DemandWindow(10.0)
    arrivals = _poisson(rng, lambda t: 50.0, 200.0)
    checks = {5.0: None, 30.0: None, 199.0: None}
    i = 0
    for t in sorted(checks):
        while i < len(arrivals) and arrivals[i] <= t:
            w.arrived(arrivals[i])
            w.answered(arrivals[i], 1000, 200, 50)
            w.sent(arrivals[i], f"e{i % 4}")
            i += 1
        checks[t] = w.demand(t, queued=3, engines=4)
    for t, d in checks.items():
        assert d.rate == pytest.approx(50.0, rel=0.25 if t < 10 else 0.12), t
        assert (d.prompt, d.uncached, d.output, d.queued) == pytest.approx((1000, 200, 50, 3))
        assert d.imbalance == pytest.approx(1.0, abs=0.1)
    # past many windows the weights were rescaled: still the same figures
    assert checks[199.0].rate == pytest.approx(50.0, rel=0.12)


def test_the_window_follows_a_rising_rate_without_the_average_s_lag() -> None:
    """On a rate rising 1 request/s every second, a plain 10-s average lags by 10 requests/s;
    the double-smoothed rate follows it."""
    rng = random.Random(2)
    w = DemandWindow(10.0)
    plain, t_last = 0.0, 0.0
    for t in _poisson(rng, lambda t: 10.0 + t, 90.0):
        w.arrived(t)
        plain = plain * math.exp(-(t - t_last) / 10.0) + 1.0
        t_last = t
    truth = 10.0 + 90.0
    assert w.demand(90.0).rate == pytest.approx(truth, rel=0.1)
    assert plain / 10.0 == pytest.approx(truth - 10.0, rel=0.1)  # the average's lag


def test_imbalance_is_the_busiest_engines_share_times_the_engines() -> None:
    w = DemandWindow(30.0)
    for i in range(100):
        w.sent(i * 0.01, "hot" if i % 2 else f"cold{i % 3}")
    d = w.demand(1.0, engines=4)
    assert d.imbalance == pytest.approx(0.5 * 4, rel=0.02)
    w.keep({"cold0", "cold1", "cold2"})  # "hot" left the fleet
    assert w.demand(1.0, engines=3).imbalance == pytest.approx(1.0, rel=0.2)


def test_the_model_predicts_the_simulated_engines_decode_time() -> None:
    """At a steady rate on 4 simulated engines, the model's steady-state TPOT
    (overhead / (1 - rho)) is the engines' median TPOT within 15 %."""
    w = build_workload("generated-shared-prefix", {"seed": 0, "rate": 40.0})
    reqs = w.requests[:800]
    run = simulate(reqs, {"name": "slo_aware", "params": {}}, SimOptions(num_workers=4))
    ok = [r for r in run.results if r.status == OK and r.send_s > 5.0]
    prompt = sum(r.prompt_tokens for r in ok) / len(ok)
    uncached = sum(r.prompt_tokens - r.cached_tokens for r in ok) / len(ok)
    output = sum(r.completion_tokens for r in ok) / len(ok)
    coef = StepCoefficients.from_engine(make_engine_config({}))
    need = engines_needed(Demand(40.0, 0, prompt, uncached, output), coef, 2.0, 0.05)
    rho = 40.0 / 4 * need.work_s
    predicted = coef.overhead_s / (1 - rho)
    measured = percentile([tpot_s(r) for r in ok], 50)
    assert measured == pytest.approx(predicted, rel=0.15)


def test_the_ramp_signal_exceeds_the_fleet_before_attainment_falls(tmp_path: Path) -> None:
    from bench.scaling_ramp import build_parser, main, run_seed

    a = build_parser().parse_args(
        ["-n", "2", "--start-rate", "4", "--end-rate", "60", "--duration", "40", "--seeds", "0"]
    )
    r = run_seed(a, 0)
    assert r["attainment_falls_s"] is not None  # the ramp goes past what 2 engines serve
    assert r["signal_exceeds_fleet_s"] is not None
    assert r["signal_exceeds_fleet_s"] < r["attainment_falls_s"], r["lead_s"]
    rc = main(
        ["-n", "2", "--end-rate", "10", "--duration", "6", "--seeds", "0", "--plot",
         str(tmp_path / "ramp.png"), "--out-dir", str(tmp_path)]
    )  # fmt: skip
    assert rc == 0 and (tmp_path / "ramp.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "scaling-ramp" / "scaling_ramp.json").is_file()
    assert main(["--seeds", ""]) == 2


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--scaling-margin", "0"), ("--scaling-margin", "1.5"), ("--scaling-window", "0")],
)
def test_the_router_refuses_a_bad_scaling_option(flag: str, value: str) -> None:
    from services.cli import main

    with pytest.raises(SystemExit, match=f"invalid {flag}"):
        main(["router", flag, value])
