"""An approximate prefix tree built from routed prompts, as sglang-router's cache_aware keeps
one: a prompt is inserted into the chosen worker's tree when it is routed, before the engine
has computed it; KV events are not used.

Keyed by the request's block keys (a prefix tree at block granularity: a chain of block keys
determines its prefix, so a key -> workers map is the tree). Bounded: the newest ``max_blocks``
keys are kept (re-inserting a key makes it newest).

Invariant: ``keys[k]`` is the set of workers whose tree holds block key ``k``, in the order
they first inserted it (the first is the one whose prompt created that position, sglang's
``last_tenant`` of the node), with the keys in insertion order of ``k``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RoutedTree:
    max_blocks: int
    keys: dict[int, dict[str, None]] = field(default_factory=dict)

    def deepest(self, block_keys: tuple[int, ...]) -> tuple[int, str | None]:
        """How many leading blocks the tree holds for any worker, and the worker that created
        the deepest of them (None when the first block is not in the tree)."""
        depth = 0
        owner: str | None = None
        tree = self.keys
        for k in block_keys:
            holders = tree.get(k)
            if not holders:
                break
            depth += 1
            owner = next(iter(holders))
        return depth, owner

    def insert(self, worker: str, block_keys: tuple[int, ...]) -> None:
        tree = self.keys
        for k in block_keys:
            holders = tree.pop(k, None)
            if holders is None:
                holders = {}
            holders[worker] = None
            tree[k] = holders
        while len(tree) > self.max_blocks:
            del tree[next(iter(tree))]
