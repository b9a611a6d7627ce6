"""Per-worker latency model: predicted TTFT and TPOT of a request on a worker, and the delay it
imposes on the requests already decoding there; calibrated online from what a router observes.

Model (continuous batching with chunked prefill, first come first served, as vLLM / SGLang and
our engine model schedule). One engine step costs

    step_s = overhead + prefill_token x prefill_tokens + prefill_attn x prefill_tokens x context
           + decode_seq x decoding_seqs + decode_kv_token x kv_tokens_read

(the same terms as :meth:`services.core.engine.Engine.step_time`). A step carries every
decoding sequence (1 token each) and up to ``budget - decoding`` prompt tokens. For a request
with ``uncached`` tokens to compute (of a ``prompt``) and ``output`` tokens to generate, sent to a
worker with ``queued`` prompt tokens still to compute before it, ``decoding`` sequences
decoding and ``kv_tokens`` KV tokens they read per step:

- ``ttft_s``: ``k`` steps, ``k = ceil((queued + uncached) / (budget - decoding))``, each with
  the decode work, plus the prefill compute of the queue and of this prompt;
- ``tpot_s``: a decode step with this request added (its own context read every step);
- ``imposed_s``: what each request already decoding there waits more in total: this prompt's
  prefill compute (it shares their steps) plus this request's per-step decode cost over
  ``output`` steps; ``itl_spike_s`` is the longest step they see meanwhile.

Simplifications: queued prompts' attention is not modelled (their context is unknown to the
router; calibration absorbs the mean); prefills that arrive after this request are not
predicted (the router charges each one's ``imposed_s`` when it routes it).

Calibration: the five coefficients are a linear model, fitted per worker by recursive least
squares with a forgetting factor (recent observations weigh more, so it follows an engine whose
speed changes) from (a) first-token times (TTFT of a request whose queue and decode load at
dispatch are known: features ``k, tokens, tokens x context, k x decoding, k x kv_tokens``) and
(b) inter-token times of decode steps (features ``1, prefill tokens, ..., decoding, kv``).
Before any data the model *is* its prior: :meth:`StepCoefficients.from_engine` (the engine
model's step-time defaults, a Llama-3-8B on one H100), held with ``prior_weight`` observations'
worth of confidence. Coefficients are clamped at zero; forgetting never leaves a coefficient
more uncertain than its prior (a term no observation touches keeps its prior value and
variance however long the router runs).

Invariant: pure (no I/O, no clock); the same observations in the same order give the same
coefficients; predictions are monotone in ``queued``, ``uncached`` and ``decoding``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

N_COEF = 5  # overhead, prefill_token, prefill_attn, decode_seq, decode_kv_token
PREFILL_TOKEN = 1  # index of prefill_token_s


@dataclass(frozen=True, slots=True)
class StepCoefficients:
    """Seconds per unit of each step-time term."""

    overhead_s: float = 0.0065
    prefill_token_s: float = 4.0e-5
    prefill_attn_s: float = 2.5e-9
    decode_seq_s: float = 3.0e-5
    decode_kv_token_s: float = 5.5e-8

    @classmethod
    def from_engine(cls, cfg: object | None = None) -> StepCoefficients:
        """The engine model's defaults (``services.core.engine.EngineConfig``), or ``cfg``'s."""
        if cfg is None:
            from services.core.engine import EngineConfig  # noqa: PLC0415

            cfg = EngineConfig()
        return cls(
            cfg.step_overhead_s,  # type: ignore[attr-defined]
            cfg.prefill_token_s,  # type: ignore[attr-defined]
            cfg.prefill_attn_s,  # type: ignore[attr-defined]
            cfg.decode_seq_s,  # type: ignore[attr-defined]
            cfg.decode_kv_token_s,  # type: ignore[attr-defined]
        )

    def as_list(self) -> list[float]:
        return [
            self.overhead_s,
            self.prefill_token_s,
            self.prefill_attn_s,
            self.decode_seq_s,
            self.decode_kv_token_s,
        ]


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What is on a worker when a request would be sent there."""

    queued_tokens: float = 0.0  # prompt tokens still to compute before this request
    decoding: int = 0  # sequences decoding (past their first token)
    kv_tokens: float = 0.0  # KV tokens those sequences read per step
    budget: int = 8192  # tokens per step (max_num_batched_tokens)


@dataclass(frozen=True, slots=True)
class Prediction:
    ttft_s: float
    tpot_s: float
    imposed_s: float  # extra time each request already decoding there waits, in total
    itl_spike_s: float  # the longest step those requests see while this prompt is computed
    decoding: int  # how many requests are decoding there (who pays ``imposed_s``)
    prefill_s: float  # this prompt's own compute time there (its uncached tokens)


def predict(
    c: StepCoefficients | list[float],
    load: WorkerLoad,
    uncached: float,
    prompt: float,
    output: float,
) -> Prediction:
    """This request's TTFT and TPOT on a worker with ``load``, and what it imposes there."""
    th = c.as_list() if isinstance(c, StepCoefficients) else c
    ttft, tpot, imposed, prefill_s = predict_fast(
        th, load.queued_tokens, load.decoding, load.kv_tokens, load.budget, uncached, prompt, output
    )
    ov, pt, pa, ds, dk = th
    d = load.decoding
    per_step = load.budget - d if load.budget - d > 1 else 1
    chunk = min(uncached, per_step)
    context = prompt - uncached / 2.0
    spike = ov + ds * d + dk * load.kv_tokens + pt * chunk + pa * chunk * context
    return Prediction(ttft, tpot, imposed, spike, d, prefill_s)


def predict_fast(
    th: list[float],
    queued: float,
    decoding: int,
    kv_tokens: float,
    budget: int,
    uncached: float,
    prompt: float,
    output: float,
) -> tuple[float, float, float, float]:
    """:func:`predict` on the decision path: (ttft_s, tpot_s, imposed_s, prefill_s), no
    objects built (a policy calls it once per candidate worker)."""
    ov, pt, pa, ds, dk = th
    per_step = budget - decoding if budget - decoding > 1 else 1
    tokens = queued + uncached
    steps = -(-tokens // per_step) if tokens > per_step else 1
    decode_step = ds * decoding + dk * kv_tokens
    prefill_s = pt * uncached + pa * uncached * (prompt - uncached / 2.0)
    ttft = steps * (ov + decode_step) + pt * queued + prefill_s
    own = ds + dk * (prompt + output / 2.0)
    return ttft, ov + decode_step + own, prefill_s + output * own, prefill_s


def prefill_s(th: list[float], uncached: float, prompt: float) -> float:
    """This prompt's own compute time on a worker (its ``uncached`` tokens of a ``prompt``):
    the per-token and attention terms of the steps that carry them, ``prefill_s`` of
    :func:`predict_fast` (written inline there, on the decision path). Every request
    decoding there waits this much more in total (its chunks share their steps): the prefill
    stall ``slo_aware`` and ``kv_aware`` (``imposed_weight``) charge per decoding request."""
    return th[1] * uncached + th[2] * uncached * (prompt - uncached / 2.0)


def step_s(
    c: StepCoefficients | list[float],
    decoding: int,
    kv_tokens: float,
    prefill_tokens: float = 0.0,
    prefill_context: float = 0.0,
) -> float:
    """One engine step's predicted duration with this work: the inter-token time of the
    sequences decoding in it (the quantity :meth:`LatencyModel.observe_step` fits)."""
    th = c.as_list() if isinstance(c, StepCoefficients) else c
    x = step_features(prefill_tokens, prefill_context, decoding, kv_tokens)
    return th[0] * x[0] + th[1] * x[1] + th[2] * x[2] + th[3] * x[3] + th[4] * x[4]


def ttft_features(load: WorkerLoad, uncached: float, prompt: float) -> list[float]:
    """The regressors of an observed TTFT (coefficients dotted with these = predicted TTFT)."""
    d = load.decoding
    steps = max(1, math.ceil((load.queued_tokens + uncached) / max(1, load.budget - d)))
    return [
        float(steps),
        load.queued_tokens + uncached,
        uncached * (prompt - uncached / 2.0),
        float(steps * d),
        steps * load.kv_tokens,
    ]


def step_features(
    prefill_tokens: float, prefill_context: float, decoding: int, kv_tokens: float
) -> list[float]:
    """The regressors of one observed step (an inter-token time)."""
    return [
        1.0,
        prefill_tokens,
        prefill_tokens * prefill_context,
        float(decoding),
        kv_tokens,
    ]


@dataclass
class LatencyModel:
    """One worker's coefficients, fitted online by recursive least squares.

    ``theta`` starts at the prior; ``p`` (the inverse information matrix, scaled per
    coefficient so that the prior counts as ``prior_weight`` observations of typical size)
    shrinks as observations arrive; ``forget`` < 1 discounts old observations."""

    prior: StepCoefficients = field(default_factory=StepCoefficients)
    prior_weight: float = 1.0
    forget: float = 0.995
    theta: list[float] = field(default_factory=list)
    p: list[list[float]] = field(default_factory=list)
    observations: int = 0

    # typical feature sizes: the prior's confidence is set relative to them
    _SCALE = (2.0, 4096.0, 4096.0 * 4096.0, 32.0, 32.0 * 2048.0)

    def __post_init__(self) -> None:
        if not self.theta:
            self.theta = self.prior.as_list()
        # the prior's variance per coefficient: the most uncertain a coefficient ever gets
        self._prior_var = [1.0 / (self.prior_weight * s**2) for s in self._SCALE]
        if not self.p:
            self.p = [
                [self._prior_var[i] if i == j else 0.0 for j in range(N_COEF)]
                for i in range(N_COEF)
            ]

    @property
    def coefficients(self) -> StepCoefficients:
        return StepCoefficients(*self.theta)

    def predict(self, load: WorkerLoad, uncached: float, prompt: float, output: float):
        return predict(self.theta, load, uncached, prompt, output)

    def observe(self, x: list[float], y: float, only: tuple[int, ...] | None = None) -> None:
        """One observation: ``y`` seconds measured where the model says ``theta . x``.
        ``only``: fit just these coefficients (the others' part of ``y`` is taken as
        predicted), for observations that cannot tell the others apart."""
        if not (y >= 0.0 and math.isfinite(y)):
            return
        if only is not None:
            y -= sum(self.theta[j] * x[j] for j in range(N_COEF) if j not in only)
            x = [x[j] if j in only else 0.0 for j in range(N_COEF)]
        p, lam, cap = self.p, self.forget, self._prior_var
        nz = [j for j in range(N_COEF) if x[j] != 0.0]
        # P x over the observed terms only (the others add exact zeros: the same floats)
        px = [sum(row[j] * x[j] for j in nz) for row in p]
        denom = lam + sum(x[i] * px[i] for i in nz)
        if denom <= 0.0:
            return
        err = y - sum(self.theta[i] * x[i] for i in nz)
        gain = [v / denom for v in px]
        theta = [t + g * err for t, g in zip(self.theta, gain, strict=True)]
        self.theta = [t if t > 0.0 else 0.0 for t in theta]
        # P <- (P - gain px') / forget, and then D P D: forgetting divides all of P, also along
        # terms no observation excites (a first token fits only the prefill-token term; nothing
        # a router observes moves the prefill-attention term). Unbounded, those variances grew
        # by 1/forget an observation and overflowed (inf x 0 = NaN: every coefficient lost). A
        # coefficient is never more uncertain than its prior: where a variance would exceed the
        # prior's, its row and column are scaled down to it (D diagonal and positive keeps P
        # symmetric positive semi-definite).
        var = [(p[i][i] - gain[i] * px[i]) / lam for i in range(N_COEF)]
        d = [math.sqrt(c / v) if v > c else 1.0 for c, v in zip(cap, var, strict=True)]
        # computed once per pair and mirrored: P stays exactly symmetric (rounding would
        # otherwise make it drift apart, and with it the positive semi-definiteness)
        a = [di / lam for di in d]
        q = [[0.0] * N_COEF for _ in range(N_COEF)]
        for i in range(N_COEF):
            row, g, ai = p[i], gain[i], a[i]
            qi = q[i]
            for j in range(i, N_COEF):
                qi[j] = q[j][i] = (row[j] - g * px[j]) * ai * d[j]
        self.p = q
        self.observations += 1

    def observe_first_token(
        self, load: WorkerLoad, uncached: float, prompt: float, ttft_s: float
    ) -> None:
        """A request sent with ``load`` there had its first token after ``ttft_s``."""
        self.observe(ttft_features(load, uncached, prompt), ttft_s)

    def observe_prefill(self, tokens: float, seconds: float, load: WorkerLoad) -> None:
        """A batch of ``tokens`` prompt tokens took ``seconds`` to compute beside ``load``'s
        decoders (e.g. from a router's prefill clock): fits the per-token prefill cost only;
        a duration alone cannot tell the step terms apart, so they keep their values."""
        self.observe(ttft_features(load, tokens, tokens), seconds, only=(PREFILL_TOKEN,))

    def observe_step(
        self,
        itl_s: float,
        decoding: int,
        kv_tokens: float,
        prefill_tokens: float = 0.0,
        prefill_context: float = 0.0,
    ) -> None:
        """An inter-token time ``itl_s`` of a step with this work (a router streaming from a
        worker with no prompt queued knows ``prefill_tokens`` = 0)."""
        self.observe(step_features(prefill_tokens, prefill_context, decoding, kv_tokens), itl_s)
