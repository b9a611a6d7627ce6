"""Stall detection: how long a stream may go without a byte from its worker, once its first
token is out, before the router treats the worker as hung and moves the stream elsewhere
(:mod:`services.router.migrate`, as for a stream whose worker died).

    bound = min(stream_idle_timeout, max(stall_min_s, stall_factor x gap, 2 x longest_step))

- ``gap``: the worker's predicted inter-token time, one decode step with the sequences in
  flight there (this one included), each reading the running mean context: the quantity the
  policy's latency model (``slo_aware``, :mod:`services.core.latency`) is fitted on from the
  mean gaps of finished streams. A policy without a model (``kv_aware``, ``round_robin``, ...)
  predicts from the engine model's default step times (the prior); the floor then decides.
- ``longest_step``: a step that also computes a full prefill chunk (``step_budget`` tokens) at
  the running mean context: the longest gap a healthy engine with chunked prefill makes
  between two tokens of a decoding sequence. Twice it is never judged a stall, whatever
  ``stall_factor`` says (a long-context fleet's chunks take seconds).

The first token is not judged here: until then the stream waits at most
``stream_idle_timeout``, as before. A first token waits for the prefill of the prompt and of
the prompts queued before it, which depends on what the router cannot see exactly (the
engine's own queue and preemptions, other routers' requests within the load-sharing lag); a
stream that fails before output is retried from scratch elsewhere, recomputing the prefill,
so a false stall there costs the most and the client has seen nothing to be stalled.

Invariant: :meth:`StallBound.bound_s` lies in ``[min(stall_min_s, idle), idle]``;
``stall_factor`` 0 turns detection off (the bound is the idle timeout); it reads the policy's
state, never changes it (no model is created for a worker the policy has not seen).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common import settings as S
from services.core.latency import StepCoefficients, step_s
from services.core.policy.base import Policy

SPIKE_MARGIN = 2.0  # x the longest legitimate step (a full prefill chunk beside the decoders)
DEFAULT_BUDGET = 8192  # tokens per engine step when the policy does not say (vLLM's default)
_PRIOR = StepCoefficients.from_engine().as_list()

OPTIONS = (
    S.option(
        "stall_factor",
        20.0,
        "a stream whose next token is overdue by this many times its worker's predicted "
        "inter-token time (the latency model's decode step there) counts as broken and "
        "continues on another worker, as one whose worker died does; bounded below by "
        "--stall-min-s and above by --stream-idle-timeout; the first token is left to "
        "--stream-idle-timeout; 0: off (the idle timeout only)",
        env="KVGATE_ROUTER_STALL_FACTOR",
    ),
    S.option(
        "stall_min_s",
        2.0,
        "shortest silence (seconds) after a stream's first token that may count as a stall, "
        "however fast its worker is predicted to be (see --stall-factor)",
        env="KVGATE_ROUTER_STALL_MIN_S",
    ),
)


@dataclass(frozen=True, slots=True)
class StallBound:
    factor: float  # x the predicted inter-token time (0: off)
    min_s: float  # the floor of the bound
    idle_s: float  # the ceiling: the stream idle timeout

    @classmethod
    def from_settings(cls, st: Any) -> StallBound:
        """From the router's settings; ValueError naming the flag for a bad value."""
        factor = float(getattr(st, "stall_factor", 0.0))
        min_s = float(getattr(st, "stall_min_s", 2.0))
        idle_s = float(st.stream_idle_timeout)
        if not factor >= 0.0 or factor == float("inf"):
            raise ValueError(f"--stall-factor must be a number >= 0 (0: off), not {factor}")
        if not 0.0 < min_s < float("inf"):
            raise ValueError(f"--stall-min-s must be a number of seconds > 0, not {min_s}")
        return cls(factor, min_s, idle_s)

    @property
    def enabled(self) -> bool:
        return self.factor > 0.0 and self.min_s < self.idle_s

    def gaps_s(
        self, policy: Policy, worker_id: str, decoding: int, context: float
    ) -> tuple[float, float]:
        """(the predicted inter-token time, the longest legitimate step) on ``worker_id``
        with ``decoding`` sequences there; ``context``: this request's, used where the
        policy keeps no running mean."""
        extra = policy.state.extra
        models = extra.get("slo_models")
        model = models.get(worker_id) if models else None
        theta = model.theta if model is not None else getattr(policy.impl, "prior", None)
        if theta is None:
            theta = _PRIOR
        ctx = extra.get("slo_ctx") or context
        d = decoding if decoding > 1 else 1
        gap = step_s(theta, d, d * ctx)
        budget = policy.params.get("step_budget") or DEFAULT_BUDGET
        chunk = max(1, budget - d)
        longest = step_s(theta, d, d * ctx, chunk, ctx)
        return gap, longest

    def bound_s(self, policy: Policy, worker_id: str, decoding: int, context: float) -> float:
        """Seconds the next byte may take before the stream counts as stalled."""
        if not self.enabled:
            return self.idle_s
        gap, longest = self.gaps_s(policy, worker_id, decoding, context)
        bound = max(self.min_s, self.factor * gap, SPIKE_MARGIN * longest)
        return bound if bound < self.idle_s else self.idle_s
