"""Fill a simulated worker's KV cache fast: synthetic prefix chains through the real block pool
and the real KV event path (seq numbers, faults, NATS and ZMQ sinks).

For tests and benchmarks at fleet-scale cache sizes (a 1 M-block cache is 16 M tokens of
prompts: minutes of simulated prefill). A chain's blocks are allocated, keyed and freed exactly
as a finished request's are, so a full cache evicts its least-recently-used blocks (BlockRemoved
events) like the engine does.

Invariant: after :func:`fill_cache` the worker's pool holds what the emitted events say
(``worker.engine.dump_cache()`` equals the events replayed), whatever faults dropped.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.worker_sim.worker import SimWorker


def fill_cache(
    worker: SimWorker,
    blocks: int,
    *,
    chain_blocks: int = 64,
    chains_per_batch: int = 16,
    seed: int = 0,
) -> int:
    """Store ``blocks`` new blocks as chains of ``chain_blocks``, ``chains_per_batch`` chains
    per KV batch (one batch is one engine step's events). Returns the batches emitted."""
    if blocks < 0 or chain_blocks <= 0 or chains_per_batch <= 0:
        raise ValueError("blocks >= 0, chain_blocks > 0 and chains_per_batch > 0 needed")
    pool = worker.engine.pool
    rng = random.Random(f"{worker.worker_id}:{worker.instance_id}:{seed}")
    batches = 0
    left = blocks
    while left > 0:
        for _ in range(chains_per_batch):
            n = min(chain_blocks, left, pool.num_free)
            if n <= 0:
                break
            ids = pool.allocate(n)
            keys = [rng.getrandbits(64) for _ in range(n)]
            pool.register(ids, keys, None, [], None)
            pool.free(ids)
            left -= n
        events, meta = pool.take_events()
        if not events:
            break
        worker._emit_kv(events, meta)  # the engine loop's own path: seq, faults, sinks
        batches += 1
    return batches
