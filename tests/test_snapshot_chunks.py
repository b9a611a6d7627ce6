"""Snapshots through the wire format (services/core/snapshot.py): an index exported, cut into
SnapshotChunk messages under a byte budget, msgpack-encoded, decoded and reassembled equals
the original, in the mask form (<= 64 slots) and the pair form (more), between both index
implementations; malformed chunk sets are refused instead of loading a partial index."""

from __future__ import annotations

import random

import numpy as np
import pytest

from services.common.schemas import SnapshotChunk, decode, encode
from services.core import cindex
from services.core.index import PyPrefixIndex
from services.core.snapshot import chunks_to_state, state_to_chunks

IMPLS = [PyPrefixIndex, cindex.CPrefixIndex]


def _build(cls, workers: int, rng: random.Random):
    idx = cls()
    chains = [[rng.getrandbits(64) for _ in range(rng.randint(1, 12))] for _ in range(60)]
    for i in range(workers):
        for c in rng.sample(chains, 3):
            idx.apply_stored(f"w{i}", c, rng.choice(["gpu", "gpu", "cpu"]))
    for i in range(0, workers, 7):
        idx.clear_worker(f"w{i}")  # free slots in the table
    return idx, chains


def _wire(idx, max_chunk_bytes: int) -> list[SnapshotChunk]:
    chunks = state_to_chunks(idx.export_state(), "e1", "s1", 41, max_chunk_bytes)
    out = []
    for ch in chunks:
        raw = encode(ch)
        assert len(raw) <= max_chunk_bytes
        out.append(decode(SnapshotChunk, raw))
    return out


@pytest.mark.parametrize("src", IMPLS)
@pytest.mark.parametrize("dst", IMPLS)
@pytest.mark.parametrize("workers", [10, 64, 65, 300])
def test_round_trip_through_chunks(src, dst, workers: int) -> None:
    rng = random.Random(workers)
    idx, chains = _build(src, workers, rng)
    chunks = _wire(idx, 16 * 1024)
    assert len(chunks) > 1
    state = chunks_to_state(list(reversed(chunks)))  # any arrival order
    assert (state.pair_slots is not None) == (workers > 64)
    copy = dst.from_state(state)
    assert len(copy) == len(idx) and copy.workers() == idx.workers()
    for w in idx.workers():
        assert copy.blocks_of(w) == idx.blocks_of(w)
        assert copy.pairs_of(w) == idx.pairs_of(w)
    for c in chains:
        assert copy.find_matches(c) == idx.find_matches(c)
        assert copy.find_matches_by_tier(c) == idx.find_matches_by_tier(c)
    copy.apply_stored("new", chains[0])  # takes a free slot
    assert copy.find_matches(chains[0])["new"] == len(chains[0])


def test_pair_form_is_smaller_than_masks_for_wide_namespaces() -> None:
    """300 workers, one holder per key: 12 bytes per pair instead of 8 + 5 * 8 per key."""
    idx = cindex.CPrefixIndex()
    rng = random.Random(3)
    for i in range(300):
        idx.apply_stored(f"w{i}", [rng.getrandbits(64) for _ in range(100)])
    state = idx.export_state()
    assert state.masks == [] and len(state.pair_slots) == len(idx) == 30_000
    wire = sum(len(ch.keys) + len(ch.pair_slots or b"") for ch in _wire(idx, 1 << 20))
    assert wire == 12 * 30_000


def test_malformed_pair_chunks_are_refused() -> None:
    idx, _ = _build(cindex.CPrefixIndex, 100, random.Random(5))
    chunks = _wire(idx, 16 * 1024)
    with pytest.raises(ValueError, match="incomplete"):
        chunks_to_state(chunks[:-1])
    bad = list(chunks)
    bad[0] = SnapshotChunk(**{**_fields(bad[0]), "pair_slots": None, "masks": [bad[0].keys]})
    with pytest.raises(ValueError):
        chunks_to_state(bad)
    short = list(chunks)
    short[0] = SnapshotChunk(**{**_fields(short[0]), "pair_slots": short[0].pair_slots[:-4]})
    with pytest.raises(ValueError, match="differ in length"):
        chunks_to_state(short)
    far = list(chunks)
    slots = np.frombuffer(far[0].pair_slots, dtype="<u4").copy()
    slots[0] = len(far[0].slots)
    far[0] = SnapshotChunk(**{**_fields(far[0]), "pair_slots": slots.tobytes()})
    with pytest.raises(ValueError, match="outside the slot table"):
        chunks_to_state(far)


def _fields(ch: SnapshotChunk) -> dict:
    return {f: getattr(ch, f) for f in ch.__struct_fields__}


@pytest.mark.parametrize("dst", IMPLS)
def test_mask_form_past_64_slots_still_loads(dst) -> None:
    """What an indexer from before the pair form sends for > 64 slots: 2 mask words per key."""
    from services.core.index import IndexState

    rng = random.Random(8)
    idx, chains = _build(PyPrefixIndex, 100, rng)
    pairs = idx.export_state()
    keys: dict[int, int] = {}
    for k, s in zip(pairs.keys.tolist(), pairs.pair_slots.tolist(), strict=True):
        keys[k] = keys.get(k, 0) | 1 << s
    m64 = (1 << 64) - 1
    masks = [np.array([m >> (64 * w) & m64 for m in keys.values()], np.uint64) for w in (0, 1)]
    state = IndexState(
        slots=pairs.slots,
        counts=pairs.counts,
        keys=np.array(list(keys), np.uint64),
        masks=masks,
        tier_keys=pairs.tier_keys,
        tier_values=pairs.tier_values,
    )
    copy = dst.from_state(state)
    assert len(copy) == len(idx) and copy.workers() == idx.workers()
    for c in chains:
        assert copy.find_matches_by_tier(c) == idx.find_matches_by_tier(c)
