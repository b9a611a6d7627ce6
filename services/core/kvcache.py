"""Paged KV cache with prefix caching, like vLLM's block pool. Pure, no I/O.

A fixed pool of ``num_blocks`` blocks. A block is either *empty* (never keyed or its key was
dropped), *cached* (holds a full block whose canonical key is in the prefix map), or both
cached and *referenced* by running requests. Blocks with ``ref == 0`` are free: empty ones are
handed out first, then cached ones in least-recently-used order (evicting their key, which is a
:class:`BlockRemoved` event). A request frees its blocks tail first, so the leaves of a prefix
chain are always older than their parents and are evicted first.

Invariants:
- ``num_free == len(empty) + len(lru)`` and every free block has ``ref == 0``;
- every key in ``cached`` maps to exactly one block ``b`` with ``block_key[b]`` that key, and
  ``block_key[b]`` is None for every block that is not cached; ``block_parent[b]`` is the
  parent key of cached block ``b``;
- ``cached`` is in registration order (a dict keeps insertion order), which :meth:`dump` uses
  to put parents before children;
- every store of a key into ``cached`` and every removal of one is recorded as an event, in
  order, in the pending event list (drained by :meth:`take_events`).

The pool is on the simulator's hot path (millions of blocks per simulated hour), so block state
lives in flat lists and dicts and runs of blocks are handled with C-level bulk operations
(slices, ``dict.update(zip(...))``, ``map``) instead of per-block Python objects.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice, repeat

from services.common.schemas import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


@dataclass(slots=True)
class EventMeta:
    """Extra facts about a BlockStored event that the canonical schema does not carry but
    engine wire formats do (vLLM ZMQ): the blocks' token ids and the request's LoRA."""

    token_ids: list[int]
    lora: str | None = None


class CacheFullError(RuntimeError):
    """Asked for more blocks than are free (callers check :meth:`can_allocate` first)."""


def _consume(it: Iterable[object]) -> None:
    """Run an iterator (of side effects) to its end in C."""
    deque(it, maxlen=0)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref: list[int] = [0] * num_blocks  # references by running requests, per block
        self.block_key: list[int | None] = [None] * num_blocks  # key of each cached block
        self.block_parent: list[int | None] = [None] * num_blocks  # its parent key
        self.empty: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives block 0 first
        # free cached blocks, oldest first (a dict keeps insertion order; re-inserting moves a
        # block to the end, and eviction takes from the front)
        self.lru: dict[int, None] = {}
        self.cached: dict[int, int] = {}  # key -> block id, in registration order
        self._events: list[KvEvent] = []
        self._meta: list[EventMeta | None] = []

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

    def match_prefix(self, keys: list[int], limit: int | None = None) -> list[int]:
        """Block ids of the longest leading run of ``keys`` (at most ``limit`` of them) that
        is cached."""
        cached = self.cached
        if limit is not None and limit < len(keys):
            keys = keys[:limit]
        if not keys or keys[0] not in cached:
            return []
        ids = list(map(cached.get, keys))
        try:
            return ids[: ids.index(None)]
        except ValueError:
            return ids

    def can_allocate(self, hit_blocks: list[int], new_blocks: int) -> bool:
        """Whether ``hit_blocks`` can be referenced and ``new_blocks`` more allocated now.
        Hit blocks that are free count against the free pool (taking them removes them)."""
        free_hits = list(map(self.ref.__getitem__, hit_blocks)).count(0) if hit_blocks else 0
        return new_blocks + free_hits <= self.num_free

    # ------------------------------------------------------------------ mutation
    def touch(self, block_ids: list[int]) -> None:
        """Reference cached blocks (a prefix hit): they leave the free LRU while in use."""
        ref = self.ref
        lru = self.lru
        for b in block_ids:
            r = ref[b]
            if r == 0:
                lru.pop(b, None)
            ref[b] = r + 1

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks for a request: empty blocks first, then evict LRU cached blocks."""
        if n > self.num_free:
            raise CacheFullError(f"need {n} blocks, {self.num_free} free")
        if n <= 0:
            return []
        empty = self.empty
        k = min(n, len(empty))
        if k:
            out = empty[-k:]
            out.reverse()  # the order repeated pop() would give
            del empty[-k:]
        else:
            out = []
        m = n - k
        if m:  # evict the m least recently used cached blocks (every LRU block is cached)
            lru = self.lru
            victims = list(islice(lru, m))
            _consume(map(lru.__delitem__, victims))
            block_key = self.block_key
            evicted = list(map(block_key.__getitem__, victims))
            _consume(map(self.cached.__delitem__, evicted))
            _consume(map(block_key.__setitem__, victims, repeat(None)))
            out += victims
        _consume(map(self.ref.__setitem__, out, repeat(1)))
        if m:
            self._emit(BlockRemoved(keys=evicted), None)
        return out

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block, tail first, so leaves are evicted first."""
        ref = self.ref
        block_key = self.block_key
        lru = self.lru
        empty = self.empty
        for b in reversed(block_ids):
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                if block_key[b] is None:
                    empty.append(b)
                else:
                    lru[b] = None
            elif r < 0:  # pragma: no cover - would be a scheduler bug
                raise RuntimeError(f"block {b} freed twice")

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
        block stays private and is recycled as empty when freed.

        ``block_ids`` are blocks the caller allocated and has not registered yet (the engine
        registers each block of a request once, in order), so none of them is cached.
        ``keys`` and ``token_ids`` become part of the events: pass lists the caller will not
        change afterwards (the engine passes fresh slices)."""
        n = len(block_ids)
        if n != len(keys):
            raise ValueError(f"{n} blocks but {len(keys)} keys")
        if n == 0:
            return
        # one pass in C: enter every new key; the result differs from block_ids exactly where
        # a key was already cached (by another block, or earlier in this same list)
        owners = list(map(self.cached.setdefault, keys, block_ids))
        bs = self.block_size
        if owners == block_ids:  # the usual case: every key is new
            parents: list[int | None] = [parent_key]
            parents += keys[:-1]
            _consume(map(self.block_key.__setitem__, block_ids, keys))
            _consume(map(self.block_parent.__setitem__, block_ids, parents))
            # the caller hands over fresh lists (slices): keep them rather than copy again
            self._emit(
                BlockStored(keys=keys, parent_key=parent_key, block_size=bs),
                EventMeta(token_ids if len(token_ids) == n * bs else token_ids[: n * bs], lora),
            )
            return
        block_key = self.block_key
        block_parent = self.block_parent
        run_keys: list[int] = []
        run_tokens: list[int] = []
        run_parent = parent_key
        prev = parent_key
        for i, (b, k, owner) in enumerate(zip(block_ids, keys, owners, strict=True)):
            if owner != b:  # already cached elsewhere: this block stays private
                if run_keys:
                    self._emit(
                        BlockStored(keys=run_keys, parent_key=run_parent, block_size=bs),
                        EventMeta(run_tokens, lora),
                    )
                run_keys, run_tokens = [], []
                run_parent = k
                prev = k
                continue
            block_key[b] = k
            block_parent[b] = prev
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
        self.empty.extend(self.lru)
        self.lru.clear()
        self.block_key = [None] * self.num_blocks
        self.block_parent = [None] * self.num_blocks
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
        """The whole cache as BlockStored events, in registration order (so a block comes
        after its parent), each run of blocks registered one after the other along a chain
        merged into one event: a dump costs ~9 bytes per block, not an event per block."""
        bs = self.block_size
        block_parent = self.block_parent
        out: list[BlockStored] = []
        run: list[int] = []
        run_parent: int | None = None
        prev: int | None = None
        for key, b in self.cached.items():  # registration order
            parent = block_parent[b]
            if run and parent is not None and parent == prev:
                run.append(key)
            else:
                if run:
                    out.append(BlockStored(keys=run, parent_key=run_parent, block_size=bs))
                run, run_parent = [key], parent
            prev = key
        if run:
            out.append(BlockStored(keys=run, parent_key=run_parent, block_size=bs))
        return out
