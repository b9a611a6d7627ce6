"""The canary decision function and per-arm stats, tested directly (pure, no I/O)."""

from __future__ import annotations

import random

import pytest

from services.api.canary.evaluator import CanaryEvaluator, Criteria, compare
from services.api.canary.stats import GROWTH, ArmStats, bucket_upper, ttft_bucket


def arm(
    n: int,
    ttft_s: float,
    errors: int = 0,
    timeouts: int = 0,
    hit: float | None = 0.5,
    jitter: float = 0.0,
    seed: int = 0,
) -> ArmStats:
    rng = random.Random(seed)
    st = ArmStats()
    for i in range(n):
        if i < errors:
            st.add("error")
        elif i < errors + timeouts:
            st.add("timeout")
        else:
            cached = None if hit is None else int(100 * hit)
            st.add("ok", ttft_s * (1 + jitter * rng.random()), 100, cached)
    return st


def test_ttft_bucket_bounds_hold_for_many_values() -> None:
    rng = random.Random(1)
    for _ in range(2000):
        x = 10 ** rng.uniform(-2.9, 2.5)
        b = ttft_bucket(x)
        assert bucket_upper(b) / GROWTH < x * (1 + 1e-9)
        assert x <= bucket_upper(b) * (1 + 1e-9)


def test_quantile_is_within_one_bucket_of_exact() -> None:
    rng = random.Random(2)
    samples = [rng.lognormvariate(-2, 0.7) for _ in range(5000)]
    st = ArmStats()
    for s in samples:
        st.add("ok", s)
    exact = sorted(samples)[int(0.95 * len(samples)) - 1]
    p95 = st.ttft_p95
    assert p95 is not None
    assert exact <= p95 * (1 + 1e-9) and p95 <= exact * GROWTH * GROWTH


def test_merge_is_commutative_and_additive() -> None:
    a, b = arm(50, 0.1, errors=3, seed=1, jitter=0.5), arm(70, 0.3, timeouts=2, seed=2)
    ab, ba = a.merge(b), b.merge(a)
    assert ab == ba
    assert ab.requests == 120 and ab.errors == 3 and ab.timeouts == 2
    assert ab.ttft_samples == a.ttft_samples + b.ttft_samples


def test_cancelled_counts_nowhere_and_rejected_is_an_error() -> None:
    st = ArmStats()
    st.add("cancelled", 0.1)
    st.add("rejected")
    assert st.requests == 1 and st.errors == 1 and st.ttft_samples == 0
    assert st.cache_hit_rate is None


EV = CanaryEvaluator(steps=(0.05, 0.5, 1.0), step_duration_s=60, criteria=Criteria(min_samples=50))


def test_equal_arms_hold_until_window_end_then_advance() -> None:
    control, cand = arm(100, 0.2, seed=1), arm(100, 0.2, seed=2)
    early = EV.decide(0, 30.0, control, cand)
    assert early.action == "hold" and "still open" in early.reason
    done = EV.decide(0, 60.0, control, cand)
    assert done.action == "advance"
    assert "widening to 50%" in done.reason
    assert {c["name"] for c in done.numbers["checks"]} == {
        "ttft_p95_ratio",
        "timeout_rate_delta",
        "error_rate_delta",
        "cache_hit_rate_drop",
    }


def test_last_step_completes() -> None:
    d = EV.decide(2, 61.0, arm(100, 0.2), arm(100, 0.19))
    assert d.action == "complete"


def test_slow_candidate_rolls_back_mid_window_with_numbers() -> None:
    d = EV.decide(1, 5.0, arm(200, 0.2), arm(60, 0.5))
    assert d.action == "rollback"
    assert "ttft_p95_ratio" in d.reason
    check = next(c for c in d.numbers["checks"] if c["name"] == "ttft_p95_ratio")
    assert check["passed"] is False and check["value"] > 2.0
    assert d.numbers["candidate"]["requests"] == 60


@pytest.mark.parametrize(
    "cand, failing",
    [
        (dict(errors=5), "error_rate_delta"),
        (dict(timeouts=5), "timeout_rate_delta"),
        (dict(hit=0.2), "cache_hit_rate_drop"),
    ],
)
def test_each_criterion_can_fail_alone(cand: dict, failing: str) -> None:
    d = EV.decide(0, 60.0, arm(100, 0.2), arm(100, 0.2, **cand))
    assert d.action == "rollback"
    failed = [c["name"] for c in d.numbers["checks"] if not c["passed"]]
    assert failed == [failing]
    # the reason names the drop / delta, never the bare rate it would be misread as
    assert d.reason.split(": ", 1)[1].startswith(f"{failing} ")


def test_too_few_samples_never_rolls_back_and_holds_after_window() -> None:
    d = EV.decide(0, 120.0, arm(100, 0.2), arm(10, 5.0))
    assert d.action == "hold" and "too few samples" in d.reason
    assert d.numbers["checks"] == []


def test_thresholds_are_inclusive_and_configurable() -> None:
    control, cand = arm(100, 0.2), arm(100, 0.2)
    checks = compare(Criteria(max_ttft_p95_ratio=1.0, min_samples=10), control, cand)
    assert all(c.passed for c in checks)
    slow = arm(100, 0.24)
    strict = CanaryEvaluator((1.0,), 1.0, Criteria(max_ttft_p95_ratio=1.1, min_samples=10))
    lax = CanaryEvaluator((1.0,), 1.0, Criteria(max_ttft_p95_ratio=1.5, min_samples=10))
    assert strict.decide(0, 2.0, control, slow).action == "rollback"
    assert lax.decide(0, 2.0, control, slow).action == "complete"


def test_missing_cache_reports_skip_that_check() -> None:
    d = EV.decide(0, 60.0, arm(100, 0.2, hit=None), arm(100, 0.2, hit=None))
    assert d.action == "advance"
    assert "cache_hit_rate_drop" not in {c["name"] for c in d.numbers["checks"]}
