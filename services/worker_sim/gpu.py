"""Simulated GPU gauges that follow the engine's load. Pure, no I/O.

- SM utilisation: the fraction of the last ``window_s`` (wall) seconds the engine was busy
  stepping, like ``nvidia-smi``'s GPU utilisation (kernel-active time).
- Memory bandwidth utilisation: per step, bytes read (weights once + KV read by decode
  attention) over (step duration x peak bandwidth), capped at 1, time-averaged over the window.
- Memory used: weights + activations + the KV blocks in use. (A real vLLM preallocates its whole
  KV pool, so NVML would show a constant; the simulator reports the KV actually in use, so
  the telemetry pipeline has a load signal to carry. Documented in docs/worker-sim.md.)

Invariant: every gauge is within its physical range (0..100 %, 0..total bytes).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from services.core.engine import Engine, EngineConfig, StepOutput


@dataclass
class GpuGauges:
    sm_util_percent: float
    mem_util_percent: float
    mem_used_bytes: int
    mem_total_bytes: int
    mem_bw_util_percent: float


class GpuModel:
    def __init__(self, config: EngineConfig, window_s: float = 1.0) -> None:
        self.config = config
        self.window_s = window_s
        self._steps: deque[tuple[float, float, float]] = deque()  # (start, end, bw_frac) wall

    def record_step(self, start: float, end: float, out: StepOutput) -> None:
        c = self.config
        virt = out.duration_s
        if virt <= 0 or end <= start:
            return
        read = c.weights_bytes + out.kv_tokens_read * c.kv_bytes_per_token
        bw = min(1.0, read / (virt * c.mem_bandwidth_bytes_s))
        self._steps.append((start, end, bw))
        self._trim(end)

    def _trim(self, now: float) -> None:
        horizon = now - self.window_s
        while self._steps and self._steps[0][1] < horizon:
            self._steps.popleft()

    def sample(self, now: float, engine: Engine) -> GpuGauges:
        c = self.config
        self._trim(now)
        lo = now - self.window_s
        busy = bw = 0.0
        for start, end, frac in self._steps:
            overlap = max(0.0, min(end, now) - max(start, lo))
            busy += overlap
            bw += overlap * frac
        used_kv = (c.num_gpu_blocks - engine.num_free_blocks) * c.block_bytes
        total = c.gpu_mem_total_bytes
        used = min(total, c.weights_bytes + c.activation_bytes + used_kv)
        return GpuGauges(
            sm_util_percent=min(100.0, 100.0 * busy / self.window_s),
            mem_util_percent=100.0 * used / total,
            mem_used_bytes=used,
            mem_total_bytes=total,
            mem_bw_util_percent=min(100.0, 100.0 * bw / self.window_s),
        )
