"""The two pools a P/D policy chooses from, filtered like a colocated policy's candidates.

- decoders: role ``decode`` or ``both``, routable, serving the model, able to hold the whole
  request (prompt + ``max_tokens``) ever and now (:func:`services.core.policy.filters.fit_now`);
- prefillers: role ``prefill`` or ``both``, the same filters for the prompt + 1 token (a
  disaggregated prefill generates one token, vLLM's ``max_tokens`` 1).

No decoder serves the model -> no pick; none could ever hold it -> ``never_fits``; none can take
it now -> ``wait`` (the router queues it). An empty prefill pool is not an error: the decoder
prefills itself (or a peer rule waits, as its source does). Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from services.core.policy import filters
from services.core.policy.types import ClusterSnapshot, Decision, RequestInfo, WorkerState

DECODE_ROLES: tuple[str, ...] = ("decode", "both")
PREFILL_ROLES: tuple[str, ...] = ("prefill", "both")


@dataclass(slots=True)
class Pools:
    decoders: list[WorkerState] = field(default_factory=list)
    prefillers: list[WorkerState] = field(default_factory=list)
    filtered: dict[str, str] = field(default_factory=dict)
    none: Decision | None = None  # set when no decoder can take the request (why)


def pools(
    req: RequestInfo,
    snapshot: ClusterSnapshot,
    overlaps: dict[str, int],
    max_inflight: int | None,
) -> Pools:
    out = Pools()
    workers = snapshot.workers.values()
    serving = filters.routable_for_model(workers, req.model, out.filtered, DECODE_ROLES)
    if not serving:
        out.none = Decision(
            None,
            reason=f"no routable decode worker serves model {req.model!r}",
            filtered=out.filtered,
        )
        return out
    possible, out.decoders = filters.fit_now(serving, req, overlaps, max_inflight, out.filtered)
    if not possible:
        out.none = Decision(
            None,
            reason="request can never fit",
            never_fits=filters.never_fits_message(serving, req),
            filtered=out.filtered,
        )
        return out
    if not out.decoders:
        out.none = Decision(
            None, reason="all decode workers at capacity", wait=True, filtered=out.filtered
        )
        return out
    pf: dict[str, str] = {}
    pserving = filters.routable_for_model(workers, req.model, pf, PREFILL_ROLES)
    one = msgspec.structs.replace(req, max_tokens=1)
    _, out.prefillers = filters.fit_now(pserving, one, overlaps, max_inflight, pf)
    for wid, why in pf.items():  # a prefill engine's verdict is the prefill pool's
        w = snapshot.workers.get(wid)
        if w is not None and w.role == "prefill":
            out.filtered[wid] = why
    return out


def pd_decision(
    req: RequestInfo,
    decoder: WorkerState,
    prefiller: WorkerState | None,
    overlaps: dict[str, int],
    filtered: dict[str, str],
    scores: dict[str, float],
    reason: str,
    transfer_s: float = 0.0,
) -> Decision:
    """The decision for the pair (``prefiller`` None: the decoder prefills itself)."""
    ov = overlaps.get(decoder.worker_id, 0)
    cached = min(ov * decoder.capacity.block_size, req.prompt_tokens)
    pcached = 0
    if prefiller is not None:
        pov = overlaps.get(prefiller.worker_id, 0)
        pcached = min(pov * prefiller.capacity.block_size, req.prompt_tokens)
    return Decision(
        decoder.worker_id,
        scores=scores,
        reason=reason,
        filtered=filtered,
        overlap_blocks=ov,
        cached_tokens=cached,
        prefill_worker=prefiller.worker_id if prefiller is not None else None,
        transfer_s=transfer_s if prefiller is not None else 0.0,
        prefill_cached_tokens=pcached,
    )
