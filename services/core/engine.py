"""The simulated engine core: a vLLM-like scheduler over a paged, prefix-cached KV cache, with
a step-time model. Pure: no I/O, no asyncio, no wall clock. The caller owns time: it calls
:meth:`Engine.step` with the current time and advances its clock by ``duration_s`` afterwards
(the cluster simulator on a virtual clock, the live worker on real time).

Scheduling (one call of :meth:`Engine.step` = one forward pass of the batch):

1. Running requests first, in admission order: a decoding request takes 1 token of the step's
   token budget (``max_num_batched_tokens``), a request still in prefill takes the rest of its
   prompt up to the remaining budget (chunked prefill).
2. Then the waiting queue, first come first served, while there are free sequence slots
   (``max_num_seqs``) and budget. A request is admitted only when *all* the blocks it can ever
   need, ``ceil((prompt + max_tokens) / block_size)`` minus the blocks found in the prefix cache,
   fit in the free pool (TensorRT-LLM's guaranteed-no-evict policy, so nothing is ever preempted).
   The head of the queue blocks the rest (FCFS), as in vLLM. This is what makes the seed-001
   failure reproduce: with 2560 tokens of KV and requests of 2048 tokens, one runs, seven wait.
   (``admission="vllm"`` instead admits on the first prompt chunk's blocks, grows requests
   block by block and preempts the most recently admitted one when the pool runs out.)
   With ``scheduling="priority"`` (vLLM's ``--scheduling-policy priority``, vllm 0.33.0
   ``vllm/v1/core/sched/request_queue.py`` + ``scheduler.py``) the queue is ordered by
   (``SimRequest.priority``, arrival), lower values first, a preempted request goes back in
   that order, and the request preempted when the pool runs out is the running one with the
   greatest (priority, arrival). ``preempt_threshold`` (SGLang's
   ``--priority-scheduling-preemption-threshold``; None, vLLM's behaviour: never) also lets the
   queue's head preempt running requests whose priority is more than the threshold above its
   own, lowest first, when it finds no free sequence slot or blocks.
3. The step's duration comes from :class:`EngineConfig`'s cost model (see :meth:`step_time`).
4. After the step, full blocks of computed tokens (prompt and generated) are keyed with the
   canonical chained keys and entered into the prefix cache; each new key is a BlockStored
   event and each eviction a BlockRemoved event, in the order they happened.

Invariants:
- the same config, seed and sequence of calls give the same outputs (no randomness besides a
  hash of (seed, prompt, request's sample_seed, position) that picks generated tokens);
- a request's first generated token is emitted in the step that completes its prefill;
- a finished request has produced exactly ``max_tokens`` tokens (there is no EOS).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from services.common.schemas import BlockStored, KvEvent
from services.core.keys import block_keys, block_seed, blocks_needed
from services.core.kvcache import BlockPool, EventMeta

# Generated tokens: lowercase ASCII letters and spaces (valid UTF-8 bytes, so the byte-level
# tokenizer decodes them to readable text). A HuggingFace tokenizer's worker passes its own.
DEFAULT_OUTPUT_VOCAB: tuple[int, ...] = tuple(range(ord("a"), ord("z") + 1)) + (32, 32, 32, 32)


ADMISSION_MODES: tuple[str, ...] = ("reserve", "vllm")
SCHEDULING_POLICIES: tuple[str, ...] = ("fcfs", "priority")


class AdmissionError(ValueError):
    """The request can never run on this engine (too long for the model or the KV cache)."""


@dataclass
class EngineConfig:
    """Capacity and cost model of one simulated engine.

    Defaults resemble Llama-3-8B (bf16) served by vLLM on one H100 SXM 80 GB; the reasoning
    behind each number is in docs/worker-sim.md.
    """

    block_size: int = 16
    num_gpu_blocks: int = 27_000  # ~432k tokens of KV: (0.9 * 80 GB - 16 GB weights - 4 GB) / 2 MiB
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    hash_seed: int = 0
    seed: int = 0
    # "reserve": admit only when all blocks a request can need fit (TensorRT-LLM's
    # guaranteed-no-evict; reproduces seed 001). "vllm": admit when the prompt's blocks fit
    # (keeping a 1 % watermark free), allocate decode blocks on demand and, when the pool runs
    # out, preempt the most recently admitted request (freed, recomputed later), like vLLM V1.
    admission: str = "reserve"
    # "fcfs": the queue in arrival order, requests' priorities ignored. "priority": ordered by
    # (priority, arrival), lower first; the preemption victim is the lowest priority (vLLM's
    # --scheduling-policy priority)
    scheduling: str = "fcfs"
    # priority scheduling only: the queue's head preempts running requests whose priority is
    # more than this above its own when it cannot be admitted (SGLang's
    # --priority-scheduling-preemption-threshold, default 10 there); None: never (vLLM)
    preempt_threshold: int | None = None
    # step-time model (seconds)
    step_overhead_s: float = 0.0065  # weights read once per forward pass + launch overhead
    prefill_token_s: float = 4.0e-5  # per uncached prompt token (~25k tok/s of dense GEMM)
    prefill_attn_s: float = 2.5e-9  # per (uncached token x context token) of attention
    decode_seq_s: float = 3.0e-5  # per decoding sequence (GEMM rows, sampling)
    decode_kv_token_s: float = 5.5e-8  # per KV token read by decode attention (128 KiB/token)
    # GPU memory model (for the simulated GPU gauges)
    gpu_mem_total_bytes: int = 85_520_809_984  # what NVML reports for an H100 SXM 80 GB
    weights_bytes: int = 16_060_000_000  # 8.03e9 params x 2 bytes
    activation_bytes: int = 4_000_000_000  # activations, CUDA graphs, allocator slack
    kv_bytes_per_token: int = 131_072  # 32 layers x 8 KV heads x 128 dim x 2 (K,V) x 2 bytes
    mem_bandwidth_bytes_s: float = 3.35e12  # HBM3 peak
    output_vocab: tuple[int, ...] = DEFAULT_OUTPUT_VOCAB

    def __post_init__(self) -> None:
        for name in (
            "block_size",
            "num_gpu_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
        ):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"EngineConfig.{name} must be > 0, got {getattr(self, name)}")
        if not self.output_vocab:
            raise ValueError("EngineConfig.output_vocab must not be empty")
        if self.admission not in ADMISSION_MODES:
            raise ValueError(
                f"EngineConfig.admission must be one of {ADMISSION_MODES}, got {self.admission!r}"
            )
        if self.scheduling not in SCHEDULING_POLICIES:
            raise ValueError(
                f"EngineConfig.scheduling must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling!r}"
            )
        if self.preempt_threshold is not None and self.preempt_threshold < 0:
            raise ValueError(
                f"EngineConfig.preempt_threshold must be >= 0, got {self.preempt_threshold}"
            )

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_size


@dataclass
class SimRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    lora: str | None = None
    arrival_time: float = 0.0
    # the prompt's canonical block keys when the caller already has them (the cluster simulator
    # hashes every prompt once for the router); the engine computes them when None or when they
    # do not match the prompt's length and first block
    prompt_block_keys: Sequence[int] | None = None
    # mixed into the generated tokens' seed: a request's sampling seed / options and its choice
    # index (0: the tokens depend on the prompt alone)
    sample_seed: int = 0
    cache_salt: str | None = None  # vLLM's cache_salt: its blocks live in their own key space
    # the tokens this request may generate (allowed_token_ids, logit_bias, bad_words); None:
    # the engine's output vocabulary
    output_vocab: tuple[int, ...] | None = None
    # disaggregated serving (P/D). Decode side: the prompt's KV arrives from a prefill engine;
    # admission reserves blocks for the whole prompt and parks the request in
    # ``Engine.receiving`` (no prefill compute) until ``kv_received`` (or ``kv_failed``: the
    # prompt is recomputed here). Prefill side: when it finishes, its blocks stay referenced
    # in ``Engine.held`` until ``release_held`` (the decoder pulled them, or a timeout).
    kv_from_remote: bool = False
    hold_blocks: bool = False
    # served first when lower (vLLM's and SGLang's ``priority``); used only by the
    # "priority" scheduling policy
    priority: int = 0


@dataclass
class FinishedRequest:
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str  # "length" | "abort"
    arrival_time: float = 0.0
    first_token_time: float | None = None  # engine time at the end of the first token's step
    admitted_time: float | None = None  # engine time of the step that first admitted it
    finish_time: float = 0.0


@dataclass
class StepOutput:
    duration_s: float
    tokens: dict[str, list[int]]  # request_id -> token ids generated in this step
    finished: list[FinishedRequest]
    kv_events: list[KvEvent]
    # parallel to kv_events: token ids and LoRA of each BlockStored (None for other events)
    kv_event_meta: list[EventMeta | None] = field(default_factory=list)
    num_prefill_tokens: int = 0  # uncached prompt tokens computed in this step
    num_decode_seqs: int = 0
    kv_tokens_read: int = 0  # context tokens read by decode attention
    # P/D decode side: requests whose blocks were reserved in this step (their KV transfer
    # can start); they wait in ``Engine.receiving``
    kv_transfers: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Seq:
    """A request inside the engine."""

    req: SimRequest
    keys: list[int]  # canonical keys of the prompt's full blocks
    all_keys: list[int]  # keys of every full block so far (prompt, then generated)
    seed: int  # chain seed (cluster seed + LoRA)
    gen_seed: int  # seed of this request's generated tokens
    tokens: list[int]  # prompt + generated so far
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache (cached hits + computed)
    num_cached: int = 0  # prompt tokens served from the prefix cache at admission
    num_registered: int = 0  # leading full blocks entered in the prefix cache
    generated: int = 0
    first_token_time: float | None = None
    admitted_time: float | None = None  # engine time of the step that first admitted it
    prefill_target: int = (
        0  # tokens to compute before sampling (prompt; all tokens after a preemption)
    )
    admitted: bool = False  # admitted at least once (counts and cached_tokens are first-admission)

    @property
    def prompt_len(self) -> int:
        return len(self.req.prompt_token_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_target


class Engine:
    def __init__(self, config: EngineConfig, worker_id: str = "sim") -> None:
        self.config = config
        self.worker_id = worker_id
        self.pool = BlockPool(config.num_gpu_blocks, config.block_size)
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self._ids: set[str] = set()
        self._aborted: list[FinishedRequest] = []
        # P/D: decode requests with blocks reserved, waiting for their KV; finished prefill
        # requests' blocks kept for the decoder to pull (see SimRequest.kv_from_remote)
        self.receiving: dict[str, _Seq] = {}
        self.held: dict[str, list[int]] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up (vLLM counts tokens)
        self.prefix_cache_hits = 0  # prompt tokens found cached
        self.num_steps = 0
        self.num_finished = 0
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # ------------------------------------------------------------------ load
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborted)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return self.pool.usage()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached

    def dump_cache(self) -> list[BlockStored]:
        """Every cached block as BlockStored events (for an indexer's resync)."""
        return self.pool.dump()

    def reset_prefix_cache(self) -> list[KvEvent]:
        """Forget all cached keys (an AllBlocksCleared event); returns the events."""
        self.pool.clear()
        return self.pool.take_events()[0]

    # ------------------------------------------------------------------ requests
    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise AdmissionError when such a request could never run here."""
        c = self.config
        if max_tokens <= 0:
            raise AdmissionError(f"max_tokens must be > 0, got {max_tokens}")
        if prompt_tokens <= 0:
            raise AdmissionError("the prompt is empty")
        if prompt_tokens + max_tokens > c.max_model_len:
            raise AdmissionError(
                f"This model's maximum context length is {c.max_model_len} tokens. However, you "
                f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or "
                f"completion."
            )
        need = blocks_needed(prompt_tokens, max_tokens, c.block_size)
        if need > c.num_gpu_blocks:
            raise AdmissionError(
                f"the request needs {need} KV blocks ({prompt_tokens} prompt + {max_tokens} "
                f"completion tokens, block size {c.block_size}) but the KV cache has only "
                f"{c.num_gpu_blocks} blocks ({c.kv_capacity_tokens} tokens)"
            )

    def add_request(self, req: SimRequest, now: float = 0.0) -> None:
        if req.request_id in self._ids:
            raise AdmissionError(f"duplicate request id {req.request_id!r}")
        self.check(len(req.prompt_token_ids), req.max_tokens)
        c = self.config
        seed = block_seed(c.hash_seed, req.lora, req.cache_salt)
        keys = self._prompt_keys(req, seed)
        gen_seed = xxhash.xxh3_64_intdigest(
            (keys[-1] if keys else 0).to_bytes(8, "little")
            + bytes(
                str(req.prompt_token_ids[len(keys) * c.block_size :]) + (req.lora or ""), "utf-8"
            ),
            seed=c.seed & 0xFFFFFFFFFFFFFFFF,
        )
        if req.sample_seed:
            gen_seed = xxhash.xxh3_64_intdigest(
                gen_seed.to_bytes(8, "little"), seed=req.sample_seed & 0xFFFFFFFFFFFFFFFF
            )
        if not req.arrival_time:
            req.arrival_time = now
        seq = _Seq(
            req=req,
            keys=keys,
            all_keys=list(keys),
            seed=seed,
            gen_seed=gen_seed,
            tokens=list(req.prompt_token_ids),
            prefill_target=len(req.prompt_token_ids),
        )
        self._enqueue(seq)
        self._ids.add(req.request_id)

    @staticmethod
    def _order(s: _Seq) -> tuple[int, float]:
        """Priority scheduling's order: lower priority value, then earlier arrival, first."""
        return (s.req.priority, s.req.arrival_time)

    def _enqueue(self, s: _Seq) -> None:
        """Into the queue: at the end (FCFS), or after every request that goes before it."""
        waiting = self.waiting
        if self.config.scheduling == "fcfs":
            waiting.append(s)
            return
        key = self._order(s)
        i = len(waiting)
        while i and self._order(waiting[i - 1]) > key:
            i -= 1
        waiting.insert(i, s)

    def _prompt_keys(self, req: SimRequest, seed: int) -> list[int]:
        """Canonical keys of the prompt's full blocks; reuses ``req.prompt_block_keys`` when
        their count and first key match the prompt (the rest of the chain is the caller's)."""
        bs = self.config.block_size
        given = req.prompt_block_keys
        prompt = req.prompt_token_ids
        if given is not None and len(given) == len(prompt) // bs:
            if not given or block_keys(prompt[:bs], bs, seed)[0] == given[0]:
                return list(given)
        return block_keys(prompt, bs, seed)

    def abort(self, request_id: str) -> bool:
        """Stop a request (client went away); it is reported as finished with reason "abort"
        in the next step. Returns False when the id is unknown or already finished."""
        if request_id not in self._ids:
            return False
        for i, s in enumerate(self.waiting):
            if s.req.request_id == request_id:
                del self.waiting[i]
                self._finish_aborted(s)
                return True
        for i, s in enumerate(self.running):
            if s.req.request_id == request_id:
                del self.running[i]
                self.pool.free(s.blocks)
                s.blocks = []
                self._finish_aborted(s)
                return True
        s = self.receiving.pop(request_id, None)
        if s is not None:
            self.pool.free(s.blocks)
            s.blocks = []
            self._finish_aborted(s)
            return True
        return False  # pragma: no cover - ids are removed when requests finish

    # ------------------------------------------------------------------ P/D transfers
    def kv_received(self, request_id: str) -> bool:
        """A receiving request's KV arrived: its prompt (all but the last token, whose logits
        the engine computes) is in its reserved blocks, whose full blocks enter the prefix
        cache (BlockStored events); it is scheduled. False when it is not receiving."""
        s = self.receiving.pop(request_id, None)
        if s is None:
            return False
        s.num_computed = max(s.num_computed, s.prefill_target - 1)
        self._register_full_blocks(s)
        self.running.append(s)
        return True

    def kv_failed(self, request_id: str) -> bool:
        """A receiving request's transfer failed: it computes its prompt here instead."""
        s = self.receiving.pop(request_id, None)
        if s is None:
            return False
        self.running.append(s)
        return True

    def release_held(self, request_id: str) -> bool:
        """Free a finished prefill request's held blocks (False: none held)."""
        blocks = self.held.pop(request_id, None)
        if blocks is None:
            return False
        self.pool.free(blocks)
        return True

    def _finish_aborted(self, s: _Seq) -> None:
        self._ids.discard(s.req.request_id)
        self._aborted.append(
            FinishedRequest(
                request_id=s.req.request_id,
                prompt_tokens=s.prompt_len,
                cached_tokens=s.num_cached,
                completion_tokens=s.generated,
                finish_reason="abort",
                arrival_time=s.req.arrival_time,
                first_token_time=s.first_token_time,
                admitted_time=s.admitted_time,
            )
        )

    # ------------------------------------------------------------------ the step
    def step_time(
        self, prefill_tokens: int, prefill_attn: int, decode_seqs: int, kv_read: int
    ) -> float:
        """Duration of one forward pass. ``prefill_attn`` is the sum over computed prompt
        tokens of their context length (attention is quadratic in the prompt)."""
        c = self.config
        return (
            c.step_overhead_s
            + c.prefill_token_s * prefill_tokens
            + c.prefill_attn_s * prefill_attn
            + c.decode_seq_s * decode_seqs
            + c.decode_kv_token_s * kv_read
        )

    def _try_admit(self, s: _Seq, first_chunk: int) -> bool:
        """Take blocks for a waiting request if they fit. ``first_chunk``: prompt tokens the
        step could compute for it (vLLM mode allocates for what is computed, not the rest)."""
        c = self.config
        bs = c.block_size
        # like vLLM, always compute at least the last token (its logits are needed)
        max_hit_blocks = (s.prefill_target - 1) // bs
        hit = self.pool.match_prefix(s.all_keys[:max_hit_blocks])
        hit_tokens = len(hit) * bs
        if c.admission == "reserve":
            new = blocks_needed(s.prompt_len, s.req.max_tokens, bs) - len(hit)
            ok = self.pool.can_allocate(hit, new)
        else:
            n = min(s.prefill_target - hit_tokens, first_chunk)
            new = max(0, -(-(hit_tokens + n) // bs) - len(hit))
            # keep a watermark free for running requests' growth (none needed when idle)
            watermark = max(1, c.num_gpu_blocks // 100) if self.running else 0
            ok = self.pool.can_allocate(hit, new + watermark)
        if not ok:
            return False
        self.pool.touch(hit)
        s.blocks = hit + self.pool.allocate(new)
        s.num_computed = hit_tokens
        s.num_registered = len(hit)
        if not s.admitted:
            s.admitted = True
            s.num_cached = hit_tokens
            self.prefix_cache_queries += s.prompt_len
            self.prefix_cache_hits += hit_tokens
            self.prompt_tokens_total += s.prompt_len
        return True

    def _grow(self, s: _Seq, n: int) -> bool:
        """vLLM mode: blocks for ``n`` more computed tokens of running request ``s``,
        preempting the most recently admitted requests while the pool is short. False when
        ``s`` itself had to be preempted."""
        bs = self.config.block_size
        need = -(-(s.num_computed + n) // bs) - len(s.blocks)
        while need > self.pool.num_free:
            if self.config.scheduling == "priority":
                victim = max(self.running, key=self._order)
            else:
                victim = self.running[-1]
            self._preempt(victim)
            if victim is s:
                return False
        if need > 0:
            s.blocks += self.pool.allocate(need)
        return True

    def _preempt(self, s: _Seq) -> None:
        """Recompute preemption: free the request's blocks and put it back at the head of the
        queue; when readmitted it recomputes all its tokens (prefix-cache hits permitting)."""
        self.running.remove(s)
        self.pool.free(s.blocks)
        s.blocks = []
        s.num_computed = 0
        s.num_registered = 0
        s.prefill_target = len(s.tokens)
        if self.config.scheduling == "fcfs":
            self.waiting.appendleft(s)
        else:  # vLLM's priority queue has no front: back in (priority, arrival) order
            self._enqueue(s)
        self.num_preemptions += 1

    def _preempt_for(self, s: _Seq) -> bool:
        """Priority scheduling with ``preempt_threshold``: preempt the lowest-priority running
        request when its priority value is more than the threshold above waiting ``s``'s
        (SGLang's ``preempt_to_schedule``). True when one was preempted."""
        t = self.config.preempt_threshold
        if t is None or not self.running:
            return False
        victim = max(self.running, key=self._order)
        if victim.req.priority - s.req.priority <= t:
            return False
        self._preempt(victim)
        return True

    @staticmethod
    def _unschedule(scheduled: list[tuple[_Seq, int]], running: list[_Seq]) -> int:
        """Drop the entries of requests preempted since they were scheduled in this step;
        returns the token budget they held."""
        alive = {id(x) for x in running}
        freed = sum(n for x, n in scheduled if id(x) not in alive)
        if freed:
            scheduled[:] = [(x, n) for x, n in scheduled if id(x) in alive]
        return freed

    def step(self, now: float = 0.0) -> StepOutput | None:
        """Run one forward pass starting at ``now``; None when there is nothing to do."""
        running = self.running
        waiting = self.waiting
        if not (waiting or running or self._aborted):
            return None
        c = self.config
        budget = c.max_num_batched_tokens
        # (seq, tokens computed this step), in running order (admitted requests last)
        scheduled: list[tuple[_Seq, int]] = []
        vllm_mode = c.admission == "vllm"
        preemptions_before = self.num_preemptions
        by_priority = c.scheduling == "priority"
        if vllm_mode:
            for s in list(running):
                if budget <= 0:
                    break
                if s not in self.running:  # preempted earlier in this loop
                    continue
                left = s.prefill_target - s.num_computed
                n = (left if left < budget else budget) if left > 0 else 1
                before = self.num_preemptions
                grown = self._grow(s, n)
                if by_priority and self.num_preemptions != before:
                    # by priority the victim may have been scheduled earlier in this step
                    # (first come first served preempts the last request, never one before s)
                    budget += self._unschedule(scheduled, self.running)
                if not grown:
                    if by_priority:
                        continue  # s was the lowest priority: the ones after it may still fit
                    break  # s itself was preempted
                scheduled.append((s, n))
                budget -= n
            running = self.running
        else:  # nothing is ever preempted: no copy, no membership checks
            for s in running:
                if budget <= 0:
                    break
                left = s.prefill_target - s.num_computed
                n = (left if left < budget else budget) if left > 0 else 1
                scheduled.append((s, n))
                budget -= n
        # like vLLM: no new admissions in a step that had to preempt
        transfers: list[str] = []
        if waiting and self.num_preemptions == preemptions_before:
            max_seqs = c.max_num_seqs
            can_preempt = by_priority and c.preempt_threshold is not None
            while waiting and budget > 0:
                s = waiting[0]
                if len(running) >= max_seqs:
                    if not (can_preempt and self._preempt_for(s)):
                        break
                    budget += self._unschedule(scheduled, running)
                    continue
                remote = s.req.kv_from_remote and not s.admitted
                if not self._try_admit(s, s.prefill_target if remote else budget):
                    if can_preempt and self._preempt_for(s):
                        budget += self._unschedule(scheduled, running)
                        continue
                    break  # the head waits for blocks, and so does everyone behind it
                waiting.popleft()
                if remote:  # blocks reserved: the transfer starts, nothing to compute yet
                    self.receiving[s.req.request_id] = s
                    transfers.append(s.req.request_id)
                    continue
                running.append(s)
                if s.admitted_time is None:
                    s.admitted_time = now
                left = s.prefill_target - s.num_computed
                n = left if left < budget else budget
                scheduled.append((s, n))
                budget -= n

        prefill_tokens = prefill_attn = decode_seqs = kv_read = 0
        for s, n in scheduled:
            a = s.num_computed
            if a < s.prefill_target:
                prefill_tokens += n
                # positions a..a+n-1 attend to 0..p
                prefill_attn += (a + a + n + 1) * n // 2
            else:
                decode_seqs += 1
                kv_read += len(s.tokens)
        # = self.step_time(...), inlined (same terms in the same order: same float result)
        duration = (
            (
                c.step_overhead_s
                + c.prefill_token_s * prefill_tokens
                + c.prefill_attn_s * prefill_attn
                + c.decode_seq_s * decode_seqs
                + c.decode_kv_token_s * kv_read
            )
            if scheduled
            else 0.0
        )
        end = now + duration
        tokens: dict[str, list[int]] = {}
        finished: list[FinishedRequest] = self._aborted
        self._aborted = []
        done: list[_Seq] = []
        bs = c.block_size
        vocab = c.output_vocab
        nvocab = len(vocab)
        xxh3 = xxhash.xxh3_64_intdigest
        for s, n in scheduled:
            computed = s.num_computed + n
            s.num_computed = computed
            if computed >= s.prefill_target:  # prefill done (now or before): sample
                g = s.generated
                own = s.req.output_vocab
                if own is None:
                    tok = vocab[
                        xxh3(g.to_bytes(8, "little"), s.gen_seed) % nvocab
                    ]  # positional seed: cheaper
                else:
                    tok = own[xxh3(g.to_bytes(8, "little"), s.gen_seed) % len(own)]
                s.tokens.append(tok)
                s.generated = g = g + 1
                tokens[s.req.request_id] = [tok]
                if s.first_token_time is None:
                    s.first_token_time = end
                if g >= s.req.max_tokens:
                    done.append(s)
            # KV now exists for num_computed tokens (the token just sampled gets its KV in the
            # next step), so the full blocks among them can be shared
            if computed // bs > s.num_registered:
                self._register_full_blocks(s)
        self.generation_tokens_total += len(tokens)
        if done:
            # only a request that generated a token in this step can have finished; ``done``
            # is in running order, since ``scheduled`` is
            for s in done:
                if s.req.hold_blocks:
                    self.held[s.req.request_id] = s.blocks
                else:
                    self.pool.free(s.blocks)
                s.blocks = []
                self._ids.discard(s.req.request_id)
                self.num_finished += 1
                finished.append(
                    FinishedRequest(
                        request_id=s.req.request_id,
                        prompt_tokens=s.prompt_len,
                        cached_tokens=s.num_cached,
                        completion_tokens=s.generated,
                        finish_reason="length",
                        arrival_time=s.req.arrival_time,
                        first_token_time=s.first_token_time,
                        admitted_time=s.admitted_time,
                        finish_time=end,
                    )
                )
            gone = {id(s) for s in done}
            self.running = [s for s in self.running if id(s) not in gone]
        self.num_steps += 1
        events, meta = self.pool.take_events()
        return StepOutput(
            duration_s=duration,
            tokens=tokens,
            finished=finished,
            kv_events=events,
            kv_event_meta=meta,
            num_prefill_tokens=prefill_tokens,
            num_decode_seqs=decode_seqs,
            kv_tokens_read=kv_read,
            kv_transfers=transfers,
        )

    def _next_token(self, s: _Seq) -> int:
        vocab = self.config.output_vocab
        h = xxhash.xxh3_64_intdigest(s.generated.to_bytes(8, "little"), seed=s.gen_seed)
        return vocab[h % len(vocab)]

    def _register_full_blocks(self, s: _Seq) -> None:
        """Enter the full blocks among the computed tokens into the prefix cache. Keys of
        generated blocks continue the prompt's chain (equal to keying the whole sequence)."""
        bs = self.config.block_size
        full = s.num_computed // bs
        start = s.num_registered
        if full <= start:
            return
        have = len(s.all_keys)
        if full > have:
            parent = s.all_keys[-1] if have else None
            s.all_keys.extend(
                block_keys(s.tokens[have * bs : full * bs], bs, s.seed, parent_key=parent)
            )
        parent_key = s.all_keys[start - 1] if start > 0 else None
        self.pool.register(
            s.blocks[start:full],
            s.all_keys[start:full],
            parent_key,
            s.tokens[start * bs : full * bs],
            s.req.lora,
        )
        s.num_registered = full
