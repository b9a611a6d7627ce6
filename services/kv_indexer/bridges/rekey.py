"""Re-keying one engine's KV events into kvgate's canonical events. Pure, no I/O.

Engines name blocks by their own hashes; kvgate names them by canonical keys derived from the
token ids (services.core.keys). A :class:`Rekeyer` serves one engine (one worker): for
each stored block it computes the canonical key, chained from the parent's key, and keeps
``engine hash -> key`` so that removals (which carry engine hashes only) resolve.

Invariants:
- ``key_of`` holds exactly the engine hashes the engine still caches on some tier (as far as
  the events seen tell), so :meth:`dump` is the worker's cache in canonical form;
- a stored block whose parent hash is unknown cannot be keyed (its key depends on the whole
  prefix): the event is dropped and counted as ``unknown_parent``, never guessed;
- bad input is counted per reason in ``counts`` and never raises.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

from services.common.schemas import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from services.core.keys import block_keys, block_seed
from services.kv_indexer.bridges.engine_formats import (
    CLEARED_TYPES,
    REMOVED_TYPES,
    STORED_TYPES,
    TCreated,
    TEvent,
    TRemoved,
    TStored,
    TUpdated,
    medium_tier,
)

TIER_BIT = {"gpu": 1, "cpu": 2, "disk": 4}
TIER_OF_LEVEL = {0: "gpu", 1: "cpu"}  # TensorRT-LLM cache levels: 0 primary, 1 secondary


def _noop(reason: str, detail: str) -> None:
    return None


class Rekeyer:
    def __init__(
        self,
        hash_seed: int = 0,
        block_size: int | None = None,
        on_bad: Callable[[str, str], None] = _noop,
    ) -> None:
        self.hash_seed = hash_seed
        self.block_size = block_size  # expected; None = take the engine's
        self.on_bad = on_bad
        self.key_of: dict[object, int] = {}
        self.tiers: dict[object, int] = {}  # sparse: engine hash -> tier bits when != {gpu}
        self.counts: collections.Counter[str] = collections.Counter()
        self._seeds: dict[str | None, int] = {None: hash_seed & 0xFFFFFFFFFFFFFFFF}
        self.num_gpu_blocks: int | None = None  # TensorRT-LLM "created" event

    def bad(self, reason: str, detail: str) -> None:
        self.counts[reason] += 1
        self.on_bad(reason, detail)

    def _seed(self, lora: str | None) -> int:
        s = self._seeds.get(lora)
        if s is None:
            s = self._seeds[lora] = block_seed(self.hash_seed, lora=lora)
        return s

    def reset(self) -> None:
        self.key_of.clear()
        self.tiers.clear()

    # ------------------------------------------------------------------ primitives
    def stored(
        self,
        hashes: Sequence[object],
        parent_hash: object | None,
        token_ids: Sequence[int],
        block_size: int,
        tier: str = "gpu",
        lora: str | None = None,
    ) -> BlockStored | None:
        n = len(hashes)
        if n == 0:
            return None
        if block_size <= 0:
            self.bad("invalid_schema", f"block_size {block_size}")
            return None
        if self.block_size is None:
            self.block_size = block_size
        elif block_size != self.block_size:
            self.bad("block_size_mismatch", f"event {block_size} != engine's {self.block_size}")
            return None
        if len(token_ids) < n * block_size:
            self.bad("token_count_mismatch", f"{len(token_ids)} tokens for {n} blocks")
            return None
        parent_key = None
        if parent_hash is not None:
            parent_key = self.key_of.get(parent_hash)
            if parent_key is None:
                self.bad("unknown_parent", f"parent hash {parent_hash!r} never stored")
                return None
        try:
            keys = block_keys(token_ids, block_size, self._seed(lora), parent_key, n)
        except OverflowError:
            self.bad("invalid_schema", "token id outside uint32")
            return None
        key_of = self.key_of
        if tier == "gpu" and not self.tiers:
            for h, k in zip(hashes, keys, strict=True):
                key_of[h] = k
        else:
            bit = TIER_BIT[tier]
            tiers = self.tiers
            for h, k in zip(hashes, keys, strict=True):
                if h in key_of:
                    cur = tiers.get(h, 1) | bit
                else:
                    cur = bit
                key_of[h] = k
                if cur == 1:
                    tiers.pop(h, None)
                else:
                    tiers[h] = cur
        return BlockStored(keys=keys, parent_key=parent_key, block_size=block_size, tier=tier)

    def removed(self, hashes: Sequence[object], tier: str | None) -> list[BlockRemoved]:
        """Canonical removals; ``tier`` None = every tier the block is on (one event per
        tier, since a canonical BlockRemoved names its tier)."""
        key_of = self.key_of
        tiers = self.tiers
        by_tier: dict[str, list[int]] = {}
        unknown = 0
        drop = 7 if tier is None else TIER_BIT[tier]
        for h in hashes:
            k = key_of.get(h)
            if k is None:
                unknown += 1
                continue
            cur = tiers.get(h, 1)
            gone = cur & drop
            if not gone:
                continue
            for t, bit in TIER_BIT.items():
                if gone & bit:
                    by_tier.setdefault(t, []).append(k)
            cur &= ~drop
            if cur:
                if cur == 1:
                    tiers.pop(h, None)
                else:
                    tiers[h] = cur
            else:
                del key_of[h]
                tiers.pop(h, None)
        if unknown:
            self.bad("unknown_block", f"{unknown} removed hashes never stored")
        return [BlockRemoved(keys=keys, tier=t) for t, keys in by_tier.items()]  # type: ignore[arg-type]

    def cleared(self) -> AllBlocksCleared:
        self.reset()
        return AllBlocksCleared()

    # ------------------------------------------------------------------ engine batches
    def vllm_events(self, events: Sequence[object]) -> list[KvEvent]:
        """Canonical events of one decoded vLLM / SGLang batch (see engine_formats)."""
        out: list[KvEvent] = []
        for ev in events:
            if isinstance(ev, STORED_TYPES):
                lora = ev.lora_name or (f"lora-{ev.lora_id}" if ev.lora_id else None)
                c = self.stored(
                    ev.block_hashes,
                    ev.parent_block_hash,
                    ev.token_ids,
                    ev.block_size,
                    medium_tier(ev.medium),
                    lora,
                )
            elif isinstance(ev, REMOVED_TYPES):
                out += self.removed(ev.block_hashes, medium_tier(ev.medium) if ev.medium else None)
                continue
            elif isinstance(ev, CLEARED_TYPES):
                c = self.cleared()
            else:  # pragma: no cover - closed union
                continue
            if c is not None:
                out.append(c)
        return out

    def trtllm_events(self, events: Sequence[TEvent]) -> list[KvEvent]:
        """Canonical events of TensorRT-LLM ``/kv_cache_events`` entries."""
        out: list[KvEvent] = []
        for ev in events:
            d = ev.data
            if isinstance(d, TStored):
                # blocks may change cache level or token count inside one event: cut runs
                run: list = []
                parent = d.parent_hash
                for b in d.blocks + [None]:  # type: ignore[list-item]
                    if run and (
                        b is None
                        or b.cache_level != run[0].cache_level
                        or len(b.tokens) != len(run[0].tokens)
                    ):
                        c = self.stored(
                            [x.block_hash for x in run],
                            parent,
                            [t.token_id for x in run for t in x.tokens],
                            len(run[0].tokens),
                            TIER_OF_LEVEL.get(run[0].cache_level, "disk"),
                            None,
                        )
                        if c is not None:
                            out.append(c)
                        parent = run[-1].block_hash
                        run = []
                    if b is not None:
                        run.append(b)
            elif isinstance(d, TRemoved):
                out += self.removed(d.block_hashes, None)
            elif isinstance(d, TUpdated):
                lvl = d.cache_level
                k = self.key_of.get(d.block_hash)
                if lvl is None or lvl.new_value is None or lvl.new_value == lvl.old_value:
                    continue
                if k is None:
                    self.bad("unknown_block", f"updated hash {d.block_hash} never stored")
                    continue
                new = TIER_OF_LEVEL.get(lvl.new_value, "disk")
                old = TIER_OF_LEVEL.get(lvl.old_value or 0, "disk")
                self.tiers[d.block_hash] = TIER_BIT[new]
                if new == "gpu":
                    self.tiers.pop(d.block_hash, None)
                out.append(
                    BlockStored(
                        keys=[k], parent_key=None, block_size=self.block_size or 1, tier=new
                    )
                )
                out.append(BlockRemoved(keys=[k], tier=old))  # type: ignore[arg-type]
            elif isinstance(d, TCreated):
                if d.num_blocks_per_cache_level:
                    self.num_gpu_blocks = d.num_blocks_per_cache_level[0]
        return out

    # ------------------------------------------------------------------ dump
    def dump(self) -> list[KvEvent]:
        """The whole cache as canonical events: AllBlocksCleared, then stored keys per tier
        (in the order they were stored; ``parent_key`` None: keys are self-describing)."""
        events: list[KvEvent] = [AllBlocksCleared()]
        bs = self.block_size or 1
        by_tier: dict[str, list[int]] = {"gpu": [], "cpu": [], "disk": []}
        tiers = self.tiers
        for h, k in self.key_of.items():
            bits = tiers.get(h, 1)
            for t, bit in TIER_BIT.items():
                if bits & bit:
                    by_tier[t].append(k)
        for t, keys in by_tier.items():
            if keys:
                events.append(BlockStored(keys=keys, parent_key=None, block_size=bs, tier=t))  # type: ignore[arg-type]
        return events
