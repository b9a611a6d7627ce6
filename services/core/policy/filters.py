"""Filters: which workers may take a request. Each records why it excluded a worker.

- :func:`routable_for_model`: healthy, not cordoned / draining, circuit closed, serves the model
  as its base model or as one of its LoRA adapters (an empty request model matches every
  worker), and has one of the roles asked for: colocated policies take only ``"both"`` workers
  (a disaggregated fleet's prefill and decode engines are for P/D policies, which pass their
  pool's roles).
- :func:`fit_now`, in one pass: could it ever fit (``blocks_needed(prompt, max_tokens) <=
  num_gpu_blocks`` and ``prompt + max_tokens <= max_model_len``; seed 003: cache must hold
  prompt + generation), and can it be taken now (in-flight below the policy's cap, and the
  uncached part of the request fits in the free KV blocks; unknown free blocks count as
  fitting; seed 001).
"""

from __future__ import annotations

from collections.abc import Iterable

from services.core.keys import blocks_needed
from services.core.policy.types import RequestInfo, WorkerState

COLOCATED: tuple[str, ...] = ("both",)


def routable_for_model(
    workers: Iterable[WorkerState],
    model: str,
    filtered: dict[str, str],
    roles: tuple[str, ...] = COLOCATED,
) -> list[WorkerState]:
    out = []
    for w in workers:
        if w.role not in roles:
            filtered[w.worker_id] = f"role {w.role}"
        elif model and w.model != model and model not in w.loras:
            filtered[w.worker_id] = f"serves {w.model!r}"
        elif not w.healthy:
            filtered[w.worker_id] = "unhealthy"
        elif w.circuit_open:
            filtered[w.worker_id] = "circuit open"
        elif w.cordoned:
            filtered[w.worker_id] = "cordoned"
        elif w.draining:
            filtered[w.worker_id] = "draining"
        else:
            out.append(w)
    return out


def fit_now(
    workers: list[WorkerState],
    req: RequestInfo,
    overlaps: dict[str, int],
    max_inflight: int | None,
    filtered: dict[str, str],
) -> tuple[bool, list[WorkerState]]:
    """Both fit filters in one pass: (whether any worker could ever fit the request, the
    workers that can take it now). Could-ever-fit: ``blocks_needed(prompt, max_tokens) <=
    num_gpu_blocks`` and ``prompt + max_tokens <= max_model_len``. Can-take-now (of those): in
    flight below ``max_inflight`` (the policy's cap, as :meth:`PolicyImpl.cap` applies it; None:
    the worker's ``max_num_seqs`` only) and the uncached blocks fit in the free ones (unknown
    free blocks count as fitting). ``filtered`` gets the could-never-fit verdicts first, then
    the cannot-now ones."""
    total = req.prompt_tokens + req.max_tokens
    possible = False
    out = []
    busy: dict[str, str] = {}
    needs: dict[int, int] = {}  # block size -> blocks the request needs (one size, usually)
    for w in workers:
        cap = w.capacity
        bs = cap.block_size
        need = needs.get(bs)
        if need is None:
            need = needs[bs] = blocks_needed(req.prompt_tokens, req.max_tokens, bs)
        if need > cap.num_gpu_blocks:
            filtered[w.worker_id] = f"needs {need} KV blocks > {cap.num_gpu_blocks} total"
            continue
        if total > cap.max_model_len:
            filtered[w.worker_id] = f"{total} tokens > max_model_len {cap.max_model_len}"
            continue
        possible = True
        limit = cap.max_num_seqs
        if max_inflight is not None and max_inflight < limit:
            limit = max_inflight
        if w.inflight >= limit:
            busy[w.worker_id] = f"at cap: {w.inflight} in flight >= {limit}"
            continue
        free = w.kv_blocks_free
        if free is not None:
            left = need - overlaps.get(w.worker_id, 0)
            if left > free:
                busy[w.worker_id] = f"KV full: needs {left} blocks, {free} free"
                continue
        out.append(w)
    if busy:
        filtered.update(busy)
    return possible, out


def never_fits_message(workers: list[WorkerState], req: RequestInfo) -> str:
    caps = {
        (w.capacity.block_size, w.capacity.num_gpu_blocks, w.capacity.max_model_len)
        for w in workers
    }
    bs, blocks, mml = max(caps, key=lambda c: (c[1] * c[0], c[2]))
    need = blocks_needed(req.prompt_tokens, req.max_tokens, bs)
    return (
        f"request needs {req.prompt_tokens} prompt + {req.max_tokens} max_tokens = "
        f"{req.prompt_tokens + req.max_tokens} tokens = {need} KV blocks of {bs} tokens; "
        f"the largest worker holds {blocks} blocks ({blocks * bs} tokens) and "
        f"max_model_len {mml}"
    )
