"""PrefixIndex: which worker holds which canonical KV block. Pure, no I/O.

``PrefixIndex`` is the compiled :class:`services.core.cindex.CPrefixIndex` when the C extension
was built, else :class:`PyPrefixIndex` below: the pure-Python reference, with the same API and
the same results (tests/test_cindex.py checks them against each other).

Used by the kv_indexer service (global state), by each router (local replica) and by the
simulator. Keys are canonical chained keys (services.core.keys), so a key identifies a whole
prefix: if a worker holds key k_i of a prompt it is meant to hold k_0..k_i as well (engines
evict leaves first), and :meth:`find_matches` counts, per worker, the leading run of keys held.

Data structure (chosen for CPython speed and memory, see docs/kv-index.md):

- ``_masks: dict[key, int]`` maps a block key to a bitmask of worker *slots* holding it
  (any tier). With <= 8 workers every mask is a cached small int, so a stored key costs one
  dict entry plus its int key (~80 bytes). Dict order is the LRU order: storing a key moves
  it to the end, pruning takes from the front.
- ``_tiers: dict[key, int]`` is sparse: 3 bits per slot (gpu=1, cpu=2, disk=4) for keys where
  some holder has a tier set other than {gpu}. A key absent there is on GPU for every holder.
- Workers get small slot numbers. Clearing a worker is O(1): its slot leaves ``_live`` (every
  query masks with it) and is scrubbed from the dict incrementally by :meth:`maintain` (or at
  once when the index is small); the slot is reused only after it has been scrubbed.

Invariants:
- ``len(index)`` equals the number of live (worker, block) pairs stored;
- ``find_matches(keys)[w]`` is the largest n such that w holds keys[0..n-1] (0 omitted);
- removing a worker removes every pair of that worker (immediately for every query);
- with ``max_blocks`` set, ``len(index) <= max_blocks`` after every call: when a store goes
  over, the least-recently-stored keys are pruned (with all their holders) down to
  ``max_blocks - max_blocks // 64`` and counted in ``evicted_pairs``; with ``record_evictions``
  the pruned keys are kept in ``evicted`` until the owner takes them (to publish them).

API (stable; the implementation may change for speed and memory):
    apply_stored(worker, keys, tier) -> pairs added
    apply_removed(worker, keys, tier) -> pairs removed
    clear_worker(worker) -> pairs removed
    find_matches(keys) -> {worker: matched_blocks}
    match_prompt(token_ids, block_size, seed) -> {worker: matched_blocks}  (lazy hashing)
    find_matches_by_tier(keys) -> {worker: (matched, gpu, cpu, disk)}
    tier_of(worker, key) / tiers_of(worker, key) / workers() / blocks_of(worker) / holds()
    pairs_of(worker) -> {key: tier bits}
    export_state() / PrefixIndex.from_state(state)  (snapshots)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from services.core.index_common import TIER_BIT, IndexQueries
from services.core.keys import block_chunks

_xxh3 = xxhash.xxh3_64_intdigest  # the primitive of services.core.keys, bound for the hot loop

TIERS: tuple[str, ...] = ("gpu", "cpu", "disk")
_M64 = (1 << 64) - 1
SYNC_SCRUB_KEYS = 50_000  # clear_worker scrubs at once below this many keys
LAZY_HEAD_BLOCKS = 16  # match_prompt hashes in stretches of 16, 32, 64, ... blocks
AUTO_SCRUB_KEYS = 2_048  # keys scrubbed per apply_stored while a cleared slot is pending


def _bits(mask: int) -> Iterable[int]:
    """Slot numbers of the set bits of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


_STRETCHES: dict[int, tuple[tuple[int, int], ...]] = {}


def _stretches(n: int) -> tuple[tuple[int, int], ...]:
    """(lo, hi) block ranges 0..n growing by doubling from LAZY_HEAD_BLOCKS."""
    out = _STRETCHES.get(n)
    if out is None:
        bounds, lo, size = [], 0, LAZY_HEAD_BLOCKS
        while lo < n:
            bounds.append((lo, min(n, lo + size)))
            lo += size
            size *= 2
        out = tuple(bounds)
        if len(_STRETCHES) < 65_536:
            _STRETCHES[n] = out
    return out


def _stretch_chunks(token_ids: Sequence[int], block_size: int, n: int) -> Iterator[tuple]:
    """The first ``n`` blocks of ``token_ids`` as uint32 chunks, in the stretches of
    :func:`_stretches`. A token list is converted stretch by stretch for the first two, then
    all the rest at once (one ``struct.pack`` of the rest is cheaper than one per stretch):
    a prompt that misses early converts little, a fully cached one converts in three calls."""
    bounds = _stretches(n)
    if isinstance(token_ids, list) and len(bounds) > 2:
        for lo, hi in bounds[:2]:
            yield block_chunks(token_ids[lo * block_size : hi * block_size], block_size, hi - lo)
        mid = bounds[1][1]
        rest = block_chunks(token_ids[mid * block_size : n * block_size], block_size, n - mid)
        for lo, hi in bounds[2:]:
            yield rest[lo - mid : hi - mid]
    elif isinstance(token_ids, list):
        for lo, hi in bounds:
            yield block_chunks(token_ids[lo * block_size : hi * block_size], block_size, hi - lo)
    else:
        chunks = block_chunks(token_ids, block_size, n)
        if len(bounds) == 1:
            yield chunks
        else:
            for lo, hi in bounds:
                yield chunks[lo:hi]


@dataclass
class IndexState:
    """A consistent copy of an index as flat arrays (what a snapshot carries).

    ``slots[i]`` is the worker in slot i ("" = free); ``counts[i]`` its pairs; ``keys`` and
    ``masks`` are parallel (masks as 64-bit words, least significant word first);
    ``tier_keys`` / ``tier_values`` likewise for the sparse tier map (``tier_values`` holds
    Python ints, 3 bits per slot). Arrays are numpy uint64 arrays or plain lists.

    Past 64 slots the holders travel as pairs instead: ``pair_slots`` (uint32) is set,
    ``masks`` is empty and ``keys`` has one row per (key, slot) pair, a key's rows
    consecutive (12 bytes per pair instead of 8 bytes per 64 slots per key).
    """

    slots: list[str]
    counts: list[int]
    keys: object
    masks: list[object]
    tier_keys: object = None
    tier_values: list[int] = field(default_factory=list)
    pair_slots: object = None


def _assign(mask: int, depth: int, names: list, result: dict[str, int]) -> None:
    """Record ``depth`` for every worker whose slot bit is set in ``mask``. Called only where
    the set of matching workers changes, so it stays off the per-block path."""
    for slot in _bits(mask):
        result[names[slot]] = depth


class PyPrefixIndex(IndexQueries):
    """The pure-Python index (the reference; the fallback when the C extension is absent)."""

    def __init__(self, max_blocks: int | None = None, record_evictions: bool = False) -> None:
        if max_blocks is not None and max_blocks <= 0:
            raise ValueError("max_blocks must be > 0 (or None for no cap)")
        self.max_blocks = max_blocks
        self.record_evictions = record_evictions
        self._masks: dict[int, int] = {}
        self._tiers: dict[int, int] = {}
        self._slot_of: dict[str, int] = {}
        self._names: list[str | None] = []  # slot -> worker (None: free or dirty)
        self._counts: list[int] = []  # slot -> live pairs
        self._free: list[int] = []  # clean, reusable slots
        self._live = 0  # bits of slots in use
        self._dirty = 0  # bits of cleared slots not yet scrubbed from the dict
        self._pairs = 0
        self._scrub_keys: list[int] | None = None
        self._scrub_pos = 0
        self._scrub_mask = 0
        self.evicted_pairs = 0
        self.evicted: list[int] = []

    # ------------------------------------------------------------------ introspection
    def __len__(self) -> int:
        return self._pairs

    @property
    def num_keys(self) -> int:
        """Distinct keys in the dict (including ones awaiting scrub)."""
        return len(self._masks)

    def keys(self) -> list[int]:
        """Every stored key, least recently stored first."""
        return list(self._masks)

    def workers(self) -> set[str]:
        return {w for w, s in self._slot_of.items() if self._counts[s]}

    def blocks_of(self, worker: str) -> int:
        s = self._slot_of.get(worker)
        return 0 if s is None else self._counts[s]

    def holds(self, worker: str, key: int) -> bool:
        s = self._slot_of.get(worker)
        return s is not None and bool(self._masks.get(key, 0) >> s & 1)

    def tiers_of(self, worker: str, key: int) -> tuple[str, ...]:
        """Every tier ``worker`` holds ``key`` on (empty if it does not hold it)."""
        s = self._slot_of.get(worker)
        if s is None or not self._masks.get(key, 0) >> s & 1:
            return ()
        cur = self._tiers.get(key, 0) >> (3 * s) & 7 or 1
        return tuple(t for t in TIERS if cur & TIER_BIT[t])

    def pairs_of(self, worker: str) -> dict[int, int]:
        """Every key ``worker`` holds -> its tier bits (gpu=1, cpu=2, disk=4), in store order.
        One pass over the whole key table (O(keys of every worker)): for resync diffs and the
        convergence check, not for the request path."""
        s = self._slot_of.get(worker)
        if s is None:
            return {}
        bit = 1 << s
        tiers = self._tiers
        if not tiers:
            return {k: 1 for k, m in self._masks.items() if m & bit}
        sh = 3 * s
        return {k: (tiers.get(k, 0) >> sh & 7 or 1) for k, m in self._masks.items() if m & bit}

    def gpu_keys_of(self, worker: str) -> Any:
        """The keys ``worker`` holds as a sorted numpy uint64 array, when every one of them is
        on GPU only (the usual case) and slots fit in 64 bits; None otherwise (use
        :meth:`pairs_of`). About 5x faster than pairs_of over a million keys."""
        import numpy as np

        s = self._slot_of.get(worker)
        if s is None:
            return np.empty(0, dtype=np.uint64)
        if len(self._names) > 64:
            return None
        sh = 3 * s
        if any(t >> sh & 7 for t in self._tiers.values()):
            return None
        d = self._masks
        n = len(d)
        keys = np.fromiter(d.keys(), dtype=np.uint64, count=n)
        masks = np.fromiter(d.values(), dtype=np.uint64, count=n)
        held = keys[(masks >> np.uint64(s)) & np.uint64(1) == 1]
        held.sort()
        return held

    # ------------------------------------------------------------------ slots
    def _slot(self, worker: str) -> int:
        s = self._slot_of.get(worker)
        if s is not None:
            return s
        if self._free:
            self._free.sort()
            s = self._free.pop(0)
            self._names[s] = worker
            self._counts[s] = 0
        else:
            s = len(self._names)
            self._names.append(worker)
            self._counts.append(0)
        self._slot_of[worker] = s
        self._live |= 1 << s
        return s

    # ------------------------------------------------------------------ mutation
    def apply_stored(self, worker: str, keys: Iterable[int], tier: str = "gpu") -> int:
        """Record that ``worker`` stored ``keys`` on ``tier``; returns new pairs."""
        s = self._slot(worker)
        bit = 1 << s
        d = self._masks
        pop = d.pop
        added = 0
        tiers = self._tiers
        if tier == "gpu":
            if not tiers:
                # setdefault inserts a new key (at the end: most recent) in one probe; an
                # existing key is moved to the end (LRU touch) with our bit added
                setdefault = d.setdefault
                n = len(d)
                for k in keys:
                    m = setdefault(k, bit)
                    if len(d) != n:
                        n += 1
                        added += 1
                        continue
                    del d[k]
                    d[k] = m | bit
                    if not m & bit:
                        added += 1
            else:
                sh = 3 * s
                for k in keys:
                    m = pop(k, 0)
                    if not m & bit:
                        added += 1
                        m |= bit
                        t = tiers.get(k)
                        if t is not None and t >> sh & 7:  # stale bits: new pair is gpu only
                            t &= ~(7 << sh)
                            if t:
                                tiers[k] = t
                            else:
                                del tiers[k]
                    else:
                        t = tiers.get(k)
                        if t is not None:
                            cur = t >> sh & 7
                            if cur and not cur & 1:
                                tiers[k] = t | (1 << sh)
                    d[k] = m
        else:
            tb = TIER_BIT[tier]
            sh = 3 * s
            clear = ~(7 << sh)
            for k in keys:
                m = pop(k, 0)
                t = tiers.get(k, 0)
                if not m & bit:
                    added += 1
                    m |= bit
                    t = (t & clear) | (tb << sh)
                else:
                    cur = t >> sh & 7 or 1
                    t = (t & clear) | ((cur | tb) << sh)
                d[k] = m
                tiers[k] = t
        self._counts[s] += added
        self._pairs += added
        if self._dirty:  # amortised scrub of cleared workers, so owners need not call maintain
            self.maintain(AUTO_SCRUB_KEYS)
        if self.max_blocks is not None and self._pairs > self.max_blocks:
            self._prune()
        return added

    def _set_mask(self, k: int, m: int) -> None:
        """Replace an existing key's mask (dropping the key when ``m`` is 0)."""
        if m:
            self._masks[k] = m
        else:
            del self._masks[k]

    def apply_removed(self, worker: str, keys: Iterable[int], tier: str | None = None) -> int:
        """Record that ``worker`` dropped ``keys`` (from ``tier`` only, or from every tier)."""
        s = self._slot_of.get(worker)
        if s is None:
            return 0
        bit = 1 << s
        nbit = ~bit
        d = self._masks
        tiers = self._tiers
        sh = 3 * s
        clear = ~(7 << sh)
        tb = TIER_BIT[tier] if tier is not None else 7
        removed = 0
        for k in keys:
            m = d.get(k)
            if m is None or not m & bit:
                continue
            t = tiers.get(k) if tiers else None
            if t is not None:
                cur = t >> sh & 7 or 1
                if not cur & tb:
                    continue
                cur &= ~tb
                t &= clear
                if cur:  # still held on another tier
                    if cur != 1:
                        t |= cur << sh
                    if t:
                        tiers[k] = t
                    else:
                        del tiers[k]
                    continue
                if t:
                    tiers[k] = t
                else:
                    del tiers[k]
            elif not tb & 1:  # held on gpu only, asked to drop another tier
                continue
            self._set_mask(k, m & nbit)
            removed += 1
        self._counts[s] -= removed
        self._pairs -= removed
        return removed

    def remove_keys(self, keys: Iterable[int]) -> int:
        """Drop ``keys`` from every worker (what pruning does); returns pairs removed."""
        d = self._masks
        tiers = self._tiers
        live = self._live
        counts = self._counts
        removed = 0
        for k in keys:
            m = d.pop(k, None)
            if m is None:
                continue
            if tiers:
                tiers.pop(k, None)
            m &= live
            if m:
                for s in _bits(m):
                    counts[s] -= 1
                removed += m.bit_count()
        self._pairs -= removed
        return removed

    def clear_worker(self, worker: str) -> int:
        """Drop every pair of ``worker`` (O(1) now; the dict is scrubbed later)."""
        s = self._slot_of.pop(worker, None)
        if s is None:
            return 0
        n = self._counts[s]
        self._counts[s] = 0
        self._pairs -= n
        self._names[s] = None
        bit = 1 << s
        self._live &= ~bit
        self._dirty |= bit
        if len(self._masks) <= SYNC_SCRUB_KEYS:
            while self.maintain(1 << 30):
                pass
        return n

    def maintain(self, budget: int = 65_536) -> bool:
        """Scrub cleared slots from up to ``budget`` keys; True while work remains."""
        if self._scrub_keys is None:
            if not self._dirty:
                return False
            self._scrub_mask = self._dirty
            self._scrub_keys = list(self._masks)
            self._scrub_pos = 0
        keys = self._scrub_keys
        end = min(self._scrub_pos + budget, len(keys))
        dead = self._scrub_mask
        keep = ~dead
        tkeep = 0
        for s in _bits(dead):
            tkeep |= 7 << (3 * s)
        tkeep = ~tkeep
        d = self._masks
        tiers = self._tiers
        for i in range(self._scrub_pos, end):
            k = keys[i]
            m = d.get(k)
            if m is None or not m & dead:
                continue
            m &= keep
            self._set_mask(k, m)
            if tiers:
                t = tiers.get(k)
                if t is not None:
                    t &= tkeep
                    if t and m:
                        tiers[k] = t
                    else:
                        del tiers[k]
        self._scrub_pos = end
        if end < len(keys):
            return True
        for s in _bits(dead):
            self._free.append(s)
        self._dirty &= ~dead
        self._scrub_keys = None
        self._scrub_mask = 0
        return bool(self._dirty)

    def _prune(self) -> None:
        """Drop least-recently-stored keys until ``len <= max_blocks - max_blocks // 64``."""
        assert self.max_blocks is not None
        target = self.max_blocks - self.max_blocks // 64
        d = self._masks
        live = self._live
        victims: list[int] = []
        pairs = self._pairs
        for k, m in d.items():
            if pairs <= target:
                break
            victims.append(k)
            pairs -= (m & live).bit_count()
        removed = self.remove_keys(victims)
        self.evicted_pairs += removed
        if self.record_evictions:
            self.evicted.extend(victims)

    # ------------------------------------------------------------------ queries
    def find_matches(self, keys: Sequence[int]) -> dict[str, int]:
        """Per worker, how many leading keys of ``keys`` it holds (workers with 0 omitted)."""
        active = self._live
        if not active:
            return {}
        result: dict[str, int] = {}
        get = self._masks.get
        names = self._names
        depth = 0
        for k in keys:
            m = get(k, 0) & active
            if m != active:
                if depth:
                    _assign(active ^ m, depth, names, result)
                active = m
                if not m:
                    return result
            depth += 1
        if depth:
            _assign(active, depth, names, result)
        return result

    def match_prompt(
        self, token_ids: Sequence[int], block_size: int, seed: int = 0
    ) -> dict[str, int]:
        """``find_matches(block_keys(token_ids, block_size, seed))``, hashing lazily in
        doubling stretches: stops after the stretch where no worker holds a block (so a miss
        costs about twice the hashing it needed, not the whole prompt)."""
        active = self._live
        if not active or block_size <= 0:
            return {}
        n_tokens = len(token_ids)
        if isinstance(token_ids, (bytes, memoryview)):
            n_tokens //= 4
        n = n_tokens // block_size
        if n <= 0:
            return {}
        names = self._names
        result: dict[str, int] = {}
        h = seed
        depth = 0
        xxh3 = _xxh3
        get = self._masks.get
        for chunks in _stretch_chunks(token_ids, block_size, n):
            for chunk in chunks:
                h = xxh3(chunk, h)
                m = get(h, 0) & active
                if m != active:
                    if depth:
                        _assign(active ^ m, depth, names, result)
                    active = m
                    if not m:
                        return result
                depth += 1
        _assign(active, depth, names, result)
        return result

    # ------------------------------------------------------------------ snapshots
    def export_state(self) -> IndexState:
        """Flat arrays of the whole index (scrubs pending clears first)."""
        import numpy as np

        while self.maintain(1 << 30):
            pass
        d = self._masks
        n = len(d)
        nwords = max(1, (len(self._names) + 63) // 64)
        tiers = self._tiers
        if nwords > 1:  # wide: one row per (key, slot) pair
            pk: list[int] = []
            ps: list[int] = []
            for k, m in d.items():
                for s in _bits(m):
                    pk.append(k)
                    ps.append(s)
            return IndexState(
                slots=[w or "" for w in self._names],
                counts=list(self._counts),
                keys=np.array(pk, dtype=np.uint64),
                masks=[],
                tier_keys=np.fromiter(tiers.keys(), dtype=np.uint64, count=len(tiers)),
                tier_values=list(tiers.values()),
                pair_slots=np.array(ps, dtype=np.uint32),
            )
        keys = np.fromiter(d.keys(), dtype=np.uint64, count=n)
        if nwords == 1:
            masks = [np.fromiter(d.values(), dtype=np.uint64, count=n)]
        else:
            masks = [
                np.fromiter(((m >> (64 * w)) & _M64 for m in d.values()), np.uint64, count=n)
                for w in range(nwords)
            ]
        return IndexState(
            slots=[w or "" for w in self._names],
            counts=list(self._counts),
            keys=keys,
            masks=masks,
            tier_keys=np.fromiter(tiers.keys(), dtype=np.uint64, count=len(tiers)),
            tier_values=list(tiers.values()),
        )

    @classmethod
    def from_state(
        cls, state: IndexState, max_blocks: int | None = None, record_evictions: bool = False
    ) -> PyPrefixIndex:
        """A new index holding :meth:`export_state` output (slot numbers are kept)."""
        idx = cls(max_blocks=max_blocks, record_evictions=record_evictions)
        idx.load_state(state)
        return idx

    def load_state(self, state: IndexState) -> None:
        """Replace this index's content, in place, with :meth:`export_state` output."""
        keys = state.keys.tolist() if hasattr(state.keys, "tolist") else list(state.keys)
        if state.pair_slots is not None:
            ps = state.pair_slots
            ps = ps.tolist() if hasattr(ps, "tolist") else list(ps)
            d: dict[int, int] = {}
            for k, s in zip(keys, ps, strict=True):
                d[k] = d.get(k, 0) | 1 << s  # first row of a key fixes its (LRU) position
            self._masks = d
        else:
            words = [w.tolist() if hasattr(w, "tolist") else list(w) for w in state.masks]
            if len(words) == 1:
                masks = words[0]
            else:
                masks = [
                    sum(ws[i] << (64 * i) for i in range(len(ws)))
                    for ws in zip(*words, strict=True)
                ]
            self._masks = {k: m for k, m in zip(keys, masks, strict=True) if m}
        self._tiers = {}
        if state.tier_keys is not None and len(state.tier_values):
            tk = state.tier_keys
            tk = tk.tolist() if hasattr(tk, "tolist") else list(tk)
            self._tiers = dict(zip(tk, state.tier_values, strict=True))
        self._names = [w or None for w in state.slots]
        self._counts = [int(c) for c in state.counts]
        self._slot_of = {}
        self._free = []
        self._live = 0
        self._dirty = 0
        self._scrub_keys = None
        self._scrub_mask = 0
        self.evicted = []
        for s, w in enumerate(self._names):
            if w:
                self._slot_of[w] = s
                self._live |= 1 << s
            else:
                self._counts[s] = 0
                self._free.append(s)
        self._pairs = sum(self._counts)


from services.core import cindex as _cindex_mod  # noqa: E402  (imports nothing from here at load)

PrefixIndex: type[PyPrefixIndex] | type[_cindex_mod.CPrefixIndex] = (
    _cindex_mod.CPrefixIndex if _cindex_mod.enabled() else PyPrefixIndex
)
"""The index class to use: compiled when built (and not turned off), else the reference."""
