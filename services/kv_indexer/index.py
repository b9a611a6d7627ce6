"""PrefixIndex: which worker holds which canonical KV block. Pure, no I/O.

Used by the kv_indexer service (global state), by each router (local replica) and by the
simulator. Keys are canonical chained keys (services.common.keys), so a key identifies a whole
prefix: if a worker holds key k_i of a prompt it is meant to hold k_0..k_i as well (engines
evict leaves first), and :meth:`find_matches` counts, per worker, the leading run of keys held.

Invariants:
- ``len(index)`` equals the number of (worker, block) pairs stored;
- ``find_matches(keys)[w]`` is the largest n such that w holds keys[0..n-1] (0 omitted);
- removing a worker removes every pair of that worker.

API (stable; the implementation may change for speed and memory):
    apply_stored(worker, keys, tier) -> pairs added
    apply_removed(worker, keys, tier) -> pairs removed
    clear_worker(worker) -> pairs removed
    find_matches(keys) -> {worker: matched_blocks}
    tiers_of(worker, key) / workers()
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self) -> None:
        # key -> {worker: tier}
        self._blocks: dict[int, dict[str, str]] = {}
        # worker -> its keys (for fast worker removal)
        self._by_worker: dict[str, set[int]] = {}
        self._pairs = 0

    def __len__(self) -> int:
        return self._pairs

    def workers(self) -> set[str]:
        return {w for w, ks in self._by_worker.items() if ks}

    def blocks_of(self, worker: str) -> int:
        return len(self._by_worker.get(worker, ()))

    def apply_stored(self, worker: str, keys: Iterable[int], tier: str = "gpu") -> int:
        added = 0
        mine = self._by_worker.setdefault(worker, set())
        for k in keys:
            holders = self._blocks.get(k)
            if holders is None:
                holders = self._blocks[k] = {}
            if worker not in holders:
                added += 1
                mine.add(k)
            holders[worker] = tier
        self._pairs += added
        return added

    def apply_removed(self, worker: str, keys: Iterable[int], tier: str | None = None) -> int:
        removed = 0
        mine = self._by_worker.get(worker)
        if not mine:
            return 0
        for k in keys:
            holders = self._blocks.get(k)
            if holders is None or worker not in holders:
                continue
            if tier is not None and holders[worker] != tier:
                continue
            del holders[worker]
            if not holders:
                del self._blocks[k]
            mine.discard(k)
            removed += 1
        self._pairs -= removed
        return removed

    def clear_worker(self, worker: str) -> int:
        mine = self._by_worker.pop(worker, None)
        if not mine:
            return 0
        for k in mine:
            holders = self._blocks.get(k)
            if holders is not None:
                holders.pop(worker, None)
                if not holders:
                    del self._blocks[k]
        self._pairs -= len(mine)
        return len(mine)

    def tier_of(self, worker: str, key: int) -> str | None:
        holders = self._blocks.get(key)
        return None if holders is None else holders.get(worker)

    def find_matches(self, keys: Sequence[int]) -> dict[str, int]:
        """Per worker, how many leading keys of ``keys`` it holds (workers with 0 omitted)."""
        result: dict[str, int] = {}
        active: set[str] | None = None
        for depth, k in enumerate(keys):
            holders = self._blocks.get(k)
            if not holders:
                break
            active = set(holders) if active is None else active.intersection(holders)
            if not active:
                break
            for w in active:
                result[w] = depth + 1
        return result
