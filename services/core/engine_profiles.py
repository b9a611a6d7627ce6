"""Named engine profiles: ``EngineConfig`` settings for the simulated engine, by name.

- ``default``: ``EngineConfig``'s own numbers, Llama-3-8B on vLLM on one H100 SXM, reasoned
  from the hardware's datasheet rates (docs/worker-sim.md), not measured.
- ``prefill-bound``: the default with prompt computation 3.125x slower and a KV pool that never
  runs out (docs/benchmarks.md's "PB"), a stress profile for prefill interference.
- ``h200-llama-3-8b``: measured. Step-time terms fitted to the forward passes of a Llama-3-8B
  -shaped model (random weights, bf16, CUDA graphs) on one H200
  (``bench/profiles/h200-llama-3-8b.json``, ``python -m bench.engine_profile``); the KV pool
  and memory figures are the H200's 141 GB taken as vLLM takes the default's 80 GB.
"""

from __future__ import annotations

from typing import Any

# fitted by ``python -m bench.engine_profile --fit bench/profiles/h200-llama-3-8b.json``
H200_LLAMA_3_8B_STEP: dict[str, float] = {
    "step_overhead_s": 7.280e-3,
    "prefill_token_s": 2.220e-5,
    "prefill_attn_s": 2.164e-9,
    "decode_seq_s": 1.527e-5,
    "decode_kv_token_s": 3.023e-8,
}

ENGINE_PROFILES: dict[str, dict[str, Any]] = {
    "default": {},
    "prefill-bound": {"prefill_token_s": 1.25e-4, "num_gpu_blocks": 192000},
    "h200-llama-3-8b": {
        **H200_LLAMA_3_8B_STEP,
        # 0.9 x 150.75 GB (NVML total) - 16.06 GB weights - 4 GB activations = 115.6 GB of KV
        # in 2 MiB blocks (16 tokens x 128 KiB)
        "num_gpu_blocks": 55_000,
        "gpu_mem_total_bytes": 150_754_820_096,
        "mem_bandwidth_bytes_s": 4.8e12,
    },
}
