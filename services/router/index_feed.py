"""The router's local copy of the global prefix index.

Prefers :class:`services.common.index_replica.IndexReplica` (snapshot + ordered deltas from the
indexer). Until that exists in this build, :class:`DirectFeed` keeps a :class:`PrefixIndex`
from the workers' KV events (core subscription to ``kv.events.*``): correct for events seen
after the router started, and self-healing as caches churn.

Both expose ``index`` (a PrefixIndex), ``ready`` and ``start()`` / ``stop()``.
"""

from __future__ import annotations

from typing import Any

from services.common.bus import Bus
from services.common.schemas import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from services.core.index import PrefixIndex


class DirectFeed:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.index = PrefixIndex()
        self.ready = False
        self._instances: dict[str, str] = {}
        self._sub: Any = None

    async def start(self) -> None:
        self._sub = await self.bus.subscribe(
            self.bus.subjects.kv_events_all, KvEventBatch, self._on
        )
        self.ready = True

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass

    async def _on(self, batch: KvEventBatch, _raw: Any) -> None:
        self.apply(batch)

    def apply(self, batch: KvEventBatch) -> None:
        w = batch.worker_id
        if self._instances.get(w) not in (None, batch.instance_id):
            self.index.clear_worker(w)
        self._instances[w] = batch.instance_id
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.index.apply_stored(w, ev.keys, ev.tier)
            elif isinstance(ev, BlockRemoved):
                self.index.apply_removed(w, ev.keys, ev.tier)
            elif isinstance(ev, AllBlocksCleared):
                self.index.clear_worker(w)


def make_index_source(bus: Bus) -> Any:
    """IndexReplica when the indexer package provides it, else DirectFeed."""
    try:
        from services.common.index_replica import IndexReplica  # type: ignore[import-not-found]
    except ImportError:
        return DirectFeed(bus)
    return IndexReplica(bus)
