"""Scorers: one number per (request, worker); lower is better. Policies weigh and add them.

Each scorer is ``f(req, w, overlap_blocks, cap) -> float``, registered in :data:`SCORERS` by
name so the ``weighted`` policy can combine any of them from configuration. Ranges are noted;
most are normalised to about 0..1 so weights are comparable.
"""

from __future__ import annotations

from collections.abc import Callable

import xxhash

from services.core.policy.types import RequestInfo, WorkerState

Scorer = Callable[[RequestInfo, WorkerState, int, int], float]


def cached_tokens(req: RequestInfo, w: WorkerState, overlap: int) -> int:
    return min(overlap * w.capacity.block_size, req.prompt_tokens)


def prefix(req: RequestInfo, w: WorkerState, overlap: int, cap: int) -> float:
    """-(fraction of the prompt the worker has cached): -1..0."""
    if req.prompt_tokens <= 0:
        return 0.0
    return -cached_tokens(req, w, overlap) / req.prompt_tokens


def inflight(req: RequestInfo, w: WorkerState, overlap: int, cap: int) -> float:
    """In-flight requests (global) over the cap: 0..1."""
    return w.inflight / cap if cap else 0.0


def queue(req: RequestInfo, w: WorkerState, overlap: int, cap: int) -> float:
    """Engine queue depth (telemetry ``waiting``) over max_num_seqs."""
    return (w.waiting or 0) / w.capacity.max_num_seqs


def kv_usage(req: RequestInfo, w: WorkerState, overlap: int, cap: int) -> float:
    """KV cache usage 0..1 (free-block estimate when known, else telemetry usage, else 0)."""
    if w.kv_blocks_free is not None:
        return 1.0 - min(w.kv_blocks_free, w.capacity.num_gpu_blocks) / w.capacity.num_gpu_blocks
    return w.kv_usage or 0.0


def gpu(req: RequestInfo, w: WorkerState, overlap: int, cap: int) -> float:
    """Mean of the known GPU pressures (SM util, memory used, memory bandwidth) 0..1; a worker
    with stale or missing telemetry scores a neutral 0.5."""
    if w.telemetry_stale:
        return 0.5
    vals = [v for v in (w.gpu_sm_util, w.gpu_mem_used, w.gpu_bw_util) if v is not None]
    return sum(vals) / len(vals) if vals else 0.5


def ttft(req: RequestInfo, w: WorkerState, overlap: int, cap: int) -> float:
    """Estimated prefill work ahead of and for this request, in thousands of tokens."""
    return (w.pending_prefill_tokens + req.prompt_tokens - cached_tokens(req, w, overlap)) / 1000.0


def session(req: RequestInfo, w: WorkerState, overlap: int, cap: int) -> float:
    """Session affinity by rendezvous hashing: 0..1, lowest for the session's home worker(s).
    Stateless, so every router replica agrees; 0 for requests without a session."""
    if not req.session_id:
        return 0.0
    h = xxhash.xxh3_64_intdigest(f"{req.session_id}\0{w.worker_id}".encode())
    return 1.0 - h / 0xFFFFFFFFFFFFFFFF


SCORERS: dict[str, Scorer] = {
    "prefix": prefix,
    "inflight": inflight,
    "queue": queue,
    "kv_usage": kv_usage,
    "gpu": gpu,
    "ttft": ttft,
    "session": session,
}
