"""PrefixIndex against a naive reference model: matches, tiers, lazy clears, LRU cap, snapshots.

Every test runs on both implementations: the pure-Python reference and the compiled core."""

from __future__ import annotations

import random
import sys
from array import array

import pytest

from services.core import cindex
from services.core import index as index_mod
from services.core.index import TIER_BIT, PrefixIndex, PyPrefixIndex
from services.core.keys import block_keys, block_seed


@pytest.fixture(autouse=True, params=["pure", "compiled"])
def index_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``PrefixIndex`` in this module is the pure-Python class, then the compiled one."""
    if request.param == "compiled":
        assert cindex.AVAILABLE, "the C extension must be built to be tested (setup.py)"
        cls = cindex.CPrefixIndex
    else:
        cls = PyPrefixIndex
    monkeypatch.setattr(sys.modules[__name__], "PrefixIndex", cls)
    return request.param


def assert_table_consistent(idx: PrefixIndex) -> None:
    """Every listed key is a distinct stored key."""
    keys = idx.keys()
    assert len(keys) == len(set(keys)) == idx.num_keys


class Model:
    """worker -> key -> set of tiers; the obviously-correct version of the index."""

    def __init__(self) -> None:
        self.held: dict[str, dict[int, set[str]]] = {}

    def stored(self, w: str, keys: list[int], tier: str) -> None:
        mine = self.held.setdefault(w, {})
        for k in keys:
            mine.setdefault(k, set()).add(tier)

    def removed(self, w: str, keys: list[int], tier: str | None) -> None:
        mine = self.held.get(w, {})
        for k in keys:
            tiers = mine.get(k)
            if tiers is None:
                continue
            if tier is None:
                del mine[k]
            elif tier in tiers:
                tiers.discard(tier)
                if not tiers:
                    del mine[k]

    def clear(self, w: str) -> None:
        self.held.pop(w, None)

    def pairs(self) -> int:
        return sum(len(m) for m in self.held.values())

    def matches(self, keys: list[int]) -> dict[str, int]:
        out = {}
        for w, mine in self.held.items():
            n = 0
            while n < len(keys) and keys[n] in mine:
                n += 1
            if n:
                out[w] = n
        return out


def _chains(rng: random.Random, n: int) -> list[list[int]]:
    chains = []
    for _ in range(n):
        base = rng.choice(chains) if chains and rng.random() < 0.5 else []
        cut = rng.randrange(len(base) + 1) if base else 0
        extra = [rng.randrange(1000) for _ in range(16 * rng.randrange(1, 6))]
        keys = block_keys(extra, 16, seed=len(chains))
        if base and cut:
            keys = base[:cut] + block_keys(extra, 16, parent_key=base[cut - 1])
        chains.append(keys)
    return chains


@pytest.mark.parametrize(("seed", "n_workers"), [(1, 11), (2, 11), (3, 11), (4, 70)])
def test_random_ops_match_reference(
    seed: int, n_workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(index_mod, "SYNC_SCRUB_KEYS", 10)  # exercise the lazy scrub path
    rng = random.Random(seed)
    idx, ref = PrefixIndex(), Model()
    chains = _chains(rng, 40)
    # more than 8 workers: masks beyond the small-int cache; 70: masks wider than 64 bits
    # (the mirror's SPILL path)
    workers = [f"w{i}" for i in range(n_workers)]
    for step in range(1500):
        w = rng.choice(workers)
        chain = rng.choice(chains)
        r = rng.random()
        if r < 0.5:
            n = rng.randrange(1, len(chain) + 1)
            tier = rng.choice(["gpu", "gpu", "cpu", "disk"])
            idx.apply_stored(w, chain[:n], tier)
            ref.stored(w, chain[:n], tier)
        elif r < 0.8:
            n = rng.randrange(len(chain))
            tier = rng.choice([None, "gpu", "cpu", "disk"])
            got = idx.apply_removed(w, chain[n:], tier)
            before = ref.pairs()
            ref.removed(w, chain[n:], tier)
            assert got == before - ref.pairs()
        elif r < 0.85:
            assert idx.clear_worker(w) == len(ref.held.get(w, {}))
            ref.clear(w)
        elif r < 0.9:
            idx.maintain(rng.randrange(1, 50))
        q = rng.choice(chains)
        assert idx.find_matches(q) == ref.matches(q), step
        assert len(idx) == ref.pairs()
        if step % 100 == 0:
            assert_table_consistent(idx)
    for w in workers:
        assert idx.blocks_of(w) == len(ref.held.get(w, {}))
        for k, tiers in ref.held.get(w, {}).items():
            assert set(idx.tiers_of(w, k)) == tiers
    assert idx.workers() == {w for w, m in ref.held.items() if m}
    while idx.maintain(7):
        pass
    # after scrubbing, no key survives without a live holder
    assert all(any(idx.holds(w, k) for w in workers) for k in idx.keys())
    assert_table_consistent(idx)


def test_match_prompt_equals_find_matches_of_keys() -> None:
    rng = random.Random(5)
    seed = block_seed(7, lora="ad")
    toks = [rng.randrange(50_000) for _ in range(4096 + 5)]
    keys = block_keys(toks, 16, seed)
    idx = PrefixIndex()
    idx.apply_stored("a", keys)
    idx.apply_stored("b", keys[:100])
    idx.apply_stored("c", keys[1:50])  # holds no leading run
    assert idx.match_prompt(toks, 16, seed) == idx.find_matches(keys) == {"a": 256, "b": 100}
    assert idx.match_prompt(toks, 16, 0) == {}  # another seed: another key space
    assert idx.match_prompt(toks[:15], 16, seed) == {}


def test_keys_follow_the_documented_definition() -> None:
    """xxh3-64 of each block's little-endian uint32 token ids, seeded with the previous key."""
    import struct
    from array import array

    import xxhash

    rng = random.Random(3)
    toks = [rng.randrange(2**32) for _ in range(16 * 9 + 3)]
    seed = block_seed(11, salt="s")
    h, expect = seed, []
    for i in range(9):
        h = xxhash.xxh3_64_intdigest(struct.pack("<16I", *toks[16 * i : 16 * i + 16]), seed=h)
        expect.append(h)
    assert block_keys(toks, 16, seed) == expect
    assert block_keys(array("I", toks), 16, seed) == expect
    assert block_keys(array("I", toks).tobytes(), 16, seed) == expect
    assert block_keys(toks, 16, seed, max_blocks=4) == expect[:4]
    idx = PrefixIndex()
    idx.apply_stored("a", expect[:5])
    assert idx.match_prompt(array("I", toks), 16, seed) == {"a": 5}
    assert idx.match_prompt(array("I", toks).tobytes(), 16, seed) == {"a": 5}


@pytest.mark.parametrize("seed", [4, 5])
def test_match_prompt_property_with_holes(seed: int) -> None:
    rng = random.Random(seed)
    base = [rng.randrange(60_000) for _ in range(16 * 80)]
    keys = block_keys(base, 16)
    idx, ref = PrefixIndex(), Model()
    for w in [f"w{i}" for i in range(10)]:
        n = rng.randrange(len(keys) + 1)
        idx.apply_stored(w, keys[:n])
        ref.stored(w, keys[:n], "gpu")
        if n > 3 and rng.random() < 0.5:  # a hole in the middle of the run
            hole = [keys[rng.randrange(n)]]
            idx.apply_removed(w, hole)
            ref.removed(w, hole, None)
    for _ in range(30):
        cut = rng.randrange(len(base) + 1)
        toks = base[:cut] + [rng.randrange(60_000) for _ in range(rng.randrange(40))]
        assert idx.match_prompt(toks, 16) == ref.matches(block_keys(toks, 16))


def test_tiers_by_block() -> None:
    keys = block_keys(list(range(64)), 16)
    idx = PrefixIndex()
    idx.apply_stored("a", keys[:2])
    idx.apply_stored("a", keys[2:], "cpu")
    idx.apply_stored("a", keys[3:], "disk")
    assert idx.find_matches_by_tier(keys) == {"a": (4, 2, 2, 0)}  # cpu+disk counts as cpu
    assert idx.tier_of("a", keys[3]) == "cpu" and idx.tiers_of("a", keys[3]) == ("cpu", "disk")
    assert idx.apply_removed("a", keys[3:], "cpu") == 0  # still on disk
    assert idx.tier_of("a", keys[3]) == "disk"
    assert idx.apply_removed("a", keys[3:], "disk") == 1
    assert idx.find_matches(keys) == {"a": 3}
    assert TIER_BIT["gpu"] == 1


def test_lru_cap_prunes_least_recently_stored() -> None:
    idx = PrefixIndex(max_blocks=640, record_evictions=True)
    chains = [block_keys([c] * 160, 16, seed=c) for c in range(100)]  # 10 keys each
    for c in chains[:64]:
        idx.apply_stored("a", c)
    assert len(idx) == 640 and idx.evicted_pairs == 0
    idx.apply_stored("a", chains[0])  # refresh chain 0: now most recent
    idx.apply_stored("b", chains[64])  # over the cap -> prune 10 + 640 // 64 oldest
    assert len(idx) <= 640 - 640 // 64
    assert idx.evicted_pairs == 650 - len(idx)
    evicted = idx.take_evicted()
    assert evicted[:10] == chains[1] and chains[0][0] not in evicted
    assert idx.find_matches(chains[0]) == {"a": 10}
    assert idx.find_matches(chains[1]) == {}
    for c in chains[65:]:
        idx.apply_stored("c", c)
        assert len(idx) <= 640
    assert_table_consistent(idx)


def test_snapshot_round_trip_keeps_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_mod, "SYNC_SCRUB_KEYS", 0)
    rng = random.Random(9)
    idx = PrefixIndex()
    chains = _chains(rng, 30)
    for i in range(70):  # 70 slots: masks need two 64-bit words
        for c in rng.sample(chains, 3):
            idx.apply_stored(f"w{i}", c, rng.choice(["gpu", "cpu"]))
    idx.clear_worker("w3")  # a dirty slot: export scrubs it
    state = idx.export_state()
    copy = PrefixIndex.from_state(state)
    assert len(copy) == len(idx) and copy.workers() == idx.workers()
    for c in chains:
        assert copy.find_matches(c) == idx.find_matches(c)
        assert copy.find_matches_by_tier(c) == idx.find_matches_by_tier(c)
    assert_table_consistent(copy)
    copy.apply_stored("new", chains[0])  # reuses the free slot of w3
    assert copy.find_matches(chains[0])["new"] == len(chains[0])


def test_token_ids_outside_uint32_are_a_clear_error() -> None:
    from services.core.keys import tokens_to_bytes

    assert tokens_to_bytes([1, 2**32 - 1]) == array("I", [1, 2**32 - 1]).tobytes()
    idx = PrefixIndex()
    idx.apply_stored("a", block_keys([1] * 16, 16))
    for bad in ([1, -1], [2**32]):
        with pytest.raises(OverflowError):
            block_keys(bad * 16, 16)
        with pytest.raises(OverflowError):
            idx.match_prompt(bad * 16, 16)
    with pytest.raises(TypeError):
        tokens_to_bytes([1, 1.5])
