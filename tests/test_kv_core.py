"""IndexerCore (pure): seq handling, resync bookkeeping, retries, journal = index."""

from __future__ import annotations

from services.common.index_replica import apply_ops
from services.common.schemas import AllBlocksCleared, BlockRemoved
from services.core.index import PrefixIndex
from services.kv_indexer.core import IndexerCore
from tests.test_kv_support import batch, chain, hb, stored


def test_held_batches_apply_above_the_dump_and_journal_replays_equal() -> None:
    core = IndexerCore(max_blocks=None)
    mirror = PrefixIndex()
    a = chain(20, 1)
    core.heartbeat(hb("w"), 0.0)
    assert core.batch(batch("w", 0, [stored(a[:4])])) == []
    assert core.batch(batch("w", 3, [stored(a[12:14], a[11])])) == ["w"]  # gap: resync
    assert core.batch(batch("w", 4, [BlockRemoved(keys=a[13:14])])) == []  # held
    assert core.batch(batch("w", 2, [stored(a[:1])])) == []  # held too (resyncing)
    # the dump is the worker's cache as of seq 2; 3 and 4 apply on top, 2 is dropped
    assert core.dump_received("w", batch("w", 2, [AllBlocksCleared(), stored(a[:12])])) == []
    assert core.index.find_matches(a) == {"w": 13}
    assert core.workers["w"].last_seq == 4 and core.counts["resyncs"] == 1
    apply_ops(mirror, core.take_ops())
    assert mirror.find_matches(a) == {"w": 13} and len(mirror) == len(core.index)


def test_failed_dump_applies_best_effort_and_retries_with_backoff() -> None:
    core = IndexerCore(max_blocks=None, heartbeat_timeout_s=1000)
    a = chain(6, 2)
    core.heartbeat(hb("w"), 10.0)
    core.batch(batch("w", 0, [stored(a[:2])]))
    assert core.batch(batch("w", 2, [stored(a[2:4], a[1])])) == ["w"]
    assert core.dump_failed("w", 11.0) == []
    assert core.index.find_matches(a) == {"w": 4}  # the held batch went in anyway
    assert core.tick(11.5) == []  # backoff 1 s
    assert core.tick(12.1) == ["w"]  # retry
    core.dump_failed("w", None)  # no clock given: the last one seen (12.1) + 2 s
    assert core.tick(13.0) == [] and core.tick(14.2) == ["w"]
    assert core.counts["resync_failures"] == 2


def test_expiry_and_cap_are_journaled() -> None:
    core = IndexerCore(max_blocks=64, heartbeat_timeout_s=3.0)
    mirror = PrefixIndex()
    core.heartbeat(hb("a"), 0.0)
    core.heartbeat(hb("b"), 0.0)
    for i in range(10):
        core.batch(batch("a", i, [stored(chain(10, 100 + i))]))
    assert len(core.index) <= 64 and core.index.evicted_pairs > 0
    core.batch(batch("b", 0, [stored(chain(3, 7))]))
    core.heartbeat(hb("b"), 2.5)
    core.tick(3.5)  # a expired, b alive
    assert set(core.workers) == {"b"} and core.index.workers() == {"b"}
    apply_ops(mirror, core.take_ops())
    assert len(mirror) == len(core.index) == 3
