"""Fit the simulator's step-time model to measured forward-pass times, and load a fitted
engine profile.

The model (``EngineConfig``, :meth:`services.core.engine.Engine.step_time`) prices one
forward pass as a sum of five terms::

    t = step_overhead_s
      + prefill_token_s   * prefill_tokens   # uncached prompt tokens computed
      + prefill_attn_s    * prefill_attn     # sum over those tokens of their context length
      + decode_seq_s      * decode_seqs      # sequences decoding one token
      + decode_kv_token_s * kv_read          # KV tokens read by their attention

A measured step is a :class:`StepSample`. :func:`fit_step_model` finds the five coefficients
by least squares on the *relative* error (a 5 ms decode step and a 0.3 s prefill step count
alike), with every coefficient kept >= 0: a term whose unconstrained fit is negative is set
to zero and the rest refitted, one term at a time (an active-set loop over five terms).

A profile file (``bench/profiles/*.json``, written by ``python -m bench.engine_profile``)
holds the device, the model shape, every measured step and the fitted coefficients;
:func:`load_profile` turns it into ``EngineConfig`` settings.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

TERMS: tuple[str, ...] = (
    "step_overhead_s",
    "prefill_token_s",
    "prefill_attn_s",
    "decode_seq_s",
    "decode_kv_token_s",
)
PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


@dataclass(frozen=True)
class StepSample:
    """One forward pass: a prompt chunk of ``prefill_tokens`` tokens after ``prefill_context``
    cached ones (0 tokens: none), and ``decode_seqs`` sequences each decoding its next token
    after ``decode_context`` cached ones; ``seconds`` is its measured duration."""

    prefill_tokens: int
    prefill_context: int
    decode_seqs: int
    decode_context: int
    seconds: float

    def features(self) -> tuple[float, float, float, float, float]:
        """The model's five regressors, counted as the simulated engine counts them."""
        n, a = self.prefill_tokens, self.prefill_context
        prefill_attn = n * a + n * (n + 1) // 2  # positions a..a+n-1 attend to 0..their own
        kv_read = self.decode_seqs * (self.decode_context + 1)  # the new token's KV too
        return (1.0, float(n), float(prefill_attn), float(self.decode_seqs), float(kv_read))


def predict(coefficients: dict[str, float], sample: StepSample) -> float:
    return sum(coefficients[t] * x for t, x in zip(TERMS, sample.features(), strict=True))


def fit_step_model(samples: list[StepSample]) -> dict[str, float]:
    """Non-negative least squares on relative error over ``samples`` (see the module doc)."""
    if len(samples) < len(TERMS):
        raise ValueError(f"need at least {len(TERMS)} samples to fit {len(TERMS)} terms")
    if any(not (s.seconds > 0 and math.isfinite(s.seconds)) for s in samples):
        raise ValueError("every sample needs a positive, finite duration")
    x = np.array([s.features() for s in samples], dtype=float)
    y = np.array([s.seconds for s in samples], dtype=float)
    # relative error: divide each row by its own time
    xw, yw = x / y[:, None], np.ones_like(y)
    # scale columns to comparable magnitudes so lstsq is well conditioned
    scale = np.abs(xw).max(axis=0)
    scale[scale == 0] = 1.0
    active = [i for i in range(len(TERMS)) if np.any(x[:, i] != 0)]
    coef = np.zeros(len(TERMS))
    while active:
        sol, *_ = np.linalg.lstsq(xw[:, active] / scale[active], yw, rcond=None)
        sol = sol / scale[active]
        if np.all(sol >= 0):
            coef[:] = 0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))  # drop the most negative term, refit the rest
    return {t: float(c) for t, c in zip(TERMS, coef, strict=True)}


def relative_errors(coefficients: dict[str, float], samples: list[StepSample]) -> list[float]:
    """(predicted - measured) / measured for each sample."""
    return [predict(coefficients, s) / s.seconds - 1.0 for s in samples]


def samples_from(rows: list[dict[str, Any]]) -> list[StepSample]:
    return [
        StepSample(
            prefill_tokens=int(r["prefill_tokens"]),
            prefill_context=int(r["prefill_context"]),
            decode_seqs=int(r["decode_seqs"]),
            decode_context=int(r["decode_context"]),
            seconds=float(r["seconds"]),
        )
        for r in rows
    ]


def load_profile(name_or_path: str) -> dict[str, Any]:
    """``EngineConfig`` settings of a fitted profile: a file name under bench/profiles/
    (without ``.json``) or a path. The fitted step-time terms, the KV pool the device's memory
    holds, and its memory figures."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.json"
    doc = json.loads(path.read_text())
    settings: dict[str, Any] = dict(doc["fit"])
    settings.update(doc.get("engine", {}))
    return settings
