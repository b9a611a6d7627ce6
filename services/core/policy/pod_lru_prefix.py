"""llm-d's approximate prefix-cache indexer: per pod, an LRU of the block hashes of the prompts
routed there, bounded by that pod's KV blocks.

Follows llm-d-router ``pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix``
(``indexer.go`` ``Add`` / ``Get``, ``plugin.go`` ``matchLongestPrefix``; llm-d-inference-scheduler
commit 520af47, May 2026): a routed prompt's hashes are added to the chosen pod's LRU (an
existing hash becomes most recent; the LRU's size is fixed when the pod is first seen); a
prompt is matched hash by hash, every pod that holds a hash gets +1, and the walk stops at the
first hash that no pod holds.

Invariant: ``lru[w]`` holds at most ``capacity[w]`` keys, least recently added first, and
``pods[k]`` is exactly the set of workers whose ``lru`` holds ``k`` (absent when empty).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class PodLruPrefixIndex:
    lru: dict[str, OrderedDict[int, None]] = field(default_factory=dict)
    capacity: dict[str, int] = field(default_factory=dict)
    pods: dict[int, set[str]] = field(default_factory=dict)

    def match(self, block_keys: tuple[int, ...]) -> dict[str, int]:
        """Per pod, how many of the leading hashes it holds, up to the first hash no pod holds
        (``matchLongestPrefix``); pods with none are absent."""
        out: dict[str, int] = {}
        pods = self.pods
        for k in block_keys:
            holders = pods.get(k)
            if not holders:
                break
            for w in holders:
                out[w] = out.get(w, 0) + 1
        return out

    def add(self, worker: str, block_keys: tuple[int, ...], capacity: int) -> None:
        """The prompt was routed to ``worker``: its hashes become that pod's most recent.
        ``capacity`` applies only the first time the pod is seen (like the Go LRU)."""
        lru = self.lru.get(worker)
        if lru is None:
            lru = self.lru[worker] = OrderedDict()
            self.capacity[worker] = max(1, capacity)
        cap = self.capacity[worker]
        pods = self.pods
        for k in block_keys:
            if k in lru:
                lru.move_to_end(k)
                continue
            lru[k] = None
            holders = pods.get(k)
            if holders is None:
                pods[k] = {worker}
            else:
                holders.add(worker)
            if len(lru) > cap:
                self._evict_oldest(worker, lru)

    def _evict_oldest(self, worker: str, lru: OrderedDict[int, None]) -> None:
        old, _ = lru.popitem(last=False)
        holders = self.pods[old]
        holders.discard(worker)
        if not holders:
            del self.pods[old]

    def remove_pod(self, worker: str) -> None:
        lru = self.lru.pop(worker, None)
        self.capacity.pop(worker, None)
        while lru:
            self._evict_oldest(worker, lru)
