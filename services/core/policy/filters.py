"""Filters: which workers may take a request. Each records why it excluded a worker.

- :func:`routable_for_model`: healthy, not cordoned / draining, circuit closed, serves the model
  as its base model or as one of its LoRA adapters (an empty request model matches every
  worker).
- :func:`could_ever_fit`: ``blocks_needed(prompt, max_tokens) <= num_gpu_blocks`` and
  ``prompt + max_tokens <= max_model_len`` (seed 003: cache must hold prompt + generation).
- :func:`can_take_now`: in-flight below the policy's cap, and the uncached part of the request
  fits in the free KV blocks (unknown free blocks count as fitting) (seed 001).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from services.core.keys import blocks_needed
from services.core.policy.types import RequestInfo, WorkerState


def routable_for_model(
    workers: Iterable[WorkerState], model: str, filtered: dict[str, str]
) -> list[WorkerState]:
    out = []
    for w in workers:
        if model and w.model != model and model not in w.loras:
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


def could_ever_fit(
    workers: list[WorkerState], req: RequestInfo, filtered: dict[str, str]
) -> list[WorkerState]:
    total = req.prompt_tokens + req.max_tokens
    out = []
    for w in workers:
        cap = w.capacity
        need = blocks_needed(req.prompt_tokens, req.max_tokens, cap.block_size)
        if need > cap.num_gpu_blocks:
            filtered[w.worker_id] = f"needs {need} KV blocks > {cap.num_gpu_blocks} total"
        elif total > cap.max_model_len:
            filtered[w.worker_id] = f"{total} tokens > max_model_len {cap.max_model_len}"
        else:
            out.append(w)
    return out


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


def can_take_now(
    workers: list[WorkerState],
    req: RequestInfo,
    overlaps: dict[str, int],
    cap: Callable[[WorkerState], int],
    filtered: dict[str, str],
) -> list[WorkerState]:
    out = []
    total = req.prompt_tokens + req.max_tokens
    for w in workers:
        limit = cap(w)
        if w.inflight >= limit:
            filtered[w.worker_id] = f"at cap: {w.inflight} in flight >= {limit}"
            continue
        free = w.kv_blocks_free
        if free is not None:
            bs = w.capacity.block_size
            need = -(-total // bs) - overlaps.get(w.worker_id, 0)
            if need > free:
                filtered[w.worker_id] = f"KV full: needs {need} blocks, {free} free"
                continue
        out.append(w)
    return out
