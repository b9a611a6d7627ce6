"""``pd_slo``: kvgate's P/D policy. One decision picks the (prefill, decode) pair from the latency
model (:mod:`services.core.latency`), including "no prefill worker": the decoder prefills the
prompt itself (conditional disaggregation), when that is predicted better, not by a token
threshold.

Per decoder ``D`` (role ``decode`` or ``both``; it can hold prompt + ``max_tokens`` now), with
``n`` requests in flight there, ``q`` prompt tokens still queued there (local prefills), ``ctx``
the running mean context of recent requests and ``o`` = ``max_tokens``:

    tpot(D)   = overhead + decode_seq x (n+1) + decode_kv x (n x ctx + prompt + o/2)
              + prefill_token x q / o            # queued local prefills stall its decode steps

and two ways to get its first token:

- **local** (no transfer): ``ttft_L`` = the model's TTFT on ``D`` for the prompt's part ``D``
  does not hold, behind ``q`` (:func:`~services.core.latency.predict_fast`); its prefill takes
  ``prefill_L`` seconds of steps the ``n`` requests decoding there share (their ITL spikes);
- **remote** via the best prefiller ``P`` (role ``prefill`` / ``both``): ``ttft_R`` = the
  model's TTFT on ``P`` (its queue, the part ``P`` does not hold) + the KV transfer of the part
  ``D`` does not hold (:func:`~services.core.pd.transfer.transfer_seconds`: model shape and link
  profile) + one decode step on ``D``. ``P`` is the prefiller of the lowest
  ``ttft_P + compute_weight x prefill_P`` (queue, prefix overlap, its own compute for whoever
  queues behind it); the transfer depends on the decoder only, so the best pair is the best
  prefiller with the best decoder for it.

The cost of an option is what this request adds to everyone's latency:

    cost = ttft + o x tpot(D)                                   # this request
         + imposed_weight x n x (prefill_L if local else 0)     # the stall of D's decoders
         + imposed_weight x n x o x own_step                    # its decode slows theirs
         + compute_weight x (prefill seconds on the engine that computes it)

The SLO binds the requests already decoding on ``D`` too: the local option is infeasible when
``D``'s queued prefill plus this one, spread over an answer (the shorter of ``o`` and the
running mean ``max_tokens``), would push their TPOT past the target (with anyone decoding
there).

Among options predicted to meet the request's TTFT and TPOT targets (``x-slo-ttft-ms`` /
``x-slo-tpot-ms`` or this policy's defaults) the cheapest wins; when none does, the cheapest
overall (or, with ``shed``, a 429). A short uncached part or a decoder that holds most of the
prompt makes ``prefill_L`` small, so the local option wins; a busy decoder (large ``n``) or a
long uncached part sends the prefill away: the same model decides both.

Calibration: one :class:`~services.core.latency.LatencyModel` per worker, from the prior
(``prior``, the engine model's defaults); each first token of a prefill this policy placed
(:meth:`observe_prefill`, from ``RequestLifecycle.prefilled``) fits that worker's per-token
prefill cost, the term that differs most between deployments (a TTFT alone cannot tell the
step terms apart). The step terms stay at ``prior``: fitting them from streamed answers' mean
gaps (as ``slo_aware`` does) let a few decoders' prefill stalls inflate their per-sequence cost
tenfold, so every decoder looked unable to meet the TPOT target and the policy sent prompts to
prefillers predicted 10-20 s late (simulator, conversations, 2P6D). Pure; state in
``PolicyState.extra``.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from services.core.latency import (
    PREFILL_TOKEN,
    LatencyModel,
    StepCoefficients,
    WorkerLoad,
    predict_fast,
    ttft_features,
)
from services.core.pd.pools import pd_decision, pools
from services.core.pd.transfer import LINK_PROFILES, ModelShape, transfer_seconds
from services.core.policy.base import PolicyImpl, PolicyState, register
from services.core.policy.pickers import pick_min
from services.core.policy.types import (
    ClusterSnapshot,
    Decision,
    RequestInfo,
    WorkerState,
    drop_departed,
)

CTX_DECAY = 0.02  # weight of each request in the running mean context
INFEASIBLE = 1e6  # added to the cost of an option predicted to miss the SLO (seconds)
MAX_PENDING = 20_000  # prefills awaiting their first token's observation (oldest dropped)
COEFS = ("overhead_s", "prefill_token_s", "prefill_attn_s", "decode_seq_s", "decode_kv_token_s")


def _ms(desc: str, default: float) -> dict:
    return {"type": "number", "exclusiveMinimum": 0, "default": default, "description": desc}


def _weight(desc: str, default: float) -> dict:
    return {"type": "number", "minimum": 0, "default": default, "description": desc}


@register
class PdSlo(PolicyImpl):
    name = "pd_slo"
    description = (
        "P/D: one latency-model decision over (prefill, decode) pairs, local prefill on the "
        "decoder included (conditional disaggregation by predicted TTFT and stall)"
    )
    disaggregated = True
    PARAMS = {
        "slo_ttft_ms": _ms("default TTFT target (header x-slo-ttft-ms overrides)", 2000.0),
        "slo_tpot_ms": _ms("default TPOT target (header x-slo-tpot-ms overrides)", 50.0),
        "imposed_weight": _weight(
            "weight of the delay this request imposes on the requests decoding on its decoder "
            "(1: a second of theirs counts like a second of its own)",
            1.0,
        ),
        "compute_weight": _weight(
            "weight of this request's own prefill compute, for the requests that queue behind "
            "it on the engine that computes it",
            1.0,
        ),
        "shed": {
            "type": "boolean",
            "default": False,
            "description": "refuse (429) a request no option is predicted to serve within its "
            "SLO, instead of taking the cheapest",
        },
        "step_budget": {
            "type": "integer",
            "minimum": 1,
            "default": 8192,
            "description": "tokens an engine computes per step (its max_num_batched_tokens)",
        },
        "link": {
            "type": "string",
            "enum": sorted(LINK_PROFILES),
            "default": "rdma",
            "description": "KV transfer path between prefill and decode engines",
        },
        "model_shape": {
            "type": "object",
            "default": {},
            "description": "what sizes the KV cache (default: Llama-3-8B): layers, kv_heads, "
            "head_dim, dtype_bytes",
            "properties": {
                k: {"type": "integer", "minimum": 1}
                for k in ("layers", "kv_heads", "head_dim", "dtype_bytes")
            },
            "additionalProperties": False,
        },
        "prior": {
            "type": "object",
            "default": {},
            "description": "step-time coefficients before any observation (seconds): "
            + ", ".join(COEFS)
            + "; missing ones are the engine model's defaults",
            "properties": {k: {"type": "number", "minimum": 0} for k in COEFS},
            "additionalProperties": False,
        },
    }

    def __init__(self, params: dict) -> None:
        super().__init__(params)
        merged = dict(zip(COEFS, StepCoefficients.from_engine().as_list(), strict=True))
        merged.update(params["prior"])
        self.prior = StepCoefficients(**merged)
        self.shape = ModelShape(**params["model_shape"])
        self.link = LINK_PROFILES[params["link"]]

    # ------------------------------------------------------------------ models
    def model(self, state: PolicyState, wid: str) -> LatencyModel:
        models: dict[str, LatencyModel] = state.extra.setdefault("pd_models", {})
        m = models.get(wid)
        if m is None:
            m = models[wid] = LatencyModel(prior=self.prior)
        return m

    def observe_prefill(
        self, request_id: str, worker_id: str, ttft_s: float, state: PolicyState
    ) -> None:
        """A prefill this policy placed had its first token ``ttft_s`` after dispatch: fit
        that worker's per-token prefill cost with the load it was sent with (the queue ahead
        of it and its own uncached tokens; the step terms keep their values: a duration alone
        cannot tell them apart)."""
        sent = state.extra.get("pd_sent")
        rec = sent.pop(request_id, None) if sent else None
        if rec is None or rec[0] != worker_id:
            return
        _, load, uncached, prompt = rec
        m = self.model(state, worker_id)
        m.observe(ttft_features(load, uncached, prompt), ttft_s, only=(PREFILL_TOKEN,))

    def prune(self, state: PolicyState, live: dict[str, WorkerState]) -> None:
        drop_departed(state.extra.get("pd_models", {}), live)

    # ------------------------------------------------------------------ the decision
    def decide_pd(
        self,
        req: RequestInfo,
        snapshot: ClusterSnapshot,
        overlaps: dict[str, int],
        state: PolicyState,
    ) -> Decision:
        pl = pools(req, snapshot, overlaps, self.max_inflight)
        if pl.none is not None:
            return pl.none
        p = self.p
        prompt, out = req.prompt_tokens, max(1, req.max_tokens)
        c = prompt + out / 2.0
        prev = state.extra.get("pd_ctx")
        ctx = state.extra["pd_ctx"] = c if prev is None else prev + CTX_DECAY * (c - prev)
        prev = state.extra.get("pd_out")
        mean_out = state.extra["pd_out"] = out if prev is None else prev + CTX_DECAY * (out - prev)
        spread = min(out, mean_out)  # the answer a decoding neighbour spreads a stall over
        ttft_slo = req.slo_ttft_s if req.slo_ttft_s is not None else p["slo_ttft_ms"] / 1000.0
        tpot_slo = req.slo_tpot_s if req.slo_tpot_s is not None else p["slo_tpot_ms"] / 1000.0
        budget, iw, cw = p["step_budget"], p["imposed_weight"], p["compute_weight"]

        # the prefiller: lowest TTFT + its compute there (the transfer depends on the decoder)
        best_p: WorkerState | None = None
        p_ttft = p_cost = p_load = 0.0
        p_uncached = 0
        if pl.prefillers:
            pcosts: dict[str, float] = {}
            info: dict[str, tuple[float, WorkerLoad, int]] = {}
            for w in pl.prefillers:
                cached = min(overlaps.get(w.worker_id, 0) * w.capacity.block_size, prompt - 1)
                unc = prompt - max(0, cached)
                n = 0 if w.role == "prefill" else w.inflight
                load = WorkerLoad(w.pending_prefill_tokens, n, n * ctx, budget)
                ttft, _, _, pre = predict_fast(
                    self.model(state, w.worker_id).theta,
                    load.queued_tokens,
                    n,
                    n * ctx,
                    budget,
                    unc,
                    prompt,
                    1,
                )
                pcosts[w.worker_id] = ttft + cw * pre
                info[w.worker_id] = (ttft, load, unc)
            pid = pick_min(pcosts, state.rng)
            best_p = snapshot.workers[pid]
            p_ttft, p_load, p_uncached = info[pid]
            p_cost = pcosts[pid]

        costs: dict[str, float] = {}
        choice: dict[str, tuple[bool, float, WorkerLoad, int]] = {}
        for w in pl.decoders:
            wid = w.worker_id
            ov_s, pt, pa, ds, dk = self.model(state, wid).theta
            n = w.inflight
            q = w.pending_prefill_tokens
            cached = min(overlaps.get(wid, 0) * w.capacity.block_size, prompt - 1)
            unc = prompt - max(0, cached)
            kv = n * ctx
            own = ds + dk * (prompt + out / 2.0)
            base = ov_s + ds * n + dk * kv
            tpot = base + own + pt * q / out
            shared = out * tpot + iw * n * out * own
            # local: the decoder prefills the part it lacks, behind its own queue
            load = WorkerLoad(q, n, kv, budget)
            ttft_l, _, _, pre_l = predict_fast(
                [ov_s, pt, pa, ds, dk], q, n, kv, budget, unc, prompt, out
            )
            cost_l = ttft_l + shared + (iw * n + cw) * pre_l
            # the requests decoding on D wait out this prefill too: spread over an answer's
            # steps it must keep their TPOT within the target as well
            neighbours = base + own + (pt * q + pre_l) / spread
            if ttft_l > ttft_slo or tpot > tpot_slo or (n > 0 and neighbours > tpot_slo):
                cost_l += INFEASIBLE
            if not w.prefills_alone:  # an SGLang decoder: the local option cannot run
                if best_p is None or best_p.worker_id == wid:
                    continue
                cost_l = math.inf
            best = (cost_l, False, ttft_l, load, unc)
            if best_p is not None and best_p.worker_id != wid:
                xfer = transfer_seconds(unc, self.shape, self.link)
                ttft_r = p_ttft + xfer + base + own + pt
                cost_r = ttft_r + shared + (p_cost - p_ttft)
                if ttft_r > ttft_slo or tpot > tpot_slo:
                    cost_r += INFEASIBLE
                if cost_r < cost_l:
                    best = (cost_r, True, xfer, load, unc)
            costs[wid] = best[0]
            choice[wid] = best[1:]
        if not costs:  # only decoders that need a prefill worker, and none is routable
            return Decision(
                None,
                reason="no routable prefill worker for decoders that cannot prefill alone",
                filtered=pl.filtered,
                wait=True,
            )
        if p["shed"] and min(costs.values()) >= INFEASIBLE:
            return Decision(
                None,
                scores=costs,
                reason=f"no P/D pair predicted to meet the SLO (TTFT {ttft_slo * 1000:.0f} ms, "
                f"TPOT {tpot_slo * 1000:.0f} ms)",
                filtered=pl.filtered,
                shed=True,
            )
        did = pick_min(costs, state.rng)
        d = snapshot.workers[did]
        remote, x, load, unc = choice[did]
        sent: OrderedDict = state.extra.setdefault("pd_sent", OrderedDict())
        if remote:
            assert best_p is not None
            sent[req.request_id] = (best_p.worker_id, p_load, p_uncached, prompt)
            dec = pd_decision(req, d, best_p, overlaps, pl.filtered, costs, "remote prefill", x)
        else:
            sent[req.request_id] = (did, load, unc, prompt)
            dec = pd_decision(req, d, None, overlaps, pl.filtered, costs, "local prefill")
        while len(sent) > MAX_PENDING:
            sent.popitem(last=False)
        return dec
