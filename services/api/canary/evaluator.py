"""The canary decision function (pure): per-arm window stats in, a decision out.

States of a canary (kept in Postgres by the runner)::

    running --advance--> running (next step) --complete--> promoted
       |  \\--rollback--> rolled_back
       |--pause--> paused --resume--> running (new window)
       \\--abort (by hand, from running or paused)--> aborted
    promote by hand (running or paused) --> promoted

Decision rules, for the current step (traffic fraction ``steps[i]`` to the candidate):

- A check compares the candidate with the control over the same window:
  ``ttft_p95_ratio`` (candidate p95 / control p95 <= ``max_ttft_p95_ratio``),
  ``timeout_rate_delta`` and ``error_rate_delta`` (candidate - control <= ``max_*_delta``),
  ``cache_hit_rate_drop`` (control - candidate <= ``max_cache_hit_rate_drop``).
  Each check is named after what its value is (a ratio, a delta, a drop), as its criterion is,
  so a reason such as ``cache_hit_rate_drop 0.15 > 0.1`` is not read as the hit rate itself.
  A check with no data on either side (e.g. no cached-token reports) is skipped, not passed.
- Checks run only when both arms have at least ``min_samples`` requests (and, for TTFT,
  ``min_samples`` TTFT samples).
- Any failing check -> ``rollback`` at once (fail fast, even mid-window).
- At the end of the step window: all checks pass -> ``advance`` (or ``complete`` after the
  last step); too few samples -> ``hold`` (the step is extended until there are enough).
- Otherwise ``hold``.

At a 100 % step the control gets no traffic (its outcomes in that window are stragglers of the
switch); the runner then passes the control stats of the latest earlier window with at least
``min_samples`` control requests as the baseline.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from services.api.canary.stats import ArmStats

DEFAULT_STEPS: tuple[float, ...] = (0.05, 0.25, 0.5, 1.0)
DEFAULT_STEP_DURATION_S = 600.0

Action = Literal["hold", "advance", "complete", "rollback"]


@dataclass(frozen=True)
class Criteria:
    max_ttft_p95_ratio: float = 1.25
    max_timeout_rate_delta: float = 0.01
    max_error_rate_delta: float = 0.01
    max_cache_hit_rate_drop: float = 0.10
    min_samples: int = 100

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Criteria:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in (data or {}).items() if k in names})


@dataclass(frozen=True)
class Check:
    name: str
    candidate: float
    control: float
    value: float  # ratio or difference compared with the threshold
    threshold: float
    passed: bool


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    numbers: dict[str, Any] = field(default_factory=dict)

    @property
    def changes_state(self) -> bool:
        return self.action != "hold"


def compare(criteria: Criteria, control: ArmStats, candidate: ArmStats) -> list[Check]:
    """Every check that has data on both sides (see module doc for the rules)."""
    checks: list[Check] = []
    c_p95, k_p95 = control.ttft_p95, candidate.ttft_p95
    if (
        c_p95
        and k_p95 is not None
        and control.ttft_samples >= criteria.min_samples
        and candidate.ttft_samples >= criteria.min_samples
    ):
        ratio = k_p95 / c_p95
        checks.append(
            Check(
                "ttft_p95_ratio",
                k_p95,
                c_p95,
                ratio,
                criteria.max_ttft_p95_ratio,
                ratio <= criteria.max_ttft_p95_ratio,
            )
        )
    for name, threshold in (
        ("timeout_rate", criteria.max_timeout_rate_delta),
        ("error_rate", criteria.max_error_rate_delta),
    ):
        k, c = getattr(candidate, name), getattr(control, name)
        if k is not None and c is not None:
            delta = k - c
            checks.append(
                Check(f"{name}_delta", k, c, delta, threshold, delta <= threshold + 1e-12)
            )
    k_hit, c_hit = candidate.cache_hit_rate, control.cache_hit_rate
    if k_hit is not None and c_hit is not None:
        drop = c_hit - k_hit
        checks.append(
            Check(
                "cache_hit_rate_drop",
                k_hit,
                c_hit,
                drop,
                criteria.max_cache_hit_rate_drop,
                drop <= criteria.max_cache_hit_rate_drop + 1e-12,
            )
        )
    return checks


@dataclass(frozen=True)
class CanaryEvaluator:
    steps: tuple[float, ...] = DEFAULT_STEPS
    step_duration_s: float = DEFAULT_STEP_DURATION_S
    criteria: Criteria = Criteria()

    def decide(
        self,
        step_index: int,
        elapsed_s: float,
        control: ArmStats,
        candidate: ArmStats,
    ) -> Decision:
        """Decide for the window of step ``step_index`` after ``elapsed_s`` seconds."""
        cr = self.criteria
        fraction = self.steps[step_index]
        last = step_index >= len(self.steps) - 1
        window_done = elapsed_s >= self.step_duration_s
        enough = control.requests >= cr.min_samples and candidate.requests >= cr.min_samples
        checks = compare(cr, control, candidate) if enough else []
        numbers: dict[str, Any] = {
            "step_index": step_index,
            "fraction": fraction,
            "elapsed_s": round(elapsed_s, 3),
            "step_duration_s": self.step_duration_s,
            "min_samples": cr.min_samples,
            "control": control.summary(),
            "candidate": candidate.summary(),
            "checks": [asdict(c) for c in checks],
        }
        failed = [c for c in checks if not c.passed]
        if failed:
            parts = ", ".join(
                f"{c.name} {c.value:.4g} > {c.threshold:.4g} "
                f"(candidate {c.candidate:.4g}, control {c.control:.4g})"
                for c in failed
            )
            return Decision("rollback", f"criteria failed at step {fraction:.0%}: {parts}", numbers)
        if not window_done:
            return Decision("hold", "step window still open", numbers)
        if not enough:
            return Decision(
                "hold",
                f"step window over but too few samples (control {control.requests}, "
                f"candidate {candidate.requests}, need {cr.min_samples} each)",
                numbers,
            )
        passed = ", ".join(f"{c.name} {c.value:.4g} <= {c.threshold:.4g}" for c in checks)
        if last:
            return Decision("complete", f"all criteria passed at {fraction:.0%}: {passed}", numbers)
        nxt = self.steps[step_index + 1]
        return Decision(
            "advance",
            f"all criteria passed at {fraction:.0%}, widening to {nxt:.0%}: {passed}",
            numbers,
        )
