"""Turning readings into samples: an engine reading (or a failed scrape) plus the worker's
GPU samples becomes one :class:`~services.common.schemas.WorkerLoad`, and each WorkerLoad
becomes one detector :class:`~services.telemetry.detectors.Observation` in the worker's
sliding window. No I/O here.

Invariants:
- A sample is stamped with the time its request was sent, not the time the answer came.
- A failed scrape gives a ``stale=True`` sample with the error text and None engine values
  (never zeros); GPU readings, which do not depend on the engine, are kept.
- Engine-reported figures win over heartbeat-declared capacity, which only fills gaps.
- The cache hit rate is a ratio of counter deltas over at least one second; a counter reset
  restarts the base instead of giving a negative or huge rate.
- The window holds only the last ``history_s`` seconds of observations.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.common.schemas import GpuSample, WorkerLoad

from .detectors import Observation
from .engines import EngineReading
from .targets import GpuAssignment, Target


@dataclass
class SampleState:
    """What a worker's samples are computed from beyond the current reading."""

    engine_gpus: tuple[GpuSample, ...] = ()  # GPUs the engine reports itself (simulated)
    hit_base: tuple[float, float, float] | None = None  # (ts, queries, hits)
    hit_rate: float | None = None
    prompt_obs: deque[int] = field(default_factory=lambda: deque(maxlen=256))
    new_obs: deque[int] = field(default_factory=lambda: deque(maxlen=256))


@dataclass(frozen=True)
class TypicalSettings:
    typical_prompt_tokens: float = 0.0  # > 0: configured, overrides observation
    max_new_tokens: float = 0.0
    min_observed_requests: int = 8


def gpus_for(assignment: GpuAssignment, samples: list[GpuSample], worker: str) -> list[GpuSample]:
    """The latest samples of the GPUs assigned to ``worker`` (samples are in index order)."""
    gpus = assignment.gpus_of(worker)
    if not gpus:
        return []
    if len(gpus) == 1:
        i = gpus[0]
        if i < len(samples) and samples[i].index == i:
            return [samples[i]]
    wanted = set(gpus)
    return [g for g in samples if g.index in wanted]


def typicals(
    cfg: TypicalSettings, st: SampleState, r: EngineReading
) -> tuple[float | None, float | None]:
    """(typical prompt tokens, typical new tokens): configured, else the engine's histograms,
    else what the router's outcomes showed, once enough requests were seen."""
    prompt: float | None = cfg.typical_prompt_tokens or None
    new: float | None = cfg.max_new_tokens or None
    if prompt is None:
        if r.prompt_tokens_count and r.prompt_tokens_count >= cfg.min_observed_requests:
            prompt = (r.prompt_tokens_sum or 0.0) / r.prompt_tokens_count
        elif len(st.prompt_obs) >= cfg.min_observed_requests:
            prompt = sum(st.prompt_obs) / len(st.prompt_obs)
    if new is None:
        if r.max_tokens_count and r.max_tokens_count >= cfg.min_observed_requests:
            new = (r.max_tokens_sum or 0.0) / r.max_tokens_count
        elif len(st.new_obs) >= cfg.min_observed_requests:
            new = sum(st.new_obs) / len(st.new_obs)
    return prompt, new


def hit_rate(st: SampleState, ts: float, q: float, h: float) -> float | None:
    base = st.hit_base
    if base is None or q < base[1] or h < base[2]:  # first sight or counter reset
        st.hit_base = (ts, q, h)
        return st.hit_rate
    if ts - base[0] >= 1.0:
        dq = q - base[1]
        if dq > 0:
            st.hit_rate = min(1.0, max(0.0, (h - base[2]) / dq))
        st.hit_base = (ts, q, h)
    return st.hit_rate


def load_from(
    t: Target, st: SampleState, r: EngineReading, ts: float, gpus: list[GpuSample]
) -> WorkerLoad:
    """A successful reading -> the worker's sample (``gpus``: the node's samples for it)."""
    cap = t.capacity
    max_batch = r.max_batch if r.max_batch is not None else (cap.max_num_seqs if cap else None)
    tpb = r.tokens_per_block or (cap.block_size if cap else None)
    cap_tokens = r.kv_capacity_tokens
    blocks_total = r.kv_blocks_total
    if cap_tokens is None and cap is not None:
        cap_tokens = cap.num_gpu_blocks * cap.block_size
        blocks_total = blocks_total or cap.num_gpu_blocks
    hit = r.cache_hit_rate
    if hit is None and r.prefix_cache_queries is not None and r.prefix_cache_hits is not None:
        hit = hit_rate(st, ts, r.prefix_cache_queries, r.prefix_cache_hits)
    st.engine_gpus = tuple(r.gpus)
    return WorkerLoad(
        worker_id=t.worker_id,
        ts=ts,
        source=r.source,
        running=r.running,
        waiting=r.waiting,
        scheduled=r.scheduled,
        max_batch=max_batch,
        kv_usage=r.kv_usage,
        kv_blocks_total=blocks_total,
        kv_blocks_free=r.kv_blocks_free,
        tokens_per_block=tpb,
        prefix_cache_queries=r.prefix_cache_queries,
        prefix_cache_hits=r.prefix_cache_hits,
        gpus=r.gpus + gpus,
        kv_capacity_tokens=cap_tokens,
        cache_hit_rate=hit,
        prefix_caching=r.prefix_caching,
    )


def stale_load(t: Target, ts: float, error: str, gpus: list[GpuSample]) -> WorkerLoad:
    """A failed scrape -> a stale sample: the error, no engine values, the GPU samples."""
    return WorkerLoad(
        worker_id=t.worker_id,
        ts=ts,
        source=t.engine or "unknown",
        stale=True,
        error=error[:500],
        gpus=gpus,
    )


def observation(
    t: Target, load: WorkerLoad, kv_events: int, typ: tuple[float | None, float | None]
) -> Observation:
    return Observation(
        ts=load.ts,
        stale=load.stale,
        error=load.error,
        source=load.source,
        running=load.running,
        waiting=load.waiting,
        scheduled=load.scheduled,
        max_batch=load.max_batch,
        kv_usage=load.kv_usage,
        kv_capacity_tokens=load.kv_capacity_tokens,
        tokens_per_block=load.tokens_per_block,
        prefix_caching=load.prefix_caching,
        prefix_cache_queries=load.prefix_cache_queries,
        prefix_cache_hits=load.prefix_cache_hits,
        kv_events=kv_events,
        typical_prompt_tokens=typ[0],
        typical_new_tokens=typ[1],
        gpus=tuple(load.gpus),
        url=t.url,
    )


def remember(window: deque[Observation], o: Observation, history_s: float) -> None:
    """Append ``o`` and drop what is older than ``history_s`` before it."""
    window.append(o)
    horizon = o.ts - history_s
    while window and window[0].ts < horizon:
        window.popleft()
