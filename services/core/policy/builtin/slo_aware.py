"""``slo_aware``: minimise the predicted TTFT plus the prefill stall this request imposes
on the requests decoding on the worker, among the workers predicted to meet its TTFT and TPOT
SLOs.

For each candidate worker the per-worker latency model (:mod:`services.core.latency`) predicts,
from the worker's queue (prompt tokens still to compute there, sequences decoding, the KV they
read: decoding x the running mean context of recent requests) and this request's uncached
tokens and expected output (``max_tokens``): ``ttft``, ``tpot`` and ``prefill``, this prompt's
own compute time there, which every request decoding there waits too (its chunks share their
engine steps). The cost, in seconds, is

    cost(w) = ttft(w)                                     # this request's time to first token
            + imposed_weight x decoding(w) x prefill(w)   # the stall it imposes on w's decoders
            + compute_weight x prefill(w)                 # its compute, for whoever queues behind

``imposed_weight`` (0.5) trades this request's TTFT against the inter-token gaps of the
requests already decoding (1: the stall counts like the TTFT it saves, so prefills go where
few decode; 0: TTFT alone); ``compute_weight`` 1 counts a cold prefill's compute once more
(the requests that queue behind it, and the later hits a copy of a prefix splits).
The decode phase (this request's TPOT, the per-step slowdown its decode adds to the others)
enters through the SLO only: in the cost it drove conversations off the worker that holds their
context for a transient difference in decoders (``docs/benchmarks.md``, Routing v2).

Among the workers predicted to meet the
request's targets (``ttft <= slo_ttft`` and ``tpot <= slo_tpot``; per request from the
``x-slo-ttft-ms`` / ``x-slo-tpot-ms`` headers, else this policy's defaults) the lowest cost wins
(``feasible_pick: "headroom"``: the one with the most headroom, ``min(1 - ttft/slo_ttft,
1 - tpot/slo_tpot)``); when none meets them, the lowest cost overall wins, or, with ``shed``,
the request is refused (the router answers 429).

Everything else is ``kv_aware``'s machinery, reused as is and each switchable for the ablation:
the queued prefill is what its prefill clock counts (the uncached tokens of what this policy
sent there without a first token yet, plus other routers' queued tokens), *in full*: the clock
can also discount them by the time elapsed at one learned speed (``kv_aware`` does), but long
prompts then looked done while still computing and more piled on behind them (Mooncake trace,
default engine, seeds 2-4: TTFT p99 25-41 s against 8-9 s in full); matches include
routed-prefix memory (``routed_ttl``), followers of a
prefix still being computed are held (``hold_followers``), and hot prefixes are replicated
(``replicate``) or spread by its demand rules (``decode_weight`` orders the replicas' targets
there, as in ``kv_aware``). ``kv_aware``'s cost terms (``uncached_weight``,
``kv_pressure_weight``, ``stall_tpot_weight``, ``conversation_weight`` and its window) have no
place in this cost: a spec naming one is
refused (:attr:`SloAware.NOT_TAKEN`).

Calibration: one :class:`~services.core.latency.LatencyModel` per worker, starting from the
engine model's default step times (``prior``), fitted from the prefill clock's samples (batches
of at least ``progress_min_tokens`` computed tokens)
(computed tokens, seconds to first token, decoders riding along) on the decision path, live
and in the simulator alike. Only the per-token prefill cost is fitted from those (a duration
cannot tell the step terms apart); the step terms from each streamed answer's mean
inter-token gap (:meth:`SloAware.observe_decode`, which the live router and the simulator call
through ``RequestLifecycle.decoded``).

Invariant: like ``kv_aware``, state lives in :class:`PolicyState` (``extra["slo_*"]`` beside
``kv_aware``'s) and the same inputs give the same decisions.
"""

from __future__ import annotations

from collections.abc import Callable

from services.core.latency import LatencyModel, StepCoefficients, WorkerLoad, predict_fast
from services.core.policy.base import PolicyState, register
from services.core.policy.builtin import slo_fast
from services.core.policy.builtin.kv_aware import KvAware
from services.core.policy.types import ClusterSnapshot, RequestInfo, WorkerState, drop_departed

CTX_DECAY = 0.02  # weight of each request in the running mean context
INFEASIBLE = 1e6  # added to the cost of a worker predicted to miss the SLO (seconds)


# kv_aware's cost terms, which this policy's cost (its latency model's) replaces
NOT_TAKEN = {
    "uncached_weight": "kv_aware's weight of the uncached prompt tokens; slo_aware prices "
    "them as the latency model's prefill time (compute_weight, imposed_weight)",
    "kv_pressure_weight": "kv_aware's KV-usage term; slo_aware's cost has none",
    "stall_tpot_weight": "kv_aware's price of the TPOT a prefill stall adds; slo_aware "
    "prices the stall with imposed_weight and holds TPOT to slo_tpot_ms",
    "conversation_weight": "kv_aware's price, in prefill tokens, of a worker's recent work for "
    "a request that starts a prefix; slo_aware's cost is in seconds and has no such term",
    "conversation_window_s": "the window of kv_aware's conversation_weight, which slo_aware "
    "does not take",
}


def _ms(desc: str, default: float) -> dict:
    return {"type": "number", "exclusiveMinimum": 0, "default": default, "description": desc}


@register
class SloAware(KvAware):
    name = "slo_aware"
    description = (
        "minimise predicted TTFT + the prefill stall imposed on decoding requests, subject to "
        "per-request TTFT / TPOT SLOs"
    )
    NOT_TAKEN = NOT_TAKEN
    PARAMS = {
        **{k: v for k, v in KvAware.PARAMS.items() if k not in NOT_TAKEN},
        "slo_ttft_ms": _ms("default TTFT target (header x-slo-ttft-ms overrides)", 2000.0),
        "slo_tpot_ms": _ms("default TPOT target (header x-slo-tpot-ms overrides)", 50.0),
        "imposed_weight": {
            "type": "number",
            "minimum": 0,
            "default": 0.5,
            "description": "weight of the prefill stall this request imposes on each request "
            "decoding on the worker, against its own TTFT (1: equal; 0: TTFT only)",
        },
        "compute_weight": {
            "type": "number",
            "minimum": 0,
            "default": 1.0,
            "description": "weight of this request's own prefill compute time, charged for the "
            "requests that will queue behind it on the worker (and the hits a copy of a prefix "
            "splits)",
        },
        "feasible_pick": {
            "type": "string",
            "enum": ["cost", "headroom"],
            "default": "cost",
            "description": "among workers predicted to meet the SLO: lowest cost, or most headroom",
        },
        "shed": {
            "type": "boolean",
            "default": False,
            "description": "refuse (429) a request no worker is predicted to serve within its "
            "SLO, instead of sending it to the best worker",
        },
        "step_budget": {
            "type": "integer",
            "minimum": 1,
            "default": 8192,
            "description": "tokens an engine computes per step (its max_num_batched_tokens)",
        },
        "prior": {
            "type": "object",
            "default": {},
            "description": "step-time coefficients before any observation (seconds): "
            "overhead_s, prefill_token_s, prefill_attn_s, decode_seq_s, decode_kv_token_s; "
            "missing ones are the engine model's defaults",
            "properties": {
                k: {"type": "number", "minimum": 0}
                for k in (
                    "overhead_s",
                    "prefill_token_s",
                    "prefill_attn_s",
                    "decode_seq_s",
                    "decode_kv_token_s",
                )
            },
            "additionalProperties": False,
        },
    }

    def __init__(self, params: dict) -> None:
        super().__init__(params)
        base = StepCoefficients.from_engine()
        self.prior = StepCoefficients(**{**_as_dict(base), **params["prior"]})

    INFEASIBLE = INFEASIBLE

    def lost_reason(self, holder: str, chosen: str, costs: dict[str, float]) -> str:
        """``slo`` when ``holder`` was predicted to miss the request's SLO and ``chosen`` to
        meet it (the infeasible carry :data:`INFEASIBLE` on top of their cost)."""
        if costs[holder] - costs[chosen] >= INFEASIBLE / 2:
            return "slo"
        return super().lost_reason(holder, chosen, costs)

    def fast_costs(
        self,
        req: RequestInfo,
        snapshot: ClusterSnapshot,
        overlaps: dict[str, int],
        state: PolicyState,
        filtered: dict[str, str],
    ) -> dict[str, float] | None:
        """Large fleets: :func:`services.core.policy.builtin.slo_fast.fast_costs`."""
        if type(self).costs is not SloAware.costs:
            return None
        return slo_fast.fast_costs(self, req, snapshot, overlaps, state, filtered)

    def model(self, state: PolicyState, wid: str) -> LatencyModel:
        models: dict[str, LatencyModel] = state.extra.setdefault("slo_models", {})
        m = models.get(wid)
        if m is None:
            m = models[wid] = LatencyModel(prior=self.prior)
        return m

    def prune(self, state: PolicyState, live: dict[str, WorkerState]) -> None:
        """Workers left: :meth:`KvAware.prune`'s, and their latency models (the coefficients'
        floor stays a lower bound: the minimum over more models than remain)."""
        super().prune(state, live)
        drop_departed(state.extra.get("slo_models", {}), live)

    def observe_decode(
        self, worker_id: str, gap_s: float, decoding: int, state: PolicyState
    ) -> None:
        """One inter-token observation for ``worker_id``'s model: ``decoding`` sequences each
        reading the running mean context (``slo_ctx``), no prefill."""
        models = state.extra.get("slo_models")
        model = models.get(worker_id) if models else None
        if model is not None:
            ctx = state.extra.get("slo_ctx") or 0.0
            model.observe_step(gap_s, decoding, decoding * ctx)
            self._recalibrated(state, worker_id, model.theta)

    def _recalibrated(self, state: PolicyState, wid: str, theta: list[float]) -> None:
        """``wid``'s coefficients changed: the large-fleet view's bounds for it are due, and
        the fleet-wide floor of the coefficients follows (it only ever lowers here)."""
        fv = state.extra.get("kv_aware_fleet")
        if fv is not None:
            fv.dirty.add(wid)
        floor = state.extra.get("slo_floor")
        if floor is not None:
            floor[0] = [a if a < b else b for a, b in zip(floor[0], theta, strict=True)]
            floor[1] += 1

    def theta_floor(self, state: PolicyState) -> list[float]:
        """Per coefficient, a lower bound over every worker's model (and the prior, which
        unseen workers start from): the minimum, recomputed once the updates since the last
        recomputation outnumber the models (amortised O(1) per update)."""
        models: dict[str, LatencyModel] = state.extra.get("slo_models") or {}
        floor = state.extra.get("slo_floor")
        if floor is None or floor[2] is not self.prior or floor[1] > 64 + len(models):
            mins = self.prior.as_list()
            for m in models.values():
                mins = [a if a < b else b for a, b in zip(mins, m.theta, strict=True)]
            floor = state.extra["slo_floor"] = [mins, 0, self.prior]
        return floor[0]

    def _decoding(self, w: WorkerState, state: PolicyState) -> int:
        fifo = self._clock(state).fifo.get(w.worker_id)
        return max(0, w.inflight - (len(fifo) if fifo else 0))

    def _calibrate(
        self, req: RequestInfo, state: PolicyState, worker: Callable[[str], WorkerState | None]
    ) -> tuple[float, float]:
        """The part of a decision before the costs: the running mean context, the models
        calibrated from the first tokens seen since the last decision (``worker``: a
        candidate by id, or None), and this request's (TTFT, TPOT) targets in seconds."""
        # KV tokens a decoding sequence reads per step: the mean context of recent requests
        # (the engines' used blocks count cached prefixes too, which no decode reads)
        ctx = req.prompt_tokens + req.max_tokens / 2.0
        prev = state.extra.get("slo_ctx")
        state.extra["slo_ctx"] = ctx if prev is None else prev + CTX_DECAY * (ctx - prev)
        clock = self._clock(state)
        if clock.samples is None:
            clock.samples = []  # the clock hands this policy its samples
            # the queue counts in full until each first token: discounted by the time elapsed
            # at one learned speed (kv_aware's prefill clock), long prompts looked done while
            # still computing and more piled on (Mooncake: TTFT p99 25-41 s against 8 s)
            clock.discount = False
        if clock.samples:  # first tokens seen since the last decision calibrate the models
            for wid, tokens, dur in clock.samples:
                w = worker(wid)
                d = self._decoding(w, state) if w is not None else 0
                kv = d * state.extra["slo_ctx"]
                load = WorkerLoad(0.0, d, kv, self.p["step_budget"])
                m = self.model(state, wid)
                m.observe_prefill(tokens, dur, load)
                self._recalibrated(state, wid, m.theta)
            clock.samples.clear()
        p = self.p
        ttft_slo = req.slo_ttft_s if req.slo_ttft_s is not None else p["slo_ttft_ms"] / 1000.0
        tpot_slo = req.slo_tpot_s if req.slo_tpot_s is not None else p["slo_tpot_ms"] / 1000.0
        return ttft_slo, tpot_slo

    def shed_for(self, ttft_slo: float, tpot_slo: float, state: PolicyState) -> None:
        """Refuse this request (nobody is predicted to meet its targets): no dispatch."""
        state.shed = (
            f"no worker predicted to meet the SLO (TTFT {ttft_slo * 1000:.0f} ms, "
            f"TPOT {tpot_slo * 1000:.0f} ms)"
        )
        for k in ("kv_aware_last", "kv_aware_leaders", "kv_aware_dispatch"):
            state.extra.pop(k, None)

    def costs(
        self,
        req: RequestInfo,
        cands: list[WorkerState],
        overlaps: dict[str, int],
        state: PolicyState,
    ) -> dict[str, float]:
        ttft_slo, tpot_slo = self._calibrate(req, state, _lookup(cands))
        p = self.p
        clock = self._clock(state)
        # per worker, the SLO headroom min(1 - ttft/slo_ttft, 1 - tpot/slo_tpot) (>= 0: meets
        # both), filled by _worker_cost
        headroom: dict[str, float] = {}
        state.extra["slo_x"] = (
            clock.fifo,
            state.extra.setdefault("slo_models", {}),
            state.extra["slo_ctx"],
            req.max_tokens,
            p["imposed_weight"],
            p["compute_weight"],
            1.0 / ttft_slo,
            1.0 / tpot_slo,
            headroom,
        )
        # kv_aware's loop (queue accounting, tie-break by queue age) with this policy's
        # _worker_cost: the latency model's prediction, the one place the cost is written
        out = KvAware.costs(self, req, cands, overlaps, state)
        missed = [wid for wid, h in headroom.items() if h < 0.0]
        if len(missed) == len(out):  # nobody meets the SLO: the best overall, or shed
            if p["shed"]:
                self.shed_for(ttft_slo, tpot_slo, state)
            return out
        if p["feasible_pick"] == "headroom":
            out = {wid: -h for wid, h in headroom.items()}
        for wid in missed:
            out[wid] += INFEASIBLE
        return out

    def _worker_cost(
        self,
        req: RequestInfo,
        w: WorkerState,
        queued: float,
        uncached: int,
        state: PolicyState,
    ) -> float:
        """THE cost (module docstring): the latency model's predicted TTFT
        (:func:`services.core.latency.predict_fast`) + the prefill stall imposed on ``w``'s
        decoding requests + this prompt's compute; records the SLO headroom."""
        wid = w.worker_id
        # per decision: prefill FIFOs, models, mean context, output, weights, 1 / SLOs,
        # headroom (filled here)
        fifos, models, ctx, out, iw, cw, inv_ttft, inv_tpot, headroom = state.extra["slo_x"]
        fifo = fifos.get(wid)
        d = w.inflight - len(fifo) if fifo else w.inflight
        if d < 0:
            d = 0
        m = models.get(wid)
        if m is None:
            m = self.model(state, wid)
        ttft, tpot, _, prefill_s = predict_fast(
            m.theta, queued, d, d * ctx, self.p["step_budget"], uncached, req.prompt_tokens, out
        )
        h = 1.0 - ttft * inv_ttft
        h2 = 1.0 - tpot * inv_tpot
        headroom[wid] = h if h < h2 else h2
        return ttft + (iw * d + cw) * prefill_s


def _lookup(cands: list[WorkerState]) -> Callable[[str], WorkerState | None]:
    """A candidate by id, its dict built on first use (most decisions have no sample to
    calibrate from: no pass over the candidates then)."""
    by_id: dict[str, WorkerState] | None = None

    def worker(wid: str) -> WorkerState | None:
        nonlocal by_id
        if by_id is None:
            by_id = {w.worker_id: w for w in cands}
        return by_id.get(wid)

    return worker


def _as_dict(c: StepCoefficients) -> dict[str, float]:
    return {
        "overhead_s": c.overhead_s,
        "prefill_token_s": c.prefill_token_s,
        "prefill_attn_s": c.prefill_attn_s,
        "decode_seq_s": c.decode_seq_s,
        "decode_kv_token_s": c.decode_kv_token_s,
    }
