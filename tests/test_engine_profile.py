"""The step-time fit (bench.engine_fit) and the measured H200 profile it produced."""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import replace

import pytest

from bench import engine_profile
from bench.engine_fit import (
    PROFILE_DIR,
    TERMS,
    StepSample,
    fit_step_model,
    load_profile,
    predict,
    relative_errors,
    samples_from,
)
from services.core.engine import Engine, EngineConfig
from services.core.engine_profiles import ENGINE_PROFILES, H200_LLAMA_3_8B_STEP

H200 = PROFILE_DIR / "h200-llama-3-8b.json"


def grid() -> list[StepSample]:
    """The shape of bench.engine_profile's grid, durations left to the caller."""
    rows = [StepSample(n, c, 0, 0, 1.0) for n, c in engine_profile.PREFILL_GRID]
    rows += [StepSample(0, 0, b, L, 1.0) for b, L in engine_profile.DECODE_GRID]
    return rows


def test_features_count_as_the_simulated_engine_does() -> None:
    # a chunk of 3 tokens after 5 cached: positions 5, 6, 7 attend to 6, 7, 8 tokens
    # a batch of 2 decoding after 10 cached tokens each: each reads 11 (its own token's KV too)
    sample = StepSample(3, 5, 2, 10, 1.0)
    assert sample.features() == (1.0, 3.0, 21.0, 2.0, 22.0)
    c = EngineConfig(
        step_overhead_s=1.0,
        prefill_token_s=10.0,
        prefill_attn_s=100.0,
        decode_seq_s=1000.0,
        decode_kv_token_s=10000.0,
    )
    coefficients = {t: getattr(c, t) for t in TERMS}
    # the engine's own step_time on the same counts (its kv_read: each sequence's tokens so far)
    assert predict(coefficients, sample) == Engine(c).step_time(3, 21, 2, 22)


def test_fit_recovers_known_coefficients_under_noise() -> None:
    truth = {
        "step_overhead_s": 6.5e-3,
        "prefill_token_s": 4.0e-5,
        "prefill_attn_s": 2.5e-9,
        "decode_seq_s": 3.0e-5,
        "decode_kv_token_s": 5.5e-8,
    }
    rng = random.Random(3)
    noisy = [replace(s, seconds=predict(truth, s) * rng.uniform(0.98, 1.02)) for s in grid()]
    fit = fit_step_model(noisy)
    for term in TERMS:
        assert fit[term] == pytest.approx(truth[term], rel=0.15), term
    assert max(abs(e) for e in relative_errors(fit, noisy)) < 0.04


def test_fit_keeps_every_term_non_negative() -> None:
    # decode times that fall with the batch size at a given KV read would fit a negative
    # per-sequence cost: the fit drops that term instead
    samples = [StepSample(n, c, 0, 0, 0.005 + 4e-5 * n) for n, c in engine_profile.PREFILL_GRID]
    samples += [
        StepSample(0, 0, b, L, 0.005 - 1e-5 * b + 6e-8 * b * (L + 1))
        for b in (1, 4, 16, 64)
        for L in (256, 1024, 4096)
    ]
    fit = fit_step_model(samples)
    assert all(v >= 0 for v in fit.values())
    assert fit["decode_seq_s"] == 0.0
    assert fit["prefill_token_s"] == pytest.approx(4e-5, rel=0.05)


def test_fit_refuses_too_few_or_bad_samples() -> None:
    with pytest.raises(ValueError, match="at least 5"):
        fit_step_model(grid()[:4])
    with pytest.raises(ValueError, match="positive"):
        fit_step_model([replace(s, seconds=0.0) for s in grid()])


def test_the_h200_profile_fits_its_measurements_and_predicts_the_mixed_steps() -> None:
    doc = json.loads(H200.read_text())
    assert doc["forward_check_passed"], doc["forward_check"]
    pure = samples_from([r for r in doc["steps"] if r["kind"] != "mixed"])
    mixed = samples_from([r for r in doc["steps"] if r["kind"] == "mixed"])
    assert len(pure) >= 30 and len(mixed) >= 3
    fit = fit_step_model(pure)
    # the named profile is this fit (rounded to 4 digits)
    for term in TERMS:
        assert H200_LLAMA_3_8B_STEP[term] == pytest.approx(fit[term], rel=1e-3), term
    errors = [abs(e) for e in relative_errors(fit, pure)]
    assert statistics.median(errors) < 0.08
    # steps the fit never saw: a prompt chunk beside a decode batch, the model adds the two
    assert max(abs(e) for e in relative_errors(fit, mixed)) < 0.15


def test_load_profile_and_the_named_profiles_build_engine_configs() -> None:
    assert load_profile("h200-llama-3-8b") == pytest.approx(json.loads(H200.read_text())["fit"])
    for name, settings in ENGINE_PROFILES.items():
        cfg = replace(EngineConfig(), **settings)
        assert cfg.step_overhead_s > 0, name
    h200 = replace(EngineConfig(), **ENGINE_PROFILES["h200-llama-3-8b"])
    # its KV pool is what the card holds beside the weights, as the default's is for 80 GB
    free = 0.9 * h200.gpu_mem_total_bytes - h200.weights_bytes - h200.activation_bytes
    assert h200.num_gpu_blocks * h200.block_bytes == pytest.approx(free, rel=0.01)


def test_refit_command_prints_the_fit_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_profile.main(["--fit", str(H200)]) == 0
    out = capsys.readouterr().out
    assert "prefill_token_s" in out and "relative error over 42 steps" in out
