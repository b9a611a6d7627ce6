"""The per-worker latency model: predictions and online calibration (services/core/latency.py)."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from services.core.engine import Engine, EngineConfig
from services.core.latency import (
    PREFILL_TOKEN,
    LatencyModel,
    StepCoefficients,
    WorkerLoad,
    predict,
    step_features,
    ttft_features,
)


def test_prior_is_the_engine_models_defaults() -> None:
    cfg = EngineConfig()
    c = StepCoefficients.from_engine()
    assert c.prefill_token_s == cfg.prefill_token_s
    assert c.overhead_s == cfg.step_overhead_s
    assert LatencyModel(prior=c).coefficients == c


def test_prediction_by_hand() -> None:
    c = StepCoefficients(0.01, 1e-4, 0.0, 1e-3, 0.0)
    load = WorkerLoad(queued_tokens=1000, decoding=10, kv_tokens=0, budget=1010)
    # 1000 queued + 2000 uncached over 1000 tokens a step = 3 steps of 0.01 + 10 x 1e-3;
    # prefill 3000 x 1e-4 = 0.3 -> TTFT 0.06 + 0.3
    pr = predict(c, load, uncached=2000, prompt=2000, output=100)
    assert pr.ttft_s == pytest.approx(0.36)
    assert pr.tpot_s == pytest.approx(0.01 + 0.011)  # a step with 11 decoding
    # each decoder waits for this prompt's 0.2 s of prefill and 100 steps x 1e-3 of its decode
    assert pr.imposed_s == pytest.approx(0.2 + 0.1)
    assert pr.itl_spike_s == pytest.approx(0.01 + 0.01 + 1000 * 1e-4)
    more = predict(c, replace(load, queued_tokens=5000), 2000, 2000, 100)
    assert more.ttft_s > pr.ttft_s
    assert predict(c, replace(load, decoding=50), 2000, 2000, 100).tpot_s > pr.tpot_s


def _engine_obs(eng: Engine, rng: random.Random):
    """Synthetic observations with the engine model's own step times: decode steps (ITL) and
    first tokens (a prompt computed in budget-sized chunks alongside decoders)."""
    cfg = eng.config
    d = rng.randrange(0, 64)
    ctx = rng.randrange(256, 8192)
    kv = d * ctx
    if rng.random() < 0.5:
        pf = rng.choice([0, 0, rng.randrange(1, 4096)])
        pctx = rng.randrange(0, 8192)
        y = eng.step_time(pf, int(pf * (pctx + pf / 2)), d, kv)
        return "step", (pf, pctx + pf / 2, d, kv), y
    queued = rng.choice([0, rng.randrange(0, 16000)])
    uncached = rng.randrange(64, 16000)
    prompt = uncached + rng.choice([0, rng.randrange(0, 8000)])
    load = WorkerLoad(queued, d, kv, cfg.max_num_batched_tokens)
    x = ttft_features(load, uncached, prompt)
    # the engine's time for the same work: per step its overhead and decoders, plus compute
    y = (
        x[0] * eng.step_time(0, 0, d, kv)
        + cfg.prefill_token_s * (queued + uncached)
        + cfg.prefill_attn_s * x[2]
    )
    return "ttft", (load, uncached, prompt), y


@pytest.mark.parametrize(
    "engine",
    [
        {"prefill_token_s": 1.25e-4},  # the prefill-bound engine of docs/benchmarks.md
        {"step_overhead_s": 0.012, "decode_seq_s": 6e-5, "decode_kv_token_s": 1.1e-7},  # slower
        {"prefill_token_s": 1.5e-5, "step_overhead_s": 0.003},  # faster
    ],
)
def test_calibration_converges_to_an_engines_step_times(engine: dict) -> None:
    cfg = replace(EngineConfig(), **engine)
    eng = Engine(cfg, "w")
    m = LatencyModel(prior=StepCoefficients.from_engine())  # the default engine's prior
    rng = random.Random(7)
    truth = StepCoefficients.from_engine(cfg)
    probe = (WorkerLoad(4000, 32, 32 * 4000, 8192), 6000, 9000, 200)
    before = m.predict(*probe)
    want = predict(truth, *probe)
    for _ in range(1000):
        kind, args, y = _engine_obs(eng, rng)
        if kind == "step":
            pf, pctx, d, kv = args
            m.observe_step(y, d, kv, pf, pctx)
        else:
            m.observe_first_token(*args, y)
    got = m.predict(*probe)
    # the prior was off (the engines differ); the calibrated model predicts within 2 %
    assert abs(before.ttft_s - want.ttft_s) / want.ttft_s > 0.1 or (
        abs(before.tpot_s - want.tpot_s) / want.tpot_s > 0.1
    )
    assert got.ttft_s == pytest.approx(want.ttft_s, rel=0.02)
    assert got.tpot_s == pytest.approx(want.tpot_s, rel=0.02)
    assert got.imposed_s == pytest.approx(want.imposed_s, rel=0.02)
    for learned, real in zip(m.theta, truth.as_list(), strict=True):
        assert learned == pytest.approx(real, rel=0.1, abs=1e-9)


def test_bad_observations_are_ignored() -> None:
    m = LatencyModel()
    m.observe(step_features(0, 0, 1, 0), float("nan"))
    m.observe(step_features(0, 0, 1, 0), -1.0)
    assert m.observations == 0 and m.coefficients == StepCoefficients()


def test_a_long_run_of_observations_that_leave_terms_alone_keeps_the_model_finite() -> None:
    """Forgetting divides the whole uncertainty matrix at every observation, also along the
    terms an observation says nothing about: a first token fits the prefill-token term only,
    and no observation a router makes (first tokens, decode steps without prefill) ever
    touches the prefill-attention term. Unbounded, those variances grew by 1/forget per
    observation and overflowed after ~145,000 observations of one worker (minutes of a busy
    router): inf x 0 = NaN, and every coefficient went to 0 (the policy's predictions with
    them). They stay at most the prior's."""
    m = LatencyModel()
    prior_var = [m.p[i][i] for i in range(5)]
    load = WorkerLoad(queued_tokens=0, decoding=4, kv_tokens=4 * 600.0, budget=2048)
    x_first = ttft_features(load, 500, 500)
    x_step = step_features(0, 0, 4, 2400.0)

    def seconds(x: list[float], prefill_token_s: float) -> float:
        """What an engine with the prior's step terms and this prefill speed takes."""
        theta = StepCoefficients().as_list()
        theta[PREFILL_TOKEN] = prefill_token_s
        return sum(t * v for t, v in zip(theta, x, strict=True))

    rng = random.Random(7)
    for n in range(160_000):
        m.observe_prefill(500, seconds(x_first, 3.0e-5) * rng.uniform(0.95, 1.05), load)
        if n % 8 == 0:  # decode steps now and then (a streamed answer's mean gap)
            m.observe_step(seconds(x_step, 3.0e-5), 4, 2400.0)
    assert all(math.isfinite(v) for row in m.p for v in row)
    assert all(m.p[i][i] <= prior_var[i] * (1 + 1e-12) for i in range(5))  # (rounding)
    # the term the first tokens determine is learned; the one nothing touches is the prior's
    assert m.theta[PREFILL_TOKEN] == pytest.approx(3.0e-5, rel=0.1)
    assert m.theta[2] == StepCoefficients().prefill_attn_s
    # and a change of engine speed is still followed
    for _ in range(2_000):
        m.observe_prefill(500, seconds(x_first, 6.0e-5), load)
    assert m.theta[PREFILL_TOKEN] == pytest.approx(6.0e-5, rel=0.1)
