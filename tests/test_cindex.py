"""The compiled index core equals the pure-Python reference (property tests), and its XXH3-64
and chained keys equal the ``xxhash`` package's, bit for bit, on random inputs."""

from __future__ import annotations

import random
import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from services.core import cindex
from services.core.index import PrefixIndex, PyPrefixIndex


def test_extension_is_built_and_selected() -> None:
    """The dev install compiles it; PrefixIndex is then the compiled class."""
    assert cindex.AVAILABLE
    assert PrefixIndex is cindex.CPrefixIndex


@settings(max_examples=400, deadline=None)
@given(data=st.binary(max_size=2100), seed=st.integers(0, 2**64 - 1))
def test_xxh3_64_equals_xxhash(data: bytes, seed: int) -> None:
    from services.core import _cindex

    assert _cindex.xxh3_64(data, seed) == xxhash.xxh3_64_intdigest(data, seed)


def test_xxh3_64_every_length_path() -> None:
    """Every length class of XXH3 (0, 1-3, 4-8, 9-16, 17-128, 129-240, long, multi-block)."""
    from services.core import _cindex

    rng = random.Random(1)
    for n in [*range(0, 260), 1023, 1024, 1025, 2047, 4096, 5000]:
        data = rng.randbytes(n)
        for seed in (0, rng.getrandbits(64), rng.getrandbits(32)):
            assert _cindex.xxh3_64(data, seed) == xxhash.xxh3_64_intdigest(data, seed), (n, seed)


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=300),
    block_size=st.integers(1, 70),
    seed=st.integers(0, 2**64 - 1),
)
def test_chain_keys_equal_the_definition(tokens: list[int], block_size: int, seed: int) -> None:
    h, expect = seed, []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        h = xxhash.xxh3_64_intdigest(struct.pack(f"<{block_size}I", *block), h)
        expect.append(h)
    assert cindex.chain_keys(tokens, block_size, seed) == expect
    packed = struct.pack(f"<{len(tokens)}I", *tokens)
    assert cindex.chain_keys(packed, block_size, seed) == expect


def test_chain_keys_bad_tokens_are_clear_errors() -> None:
    with pytest.raises(OverflowError):
        cindex.chain_keys([1, -1] * 8, 16, 0)
    with pytest.raises(OverflowError):
        cindex.chain_keys([2**32] * 16, 16, 0)
    with pytest.raises(TypeError):
        cindex.chain_keys([1.5] * 16, 16, 0)
    with pytest.raises(ValueError):
        cindex.chain_keys([1] * 16, 0, 0)


# ------------------------------------------------------------------ index equivalence

KEYS = st.integers(0, 40)  # a small key space: collisions, re-stores and holes are common
WORKER = st.integers(0, 69)  # up to 70 workers: masks wider than one 64-bit word
TIER = st.sampled_from(["gpu", "gpu", "gpu", "cpu", "disk"])
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("store"), WORKER, st.lists(KEYS, max_size=12), TIER),
        st.tuples(
            st.just("remove"),
            WORKER,
            st.lists(KEYS, max_size=12),
            st.sampled_from([None, None, "gpu", "cpu", "disk"]),
        ),
        st.tuples(st.just("clear"), WORKER),
        st.tuples(st.just("drop"), st.lists(KEYS, max_size=6)),
        st.tuples(st.just("find"), st.lists(KEYS, max_size=12)),
        st.tuples(st.just("snapshot")),
    ),
    max_size=60,
)


def _key(k: int) -> int:
    """Spread small ints over uint64 (high bit included) so the table's hashing is exercised."""
    return (k * 0x9E3779B97F4A7C15 + 12345) & ((1 << 64) - 1)


def _same(a, b, keys: list[int], workers: list[str]) -> None:
    assert len(a) == len(b)
    assert a.workers() == b.workers()
    assert a.find_matches(keys) == b.find_matches(keys)
    assert a.find_matches_by_tier(keys) == b.find_matches_by_tier(keys)
    for w in workers:
        assert a.blocks_of(w) == b.blocks_of(w)
    for k in keys[:8]:
        for w in workers[:8]:
            assert a.tiers_of(w, k) == b.tiers_of(w, k)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, cap=st.sampled_from([None, None, 12, 40]), tiers=st.booleans())
def test_compiled_index_equals_reference(ops: list, cap: int | None, tiers: bool) -> None:
    _run_both(ops, cap, tiers, preload=0, n_workers=70)


WIDE_WORKER = st.integers(0, 299)
WIDE_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("store"), WIDE_WORKER, st.lists(KEYS, max_size=12), TIER),
        st.tuples(
            st.just("remove"),
            WIDE_WORKER,
            st.lists(KEYS, max_size=12),
            st.sampled_from([None, None, "gpu", "cpu", "disk"]),
        ),
        st.tuples(st.just("clear"), WIDE_WORKER),
        st.tuples(st.just("drop"), st.lists(KEYS, max_size=6)),
        st.tuples(st.just("find"), st.lists(KEYS, max_size=12)),
        st.tuples(st.just("snapshot")),
        # one key gets 1..6 holders in a row: crosses the inline (<= 3) / pooled threshold
        st.tuples(st.just("spread"), KEYS, WIDE_WORKER, st.integers(1, 6)),
        st.tuples(st.just("unspread"), KEYS, WIDE_WORKER, st.integers(1, 6)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=WIDE_OPS,
    cap=st.sampled_from([None, None, 60, 400]),
    tiers=st.booleans(),
    preload=st.sampled_from([0, 65, 130, 300]),
)
def test_compiled_index_equals_reference_wide(
    ops: list, cap: int | None, tiers: bool, preload: int
) -> None:
    """Up to 300 workers: holder sets inline (<= 3 slots) and pooled (more), the switch from
    the one-word bitmask when slot 64 is first used (preload), and back and forth across the
    inline threshold as holders come and go."""
    _run_both(ops, cap, tiers, preload=preload, n_workers=300)


def _run_both(ops: list, cap: int | None, tiers: bool, preload: int, n_workers: int) -> None:
    ref = PyPrefixIndex(max_blocks=cap, record_evictions=True)
    got = cindex.CPrefixIndex(max_blocks=cap, record_evictions=True)
    all_keys = [_key(k) for k in range(41)]
    workers = [f"w{i}" for i in range(n_workers)]
    for i in range(preload):  # slots 0..preload-1, each key with ~preload/41 holders
        for idx in (ref, got):
            idx.apply_stored(workers[i], [_key(i * 7 % 41)])
        assert got.take_evicted() == ref.take_evicted()
    for i in range(0, preload, 3):  # free every third slot (reused by later stores)
        assert got.clear_worker(workers[i]) == ref.clear_worker(workers[i])
    if preload:
        _same(got, ref, all_keys, workers)
    for op in ops:
        kind = op[0]
        if kind in ("spread", "unspread"):
            k, first, n = _key(op[1]), op[2], op[3]
            for w in workers[first : first + n]:
                if kind == "spread":
                    assert got.apply_stored(w, [k]) == ref.apply_stored(w, [k])
                    assert got.take_evicted() == ref.take_evicted()
                else:
                    assert got.apply_removed(w, [k]) == ref.apply_removed(w, [k])
        elif kind == "store":
            ks = [_key(k) for k in op[2]]
            tier = op[3] if tiers else "gpu"
            assert got.apply_stored(workers[op[1]], ks, tier) == ref.apply_stored(
                workers[op[1]], ks, tier
            )
            assert got.take_evicted() == ref.take_evicted()
            assert got.evicted_pairs == ref.evicted_pairs
        elif kind == "remove":
            ks = [_key(k) for k in op[2]]
            tier = op[3] if tiers else None
            assert got.apply_removed(workers[op[1]], ks, tier) == ref.apply_removed(
                workers[op[1]], ks, tier
            )
        elif kind == "clear":
            assert got.clear_worker(workers[op[1]]) == ref.clear_worker(workers[op[1]])
        elif kind == "drop":
            ks = [_key(k) for k in op[1]]
            assert got.remove_keys(ks) == ref.remove_keys(ks)
        elif kind == "find":
            ks = [_key(k) for k in op[1]]
            assert got.find_matches(ks) == ref.find_matches(ks)
        else:  # a snapshot round trip through each other's export format
            state = ref.export_state()
            got = cindex.CPrefixIndex.from_state(state, max_blocks=cap, record_evictions=True)
            got.evicted_pairs = ref.evicted_pairs  # a counter of the process, not the state
            # the same snapshot loaded a few rows per step into a fresh index, which an index
            # with other content then adopts (a replica's load while it keeps answering)
            fresh = cindex.CPrefixIndex(max_blocks=cap, record_evictions=True)
            steps = sum(1 for _ in fresh.load_steps(state, rows=3))
            wide = state.pair_slots is not None and len(state.keys) > 3
            assert steps == (2 * ((len(state.keys) + 2) // 3) if wide else 0)  # touch + fill
            live = cindex.CPrefixIndex(max_blocks=cap, record_evictions=True)
            live.apply_stored("gone", [_key(1), _key(2)])
            live.adopt(fresh)
            live.evicted_pairs = ref.evicted_pairs
            _same(live, ref, all_keys, [*workers, "gone"])
            ref2 = PyPrefixIndex.from_state(
                got.export_state(), max_blocks=cap, record_evictions=True
            )
            _same(ref2, ref, all_keys, workers)
        _same(got, ref, all_keys, workers)
        if got._t.width > 1:  # wide: a pool entry for exactly the keys with > 3 holders
            assert got._t.pooled == sum(m.bit_count() > 3 for m in ref._masks.values())
    for w in workers[:12] + workers[60:70] + workers[-5:]:
        assert got.pairs_of(w) == ref.pairs_of(w)
        g, r = got.gpu_keys_of(w), ref.gpu_keys_of(w)
        if r is not None:
            assert g is not None and g.tolist() == r.tolist()
    if cap is not None:  # the LRU order is part of the contract when a cap is set
        while ref.maintain(1 << 30):
            pass
        assert got.keys() == ref.keys()


@settings(max_examples=100, deadline=None)
@given(
    stored=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 40)), min_size=1, max_size=12),
    prompt_blocks=st.integers(0, 40),
    seed=st.integers(0, 2**64 - 1),
    block_size=st.sampled_from([1, 4, 16, 64]),
)
def test_match_prompt_equals_reference(
    stored: list[tuple[int, int]], prompt_blocks: int, seed: int, block_size: int
) -> None:
    rng = random.Random(prompt_blocks * 31 + block_size)
    toks = [rng.randrange(2**32) for _ in range(prompt_blocks * block_size + 3)]
    keys = cindex.chain_keys(toks, block_size, seed)
    ref, got = PyPrefixIndex(), cindex.CPrefixIndex()
    for w, n in stored:
        ref.apply_stored(f"w{w}", keys[:n])
        got.apply_stored(f"w{w}", keys[:n])
    assert got.match_prompt(toks, block_size, seed) == ref.match_prompt(toks, block_size, seed)
    assert got.match_prompt(toks, block_size, seed) == got.find_matches(keys)


def test_cap_with_many_workers_keeps_pairs_under_the_cap() -> None:
    idx = cindex.CPrefixIndex(max_blocks=5_000, record_evictions=True)
    rng = random.Random(2)
    for _ in range(3_000):
        idx.apply_stored(f"w{rng.randrange(100)}", [rng.getrandbits(64) for _ in range(16)])
        assert len(idx) <= 5_000
    assert idx.evicted_pairs == 3_000 * 16 - len(idx)
    assert len(idx.take_evicted()) == idx.evicted_pairs  # one holder per key here
