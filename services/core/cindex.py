"""CPrefixIndex: the prefix index over the compiled key table (services/core/_cindex.c).

Same API and same results as the pure-Python :class:`services.core.index.PyPrefixIndex`, which
stays the reference (tests/test_cindex.py checks both against each other on random operation
sequences). What moves to C:

- the key -> worker-slot-set table (open addressing, 16 bytes per key: the key and a holder
  word, which is the slot bitmask up to 64 slots and, past 64, up to 3 slot ids inline or a
  pooled bitmask for keys with more holders; instead of a dict entry and an int object),
  per-slot pair counts and the live-slot mask;
- the hot loops: ``apply_stored`` / ``apply_removed`` on GPU-only indexes, ``remove_keys``,
  ``find_matches`` and ``match_prompt`` (token ids -> chained XXH3-64 keys -> per-worker
  overlap in one C call, hashing block by block and stopping at the first block nobody holds);
- LRU order for the ``max_blocks`` cap (a touch log, kept only when a cap is set).

What stays here: worker names <-> slots, the sparse tier map (keys held on CPU/disk tiers are
rare; their edits go key by key through ``get``/``put``) and the evicted-key list.

One difference in cost, not in results: :meth:`clear_worker` scrubs the worker's slot from
the table at once (one C pass over the table), so :meth:`maintain` has nothing to do.

If the extension was not built (no C compiler at install time), ``AVAILABLE`` is False,
one warning is logged, and :data:`services.core.index.PrefixIndex` is the pure-Python class.
``KVGATE_INDEX_COMPILED=0`` selects the pure-Python class on purpose.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from services.core.index_common import LOAD_STEP_ROWS, TIER_BIT, IndexQueries

try:
    from services.core import _cindex

    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the build
    _cindex = None
    AVAILABLE = False
    logging.getLogger("kvgate.core").warning(
        "compiled index core not built (services.core._cindex is missing: no C compiler at "
        "install time?); using the pure-Python index: same results, slower"
    )

if TYPE_CHECKING:
    from services.core.index import IndexState

_M64 = (1 << 64) - 1


def enabled() -> bool:
    """Whether :data:`services.core.index.PrefixIndex` should be the compiled class."""
    return AVAILABLE and os.environ.get("KVGATE_INDEX_COMPILED", "1") not in ("0", "false", "no")


def chain_keys(token_ids, block_size: int, seed: int, max_blocks: int = -1) -> list[int]:
    """services.core.keys.block_keys in C (same keys; raises the same errors)."""
    return _cindex.chain_keys(token_ids, block_size, seed, max_blocks)


class CPrefixIndex(IndexQueries):
    """See :class:`services.core.index.PyPrefixIndex` for the contract (identical)."""

    def __init__(self, max_blocks: int | None = None, record_evictions: bool = False) -> None:
        if max_blocks is not None and max_blocks <= 0:
            raise ValueError("max_blocks must be > 0 (or None for no cap)")
        if _cindex is None:  # pragma: no cover - guarded by the selection in index.py
            raise ImportError("services.core._cindex is not built")
        self.max_blocks = max_blocks
        self.record_evictions = record_evictions
        self._t = _cindex.KeyTable(track_lru=max_blocks is not None)
        self._tiers: dict[int, int] = {}
        self._slot_of: dict[str, int] = {}
        self._names: list[str | None] = []  # slot -> worker (None: free)
        self._free: list[int] = []
        self.evicted_pairs = 0
        self.evicted: list[int] = []

    # ------------------------------------------------------------------ introspection
    def __len__(self) -> int:
        return self._t.pairs

    @property
    def num_keys(self) -> int:
        return len(self._t)

    @property
    def nbytes(self) -> int:
        """Bytes held by the C table's arrays."""
        return self._t.nbytes

    def keys(self) -> list[int]:
        """Every stored key (least recently stored first when a cap is set)."""
        return self._t.keys()

    def workers(self) -> set[str]:
        return {w for w, s in self._slot_of.items() if self._t.count(s)}

    def blocks_of(self, worker: str) -> int:
        s = self._slot_of.get(worker)
        return 0 if s is None else self._t.count(s)

    def holds(self, worker: str, key: int) -> bool:
        s = self._slot_of.get(worker)
        return s is not None and bool(self._t.get(key) >> s & 1)

    def tiers_of(self, worker: str, key: int) -> tuple[str, ...]:
        s = self._slot_of.get(worker)
        if s is None or not self._t.get(key) >> s & 1:
            return ()
        cur = self._tiers.get(key, 0) >> (3 * s) & 7 or 1
        tb = TIER_BIT
        return tuple(t for t in tb if cur & tb[t])

    def _held(self, s: int):
        """The keys slot ``s`` holds, as a numpy uint64 array (table order)."""
        import numpy as np

        return np.frombuffer(self._t.held(s), dtype=np.uint64)

    def pairs_of(self, worker: str) -> dict[int, int]:
        """Every key ``worker`` holds -> its tier bits (gpu=1, cpu=2, disk=4). One pass over
        the table: for resync diffs and convergence checks, not for the request path."""
        s = self._slot_of.get(worker)
        if s is None:
            return {}
        held = self._held(s).tolist()
        tiers = self._tiers
        if not tiers:
            return dict.fromkeys(held, 1)
        sh = 3 * s
        return {k: (tiers.get(k, 0) >> sh & 7 or 1) for k in held}

    def gpu_keys_of(self, worker: str):
        """The keys ``worker`` holds as a sorted numpy uint64 array when all are on GPU only;
        None otherwise (use :meth:`pairs_of`)."""
        import numpy as np

        s = self._slot_of.get(worker)
        if s is None:
            return np.empty(0, dtype=np.uint64)
        sh = 3 * s
        if any(t >> sh & 7 for t in self._tiers.values()):
            return None
        held = self._held(s).copy()
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
        else:
            s = len(self._names)
            self._names.append(worker)
        self._slot_of[worker] = s
        self._t.set_live(s, True)
        return s

    # ------------------------------------------------------------------ mutation
    def apply_stored(self, worker: str, keys: Iterable[int], tier: str = "gpu") -> int:
        s = self._slot(worker)
        if tier == "gpu" and not self._tiers:
            added = self._t.store(keys, s)
        else:
            added = self._store_tiered(s, keys, tier)
        if self.max_blocks is not None and self._t.pairs > self.max_blocks:
            self._prune()
        return added

    def _store_tiered(self, s: int, keys: Iterable[int], tier: str) -> int:
        """The reference's tier-aware store, key by key (tiers are rare)."""
        t_ = self._t
        tiers = self._tiers
        bit = 1 << s
        sh = 3 * s
        added = 0
        if tier == "gpu":
            for k in keys:
                m = t_.get(k)
                if not m & bit:
                    added += 1
                    m |= bit
                    t = tiers.get(k)
                    if t is not None and t >> sh & 7:
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
                t_.put(k, m, True)
        else:
            tb = TIER_BIT[tier]
            clear = ~(7 << sh)
            for k in keys:
                m = t_.get(k)
                t = tiers.get(k, 0)
                if not m & bit:
                    added += 1
                    m |= bit
                    t = (t & clear) | (tb << sh)
                else:
                    cur = t >> sh & 7 or 1
                    t = (t & clear) | ((cur | tb) << sh)
                t_.put(k, m, True)
                tiers[k] = t
        t_.adjust(s, added)
        return added

    def apply_removed(self, worker: str, keys: Iterable[int], tier: str | None = None) -> int:
        s = self._slot_of.get(worker)
        if s is None:
            return 0
        if tier is None and not self._tiers:
            return self._t.remove(keys, s)
        t_ = self._t
        tiers = self._tiers
        bit = 1 << s
        sh = 3 * s
        clear = ~(7 << sh)
        tb = TIER_BIT[tier] if tier is not None else 7
        removed = 0
        for k in keys:
            m = t_.get(k)
            if not m & bit:
                continue
            t = tiers.get(k) if tiers else None
            if t is not None:
                cur = t >> sh & 7 or 1
                if not cur & tb:
                    continue
                cur &= ~tb
                t &= clear
                if cur:
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
            elif not tb & 1:
                continue
            t_.put(k, m & ~bit, False)
            removed += 1
        t_.adjust(s, -removed)
        return removed

    def remove_keys(self, keys: Iterable[int]) -> int:
        if not isinstance(keys, (list, tuple)):
            keys = list(keys)
        removed = self._t.drop(keys)
        if self._tiers:
            for k in keys:
                self._tiers.pop(k, None)
        return removed

    def clear_worker(self, worker: str) -> int:
        s = self._slot_of.pop(worker, None)
        if s is None:
            return 0
        n = self._t.clear_slot(s)
        if self._tiers:
            keep = ~(7 << (3 * s))
            for k, t in list(self._tiers.items()):
                if t >> (3 * s) & 7:
                    t &= keep
                    if t and self._t.get(k):
                        self._tiers[k] = t
                    else:
                        del self._tiers[k]
        self._names[s] = None
        self._free.append(s)
        return n

    def maintain(self, budget: int = 65_536) -> bool:
        """Nothing to do: clear_worker scrubs at once. Kept for the common API."""
        return False

    def _prune(self) -> None:
        assert self.max_blocks is not None
        target = self.max_blocks - self.max_blocks // 64
        before = self._t.pairs
        victims = self._t.prune(target)
        if self._tiers:
            for k in victims:
                self._tiers.pop(k, None)
        self.evicted_pairs += before - self._t.pairs
        if self.record_evictions:
            self.evicted.extend(victims)

    # ------------------------------------------------------------------ queries
    def find_matches(self, keys: Sequence[int]) -> dict[str, int]:
        return self._t.find(keys, self._names)

    def match_prompt(
        self, token_ids: Sequence[int], block_size: int, seed: int = 0
    ) -> dict[str, int]:
        return self._t.match(token_ids, block_size, seed, self._names)

    # ------------------------------------------------------------------ snapshots
    def export_state(self) -> IndexState:
        import numpy as np

        from services.core.index import IndexState

        tiers = self._tiers
        pair_slots = None
        if self._t.width == 1:  # up to 64 slots: one mask word per key
            keys_b, words = self._t.export()
            masks = [np.frombuffer(w, dtype=np.uint64) for w in words]
        else:  # wide: one row per pair (a key's holders are few; W words each would not be)
            keys_b, slots_b = self._t.export_pairs()
            masks = []
            pair_slots = np.frombuffer(slots_b, dtype=np.uint32)
        return IndexState(
            slots=[w or "" for w in self._names],
            counts=[self._t.count(s) if w else 0 for s, w in enumerate(self._names)],
            keys=np.frombuffer(keys_b, dtype=np.uint64),
            masks=masks,
            tier_keys=np.fromiter(tiers.keys(), dtype=np.uint64, count=len(tiers)),
            tier_values=list(tiers.values()),
            pair_slots=pair_slots,
        )

    @classmethod
    def from_state(
        cls, state: IndexState, max_blocks: int | None = None, record_evictions: bool = False
    ) -> CPrefixIndex:
        idx = cls(max_blocks=max_blocks, record_evictions=record_evictions)
        idx.load_state(state)
        return idx

    def load_state(self, state: IndexState) -> None:
        for _ in self.load_steps(state):
            pass

    def load_steps(self, state: IndexState, rows: int = LOAD_STEP_ROWS) -> Iterator[None]:
        """:meth:`load_state` in steps: a generator, the content complete once it is exhausted;
        a snapshot in the pair form (past 64 workers) is loaded ``rows`` (key, slot) rows per
        step, for a caller that lets its event loop run between steps (10 M pairs at once hold
        it ~0.4 s)."""
        import numpy as np

        keys = np.ascontiguousarray(np.asarray(state.keys, dtype=np.uint64))
        if state.pair_slots is not None:
            slots = np.ascontiguousarray(np.asarray(state.pair_slots, dtype=np.uint32))
            n = len(keys)
            if n <= rows:
                self._t.load_pairs(keys, slots)
            else:  # sized once for every key and slot, its pages touched, then filled
                total = int(np.count_nonzero(keys[1:] != keys[:-1])) + 1
                top = int(slots.max())
                self._t.load_pairs(keys[:0], slots[:0], False, total, top)
                parts = -(-n // rows)
                for i in range(parts):
                    self._t.prefault(i, parts)
                    yield
                for a in range(0, n, rows):
                    self._t.load_pairs(keys[a : a + rows], slots[a : a + rows], True)
                    yield
        else:
            words = [np.ascontiguousarray(np.asarray(w, dtype=np.uint64)) for w in state.masks]
            self._t.load(keys, words)
        self._tiers = {}
        if state.tier_keys is not None and len(state.tier_values):
            tk = state.tier_keys
            tk = tk.tolist() if hasattr(tk, "tolist") else list(tk)
            self._tiers = dict(zip(tk, state.tier_values, strict=True))
        self._names = [w or None for w in state.slots]
        self._slot_of = {}
        self._free = []
        self.evicted = []
        for s, w in enumerate(self._names):
            if w:
                self._slot_of[w] = s
                self._t.set_live(s, True)
            else:
                if self._t.count(s):  # bits of a free slot (not in export_state's output)
                    self._t.clear_slot(s)
                self._free.append(s)
