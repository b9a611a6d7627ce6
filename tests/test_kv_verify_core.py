"""Pure parts of the convergence work: pair diffs, resync by difference, keep-alive while the
bus is down, eager resync after it, and the exact-seq verification."""

from __future__ import annotations

import random

from services.common.index_replica import apply_ops
from services.common.schemas import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    IndexCleared,
    IndexRemoved,
    IndexStored,
)
from services.core.index import TIER_BIT, PrefixIndex
from services.kv_indexer.core import IndexerCore
from services.kv_indexer.divergence import (
    apply_events,
    diff_gpu_keys,
    diff_pairs,
    gpu_dump_keys,
    gpu_replay,
    repair_steps,
)
from tests.test_kv_support import batch, chain, hb, stored


def _random_events(rng: random.Random, keys: list[int], n: int) -> list:
    out: list = []
    for _ in range(n):
        ks = rng.sample(keys, rng.randint(1, 6))
        tier = rng.choice(["gpu", "gpu", "cpu", "disk"])
        if rng.random() < 0.6:
            out.append(BlockStored(keys=ks, block_size=16, tier=tier))
        else:
            out.append(BlockRemoved(keys=ks, tier=tier))
    return out


def test_pair_model_matches_the_index_and_repair_reaches_the_target() -> None:
    """apply_events has the index's meaning, and repair_steps turns any index state for a
    worker into any other (the invariant the resync-by-difference relies on)."""
    rng = random.Random(7)
    keys = list(range(1, 40))
    for _ in range(200):
        idx = PrefixIndex()
        idx.apply_stored("other", keys[:10], "cpu")  # another worker's pairs stay untouched
        start = _random_events(rng, keys, 12)
        for ev in start:
            if isinstance(ev, BlockStored):
                idx.apply_stored("w", ev.keys, ev.tier)
            else:
                idx.apply_removed("w", ev.keys, ev.tier)
        actual = apply_events({}, start)
        assert idx.pairs_of("w") == actual
        expected = apply_events({}, _random_events(rng, keys, 12))
        diff = diff_pairs(expected, actual)
        for kind, tier, ks in repair_steps(diff):
            if kind == "removed":
                idx.apply_removed("w", ks, tier)
            else:
                idx.apply_stored("w", ks, tier)
        assert idx.pairs_of("w") == expected
        assert idx.pairs_of("other") == {k: TIER_BIT["cpu"] for k in keys[:10]}
        assert (diff.blocks == 0) == (expected == actual)


def test_resync_applies_the_difference_never_a_clear() -> None:
    core = IndexerCore(max_blocks=None)
    mirror = PrefixIndex()
    a = chain(30, 1)
    core.heartbeat(hb("w"), 0.0)
    core.batch(batch("w", 0, [AllBlocksCleared(), stored(a[:20])]))
    apply_ops(mirror, core.take_ops())
    assert core.batch(batch("w", 2, [stored(a[25:26])])) == ["w"]  # gap
    # the worker really holds a[:18] + a[22:26]: 2 removed, 4 stored, 18 untouched
    core.dump_received("w", batch("w", 1, [AllBlocksCleared(), stored(a[:18]), stored(a[22:25])]))
    ops = core.take_ops()
    assert not any(isinstance(op, IndexCleared) for op in ops)
    assert sum(len(op.keys) for op in ops if isinstance(op, IndexRemoved)) == 2
    assert sum(len(op.keys) for op in ops if isinstance(op, IndexStored)) == 4
    apply_ops(mirror, ops)
    want = {k: 1 for k in a[:18] + a[22:26]}
    assert core.index.pairs_of("w") == mirror.pairs_of("w") == want


def test_workers_are_kept_while_the_bus_is_down_and_resync_at_once_after() -> None:
    core = IndexerCore(max_blocks=None, heartbeat_timeout_s=3.0, tail_grace_s=2.0)
    core.heartbeat(hb("w", kv_seq=0), 0.0)
    core.batch(batch("w", 0, [stored(chain(4, 2))]))
    for t in range(1, 101):  # 10 s of outage, ticking every 100 ms
        core.keep_alive(t / 10)
        assert core.tick(t / 10) == []
    assert "w" in core.workers and core.counts["expired"] == 0
    assert len(core.index) == 4 and not core.take_ops()[1:]  # nothing cleared
    core.bus_restored(10.0)
    # the first heartbeat says batches were lost meanwhile: resync now, no tail grace
    assert core.heartbeat(hb("w", kv_seq=5), 10.4) == ["w"]
    assert core.counts["resync:reconnect"] == 1
    # without the outage the same heartbeat would wait out the tail grace
    calm = IndexerCore(max_blocks=None, tail_grace_s=2.0)
    calm.heartbeat(hb("w", kv_seq=0), 0.0)
    calm.batch(batch("w", 0, []))
    assert calm.heartbeat(hb("w", kv_seq=5), 0.5) == [] and calm.tick(0.6) == []
    # and silence with the bus up still expires
    assert core.tick(14.0) == [] and "w" not in core.workers


def test_verify_waits_for_the_dump_seq_and_replays_later_batches() -> None:
    core = IndexerCore(max_blocks=None)
    a = chain(12, 3)
    core.heartbeat(hb("w"), 0.0)
    core.batch(batch("w", 0, [AllBlocksCleared(), stored(a[:4])]))
    assert core.verify_begin("w")
    dump = batch("w", 1, [AllBlocksCleared(), stored(a[:6])])  # the worker at seq 1
    assert core.verify_check("w", dump) is None  # the index has only seen seq 0
    core.batch(batch("w", 1, [stored(a[4:6], a[3])]))
    core.batch(batch("w", 2, [BlockRemoved(keys=a[5:6])]))  # after the dump
    r = core.verify_check("w", dump)
    assert r is not None and r.status == "equal" and r.worker_blocks == 5
    # the index loses two pairs behind the indexer's back: missing, named
    core.index.apply_removed("w", a[1:3])
    core.index.apply_stored("w", [12345], "cpu")
    r = core.verify_check("w", dump, max_sample=5)
    assert r is not None and r.status == "divergent"
    assert (r.missing, r.extra) == (2, 1)
    assert set(r.missing_sample) == set(a[1:3]) and r.extra_sample == [12345]
    # a resync meanwhile makes the check inconclusive, never a false divergence
    assert core.batch(batch("w", 4, [])) == ["w"]
    core.dump_received("w", batch("w", 3, [AllBlocksCleared(), stored(a[:5])]))
    r = core.verify_check("w", dump)
    assert r is not None and r.status == "inconclusive"
    core.verify_end("w")
    assert core.request_repair("w") == ["w"] and core.counts["verify_repairs"] == 1


def test_gpu_fast_path_agrees_with_the_general_path() -> None:
    rng = random.Random(11)
    keys = [rng.getrandbits(64) for _ in range(60)]  # full uint64 range
    for _ in range(200):
        dump = [AllBlocksCleared()] + [
            BlockStored(keys=rng.sample(keys, rng.randint(1, 8)), block_size=16)
            for _ in range(rng.randint(0, 6))
        ]
        later: list = []
        for _ in range(rng.randint(0, 6)):
            r = rng.random()
            ks = rng.sample(keys, rng.randint(1, 5))
            if r < 0.5:
                later.append(BlockStored(keys=ks, block_size=16))
            elif r < 0.95:
                later.append(BlockRemoved(keys=ks))
            else:
                later.append(AllBlocksCleared())
        expected = apply_events(apply_events({}, dump), later)
        fast = gpu_replay(gpu_dump_keys(dump), later)
        assert sorted(fast.tolist()) == sorted(expected) == fast.tolist()
        idx = PrefixIndex()
        idx.apply_stored("x", rng.sample(keys, 20))
        idx.apply_stored("w", rng.sample(keys, 20))
        actual = idx.pairs_of("w")
        arr = idx.gpu_keys_of("w")
        assert arr.tolist() == sorted(actual)
        slow, quick = diff_pairs(expected, actual), diff_gpu_keys(fast, arr)
        assert (slow.missing, slow.extra) == (quick.missing, quick.extra)
    # anything but GPU stores, removals and clears takes the general path
    assert gpu_dump_keys([BlockStored(keys=[1], block_size=16, tier="cpu")]) is None
    idx = PrefixIndex()
    idx.apply_stored("w", [1, 2], "cpu")
    assert idx.gpu_keys_of("w") is None and idx.gpu_keys_of("nobody").tolist() == []
