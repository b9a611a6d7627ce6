"""A C hash map that mirrors :class:`PrefixIndex`'s key -> mask dict, for batch lookups.

Why: a prompt's overlap needs one lookup per block (256 for a 4096-token prompt). A CPython
dict lookup among a million int keys costs about three cache misses (index slot, entry, the
key's int object) taken one after another; khash (through cykhash) keeps keys and values in
flat int64 arrays and looks up a whole buffer of keys in one C loop, where the misses of
consecutive lookups overlap: about 3x cheaper per block (figures in docs/kv-index.md).

Representation (the invariant :class:`PrefixIndex` keeps for every key of its dict):
- key ``k`` (uint64) is stored as its two's-complement int64, ``(k ^ SIGN) - SIGN`` -- the
  same bits an ``array('Q')`` of keys shows when reinterpreted as ``array('q')``, so a query
  converts its keys without a Python operation per key;
- a mask below ``2**63`` is stored as is; a wider one (slot 63 and up) as :data:`SPILL`,
  which means "read the dict" (masks are never negative, so SPILL is unambiguous);
- a key absent from the dict is absent from the map.

Optional: cykhash ships as source only (it needs a C compiler). Without it ``AVAILABLE`` is
False and the index keeps the dict alone, with the same results; ``KVGATE_INDEX_FASTMAP=0``
turns the mirror off on purpose.
"""

from __future__ import annotations

import os
from array import array

try:
    import cykhash as _cykhash

    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the optional install
    _cykhash = None
    AVAILABLE = False

SIGN = 1 << 63
SPILL = -SIGN  # stored for masks >= 2**63: the dict holds the real value


def enabled() -> bool:
    """Whether a new index should keep the mirror (installed and not turned off)."""
    return AVAILABLE and os.environ.get("KVGATE_INDEX_FASTMAP", "1") not in ("0", "false", "no")


def new_map(size_hint: int = 0):
    """An empty mirror."""
    if _cykhash is None:  # pragma: no cover - guarded by callers
        raise ImportError("cykhash is not installed (pip install 'kvgate[fast]')")
    if size_hint > 0:
        return _cykhash.Int64toInt64Map(number_of_elements_hint=size_hint)
    return _cykhash.Int64toInt64Map()


def signed_key(k: int) -> int:
    """The int64 a uint64 key is stored as (hot loops inline this expression)."""
    return (k ^ SIGN) - SIGN


def stored_mask(m: int) -> int:
    """The int64 a mask is stored as (hot loops inline this expression)."""
    return m if m < SIGN else SPILL


def from_arrays(keys, masks: list):
    """A mirror of a snapshot: ``keys`` a numpy uint64 array, ``masks`` its 64-bit words
    (least significant first), as in :class:`services.core.index.IndexState`."""
    import numpy as np

    if _cykhash is None:  # pragma: no cover - guarded by callers
        raise ImportError("cykhash is not installed")
    # copies: cykhash wants writable buffers, snapshot arrays are often read-only views
    k = np.array(keys, dtype=np.uint64).view(np.int64)
    low = np.asarray(masks[0], dtype=np.uint64)
    wide = low >= np.uint64(SIGN)
    for word in masks[1:]:
        wide |= np.asarray(word, dtype=np.uint64) != 0
    vals = np.where(wide, np.int64(SPILL), low.view(np.int64)).astype(np.int64)
    return _cykhash.Int64toInt64Map_from_buffers(k, vals, 1.0)


class BatchLookup:
    """Looks up a run of keys in one C call, with a reusable output buffer (not thread-safe,
    like the index that owns it)."""

    __slots__ = ("_out", "_to")

    def __init__(self) -> None:
        self._out = memoryview(array("q", bytes(8 * 256)))
        self._to = _cykhash.Int64toInt64Map_to if _cykhash is not None else None

    def __call__(self, fmap, keys: list[int] | tuple[int, ...]) -> list[int]:
        """The stored masks of the leading keys present in ``fmap``: ``len(result) <
        len(keys)`` means ``keys[len(result)]`` is absent (and the lookup stopped there)."""
        n = len(keys)
        out = self._out
        if len(out) < n:
            out = self._out = memoryview(array("q", bytes(8 * max(n, 2 * len(out)))))
        found = self._to(fmap, memoryview(array("Q", keys)).cast("B").cast("q"), out[:n], True, 0)
        return out[:found].tolist()
