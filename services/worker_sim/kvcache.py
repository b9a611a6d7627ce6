"""Paged KV cache with prefix caching, like vLLM's block pool. Pure, no I/O.

A fixed pool of ``num_blocks`` blocks. A block is either *empty* (never keyed or its key was
dropped), *cached* (holds a full block whose canonical key is in the prefix map), or both
cached and *referenced* by running requests. Blocks with ``ref == 0`` are free: empty ones are
handed out first, then cached ones in least-recently-used order (evicting their key, which is a
:class:`BlockRemoved` event). A request frees its blocks tail first, so the leaves of a prefix
chain are always older than their parents and are evicted first.

Invariants:
- ``num_free == len(empty) + len(lru)`` and every free block has ``ref == 0``;
- every key in ``cached`` maps to exactly one block whose ``key`` is that key;
- every store of a key into ``cached`` and every removal of one is recorded as an event, in
  order, in the pending event list (drained by :meth:`take_events`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from services.common.schemas import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


@dataclass(slots=True)
class Block:
    block_id: int
    ref: int = 0
    key: int | None = None
    parent_key: int | None = None
    stored_seq: int = 0  # order of registration (for dumps: parents before children)


@dataclass(slots=True)
class EventMeta:
    """Extra facts about a BlockStored event that the canonical schema does not carry but
    engine wire formats do (vLLM ZMQ): the blocks' token ids and the request's LoRA."""

    token_ids: list[int]
    lora: str | None = None


class CacheFullError(RuntimeError):
    """Asked for more blocks than are free (callers check :meth:`can_allocate` first)."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.empty: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives block 0 first
        self.lru: OrderedDict[int, None] = OrderedDict()  # free cached blocks, oldest first
        self.cached: dict[int, int] = {}  # key -> block id
        self._events: list[KvEvent] = []
        self._meta: list[EventMeta | None] = []
        self._store_counter = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self.empty) + len(self.lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def match_prefix(self, keys: list[int]) -> list[int]:
        """Block ids of the longest leading run of ``keys`` that is cached."""
        out: list[int] = []
        for k in keys:
            bid = self.cached.get(k)
            if bid is None:
                break
            out.append(bid)
        return out

    def can_allocate(self, hit_blocks: list[int], new_blocks: int) -> bool:
        """Whether ``hit_blocks`` can be referenced and ``new_blocks`` more allocated now.
        Hit blocks that are free count against the free pool (taking them removes them)."""
        free_hits = sum(1 for b in hit_blocks if self.blocks[b].ref == 0)
        return new_blocks + free_hits <= self.num_free

    # ------------------------------------------------------------------ mutation
    def touch(self, block_ids: list[int]) -> None:
        """Reference cached blocks (a prefix hit): they leave the free LRU while in use."""
        for b in block_ids:
            blk = self.blocks[b]
            if blk.ref == 0:
                self.lru.pop(b, None)
            blk.ref += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks for a request: empty blocks first, then evict LRU cached blocks."""
        if n > self.num_free:
            raise CacheFullError(f"need {n} blocks, {self.num_free} free")
        out: list[int] = []
        evicted: list[int] = []
        for _ in range(n):
            if self.empty:
                b = self.empty.pop()
            else:
                b, _ = self.lru.popitem(last=False)
                blk = self.blocks[b]
                if blk.key is not None:
                    del self.cached[blk.key]
                    evicted.append(blk.key)
                    blk.key = None
                    blk.parent_key = None
            self.blocks[b].ref = 1
            out.append(b)
        if evicted:
            self._emit(BlockRemoved(keys=evicted), None)
        return out

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block, tail first, so leaves are evicted first."""
        for b in reversed(block_ids):
            blk = self.blocks[b]
            blk.ref -= 1
            if blk.ref < 0:  # pragma: no cover - would be a scheduler bug
                raise RuntimeError(f"block {b} freed twice")
            if blk.ref == 0:
                if blk.key is None:
                    self.empty.append(b)
                else:
                    self.lru[b] = None

    def register(
        self,
        block_ids: list[int],
        keys: list[int],
        parent_key: int | None,
        token_ids: list[int],
        lora: str | None,
    ) -> None:
        """Full blocks have been computed: enter their keys into the prefix map (one
        BlockStored event per run of newly cached blocks). A key already cached by another
        block (two requests computed the same block at once) is not stored twice; the duplicate
        block stays private and is recycled as empty when freed."""
        bs = self.block_size
        run_keys: list[int] = []
        run_tokens: list[int] = []
        run_parent = parent_key
        prev = parent_key
        for i, (b, k) in enumerate(zip(block_ids, keys, strict=True)):
            blk = self.blocks[b]
            if k in self.cached or blk.key is not None:
                if run_keys:
                    self._emit(
                        BlockStored(keys=run_keys, parent_key=run_parent, block_size=bs),
                        EventMeta(run_tokens, lora),
                    )
                run_keys, run_tokens = [], []
                run_parent = k
                prev = k
                continue
            blk.key = k
            blk.parent_key = prev
            self._store_counter += 1
            blk.stored_seq = self._store_counter
            self.cached[k] = b
            run_keys.append(k)
            run_tokens.extend(token_ids[i * bs : (i + 1) * bs])
            prev = k
        if run_keys:
            self._emit(
                BlockStored(keys=run_keys, parent_key=run_parent, block_size=bs),
                EventMeta(run_tokens, lora),
            )

    def clear(self) -> None:
        """Forget every cached key (vLLM reset_prefix_cache): one AllBlocksCleared event.
        Referenced blocks stay in use but are no longer shareable."""
        for b in list(self.lru):
            self.empty.append(b)
        self.lru.clear()
        for blk in self.blocks:
            blk.key = None
            blk.parent_key = None
        self.cached.clear()
        self._emit(AllBlocksCleared(), None)

    # ------------------------------------------------------------------ events
    def _emit(self, event: KvEvent, meta: EventMeta | None) -> None:
        self._events.append(event)
        self._meta.append(meta)

    def take_events(self) -> tuple[list[KvEvent], list[EventMeta | None]]:
        events, meta = self._events, self._meta
        self._events, self._meta = [], []
        return events, meta

    def dump(self) -> list[BlockStored]:
        """The whole cache as BlockStored events, each block after its parent when the parent
        is cached too (consecutive chain members are merged into one event)."""
        bs = self.block_size
        order = sorted(
            (self.blocks[b] for b in self.cached.values()), key=lambda blk: blk.stored_seq
        )
        done: set[int] = set()
        out: list[BlockStored] = []
        for blk in order:
            if blk.key in done:
                continue
            chain = [blk]
            cur = blk
            while cur.parent_key is not None and cur.parent_key not in done:
                pb = self.cached.get(cur.parent_key)
                if pb is None:
                    break
                cur = self.blocks[pb]
                chain.append(cur)
            chain.reverse()
            keys = [c.key for c in chain if c.key is not None]
            done.update(keys)
            out.append(BlockStored(keys=keys, parent_key=chain[0].parent_key, block_size=bs))
        return out
