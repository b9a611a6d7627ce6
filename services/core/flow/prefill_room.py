"""The prefill room: workers kept free of best-effort prompt work so that a protected
request's first token does not wait behind another request's prompt (opt-in:
``--protect-prefill``).

A request's first token comes in the engine step that finishes its prompt; a step carries up
to ``max_num_batched_tokens`` of prompt, so a short protected prompt sent to a worker computing
a long best-effort prompt waits for those tokens (in the simulator a heavy step takes up to
~0.23 s, a light prompt alone ~0.02 s). Router-side ordering cannot help once it is sent.

Who is *protected*: a critical request, and a standard request of a tenant that, with it,
holds no more than its weighted share of the work in flight (prompt tokens, the fair queue's
dispatch charge: :meth:`~services.core.flow.Holdings.over_share`). Everything else is
*best-effort*. Counted in work, a burst of short requests from a light tenant stays under its
share while a long-prompt tenant holds most of the work, also when the room has held that
tenant back to few requests in flight.

The model (M/G/infinity): protected requests arrive at rate ``lambda`` and each keeps one worker
busy computing its prompt for ``s`` seconds (the latency model's TTFT of its prompt on an idle
worker, :func:`services.core.latency.predict_fast`). The number of workers busy with protected
prompts is then Poisson(``lambda * s``), and a protected arrival finds a prompt-free worker of
the room with probability ``protect_quantile`` when the room holds

    r = the least r with P[Poisson(lambda * s) >= r] <= 1 - protect_quantile

workers. ``lambda * s`` (the offered load in Erlangs) is measured online: each protected arrival
adds ``s / window_s`` to a sum that decays by ``exp(-dt / window_s)`` (and 1 to a count decaying
alike). While that count is below 1 (less than one protected arrival per ``window_s``, however
weighted: none recently) r = 0, and every decision is the policy's own (work-conserving).

The rule, given the policy's decision (its chosen worker and its eligible candidates in its
own order of preference, best first):

- a **protected** request goes to the policy's choice when that worker computes no prompt;
  else to the first eligible candidate, in the policy's order, that computes no prompt; else
  to the eligible candidate with the fewest queued prompt tokens (ties: the policy's order);
- a **best-effort** request goes to the policy's choice when r = 0. Else only while at least
  r candidates would still compute no prompt after it, and then to a worker computing none:
  the policy's choice when it computes none, else the first such candidate in the policy's
  order. Otherwise it is *held* (it waits in the line, and a protected request may pass it
  there). A first token ends a prompt: callers re-try held requests then, as on a released
  slot.
- the room never takes the whole fleet: r is at most the model's routable workers less one.
  A quantile the fleet cannot meet (r >= its size) would otherwise hold every best-effort
  prompt while protected traffic lasts, and the share test, counted over the work in
  flight, then finds the protected tenants themselves over their shares of what little is
  left in flight (on 2 workers at r = 3: each light tenant held to one request in flight
  while 13 of 16 slots stood empty).

Pure: no I/O, no clock (``now`` is an argument).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import msgspec

from services.common.tenancy import Priority
from services.core import latency
from services.core.policy.types import Decision, WorkerState

DEFAULT_WINDOW_S = 10.0
DEFAULT_QUANTILE = 0.8


def poisson_room(mean: float, quantile: float) -> int:
    """The least ``r >= 0`` with P[Poisson(``mean``) >= r] <= 1 - ``quantile``."""
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"protect_quantile must be in (0, 1), got {quantile}")
    if mean <= 0.0:
        return 0
    allowed = 1.0 - quantile
    tail, p, r = 1.0, math.exp(-mean), 0  # tail = P[N >= r], p = P[N = r]
    while tail > allowed and (p > 0.0 or r <= mean):
        tail -= p
        r += 1
        p *= mean / r
    return r


def protected_prompt_s(coefficients: list[float], prompt_tokens: int, budget: int) -> float:
    """``s``: how long a protected prompt keeps a worker computing it, the latency model's TTFT
    of the whole prompt on an idle worker: one step's overhead per ``budget`` tokens plus the
    prompt's own compute (:func:`services.core.latency.prefill_s`); :func:`~services.core.
    latency.predict_fast` with nothing queued or decoding."""
    n = prompt_tokens
    steps = -(-n // budget) if n > budget else 1
    return steps * coefficients[0] + latency.prefill_s(coefficients, n, n)


def is_protected(priority: Priority, over_share: bool) -> bool:
    """Critical, or standard from a tenant under its share (see the module docstring)."""
    return priority is Priority.CRITICAL or (priority is Priority.STANDARD and not over_share)


class PrefillRoom:
    """The measured protected load and the room it calls for."""

    __slots__ = ("_at", "_count", "_load", "quantile", "window_s")

    def __init__(
        self, window_s: float = DEFAULT_WINDOW_S, quantile: float = DEFAULT_QUANTILE
    ) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        poisson_room(1.0, quantile)  # validates the quantile
        self.window_s = window_s
        self.quantile = quantile
        self._load = 0.0  # lambda * s at ``_at`` (Erlangs)
        self._count = 0.0  # protected arrivals, exponentially weighted over window_s, at ``_at``
        self._at = 0.0

    def load(self, now: float) -> float:
        """The offered protected prefill load now (Erlangs: lambda * s)."""
        return self._load * self._decay(now)

    def _decay(self, now: float) -> float:
        dt = now - self._at
        return math.exp(-dt / self.window_s) if dt > 0 else 1.0

    def arrived(self, now: float, prefill_s: float) -> None:
        """A protected request arrived needing a prompt-free worker for ``prefill_s``."""
        k = self._decay(now)
        self._load = self._load * k + prefill_s / self.window_s
        self._count = self._count * k + 1.0
        self._at = max(now, self._at)

    def room(self, now: float) -> int:
        """Workers to keep free of best-effort prompt work now (0: no protected arrivals
        recently)."""
        k = self._decay(now)
        if self._count * k < 1.0:
            return 0
        return poisson_room(self._load * k, self.quantile)


def place(
    chosen: str,
    ranked: Sequence[str],
    queued: Mapping[str, int],
    protected: bool,
    room: int,
    prompt_free: int,
) -> str | None:
    """The worker for a request the policy sent to ``chosen``, or None (held).

    ``ranked``: the policy's eligible candidates, best first; ``queued``: each worker's prompt
    tokens still to compute (0 or absent: it computes no prompt); ``prompt_free``: how many of
    the model's workers compute no prompt; ``room``: :meth:`PrefillRoom.room`."""
    busy = queued.get(chosen, 0) > 0
    if protected:
        if not busy:
            return chosen
        best, least = chosen, queued.get(chosen, 0)
        for w in ranked:
            q = queued.get(w, 0)
            if q < least:
                best, least = w, q
                if not q:
                    break
        return best
    if room <= 0:
        return chosen
    if prompt_free - 1 < room:
        return None
    if not busy:
        return chosen
    return next(w for w in ranked if queued.get(w, 0) <= 0)


def fleet_size(workers: Mapping[str, WorkerState], model: str) -> int:
    """The routable workers serving ``model`` (the room's bound is one less)."""
    return sum(1 for s in workers.values() if s.model == model and s.routable)


def decide_in_room(
    d: Decision,
    workers: Mapping[str, WorkerState],
    overlaps: Mapping[str, int],
    prompt_tokens: int,
    protected: bool,
    room: int,
) -> Decision | None:
    """:func:`place` on a policy's decision that names a worker: the decision (the policy's
    own, or moved to another of its eligible candidates: ``d.scores``' workers), or None
    (held). The prompt-free count is over those candidates (the workers that can take the
    request now). The same object whenever the policy's choice stands."""
    chosen = d.worker_id
    assert chosen is not None
    if protected:
        if workers[chosen].pending_prefill_tokens <= 0:
            return d  # the policy's choice computes no prompt: it stands
    elif room <= 0:
        return d  # work-conserving: the policy's decision, untouched
    cands = d.scores or {chosen: 0.0}
    queued = {w: workers[w].pending_prefill_tokens for w in cands if w in workers}
    queued.setdefault(chosen, workers[chosen].pending_prefill_tokens)
    free = sum(1 for q in queued.values() if q <= 0)
    if not protected and free - 1 < room:  # it would be held: unless r is the whole fleet
        room = min(room, fleet_size(workers, workers[chosen].model) - 1)
    ranked = sorted(queued, key=lambda w: cands.get(w, 0.0))
    w = place(chosen, ranked, queued, protected, room, free)
    if w is None or w == chosen:
        return None if w is None else d
    ov = overlaps.get(w, 0)
    return msgspec.structs.replace(
        d,
        worker_id=w,
        reason="prefill room: an eligible worker computing no prompt",
        overlap_blocks=ov,
        cached_tokens=min(ov * workers[w].capacity.block_size, prompt_tokens),
        lost_reason="prefill room"
        if d.lost_reason == "" and ov < d.overlap_blocks
        else d.lost_reason,
        replicate_to=tuple(r for r in d.replicate_to if r != w),
        after=None,
        hold_s=0.0,
    )
