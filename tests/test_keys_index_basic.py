"""Canonical keys and the prefix index's basic contract."""

from __future__ import annotations

from services.core.index import PrefixIndex
from services.core.keys import block_keys, block_seed, blocks_needed


def test_keys_chain_and_seed() -> None:
    toks = list(range(100))
    k = block_keys(toks, 16)
    assert len(k) == 6  # only full blocks
    assert block_keys(toks[:48], 16) == k[:3]  # equal prefix -> equal keys
    other = toks[:16] + [999] + toks[17:]
    k2 = block_keys(other, 16)
    assert k2[0] == k[0] and all(a != b for a, b in zip(k[1:], k2[1:], strict=True))  # chain
    assert block_keys(toks, 16, seed=block_seed(0, lora="adapter")) != k
    assert block_keys(toks[16:], 16, parent_key=k[0]) == k[1:]
    assert blocks_needed(100, 28, 16) == 8 and blocks_needed(100, 29, 16) == 9


def test_index_matches_leading_run_per_worker() -> None:
    idx = PrefixIndex()
    keys = block_keys(list(range(64)), 16)
    idx.apply_stored("a", keys)
    idx.apply_stored("b", keys[:2])
    assert idx.find_matches(keys) == {"a": 4, "b": 2}
    assert len(idx) == 6
    idx.apply_removed("a", keys[3:])
    assert idx.find_matches(keys) == {"a": 3, "b": 2}
    assert idx.clear_worker("b") == 2
    assert idx.find_matches(keys) == {"a": 3}
    assert len(idx) == 3
