"""Sliding windows of the demand for shared prefixes, as the hot-prefix rule of ``kv_aware``
(and ``slo_aware``, which reuses it) reads it: per prefix (:class:`Demand`, with the cold
decisions that created a prefix counted once it is seen shared, :class:`ColdEntry`) and per
holder (:class:`HolderDemand`). Pure state, no I/O; each class's docstring states its invariant.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ColdEntry:
    """A demand-window entry for a decision that matched no shared prefix: its block keys, so
    that a prefix it turns out to have created can claim it (see :meth:`Demand.claim`)."""

    keys: tuple[int, ...]


@dataclass
class Demand:
    """Sliding window of the last ``size`` decisions' prefix ids (a :class:`ColdEntry` or None
    for a request without a shared prefix); ``count[pid]`` is how many entries of the window
    are ``pid`` (invariant: equals the window's contents)."""

    size: int
    window: deque = field(default_factory=deque)
    count: dict = field(default_factory=dict)

    def add(self, pid: object) -> None:
        self.window.append(pid)
        if pid is not None and not isinstance(pid, ColdEntry):
            self.count[pid] = self.count.get(pid, 0) + 1
        while len(self.window) > self.size:
            old = self.window.popleft()
            if old is not None and not isinstance(old, ColdEntry):
                n = self.count[old] - 1
                if n:
                    self.count[old] = n
                else:
                    del self.count[old]

    def claim(self, pid: object, depth: int) -> None:
        """``pid`` (the key of block ``depth`` - 1) is seen as a shared prefix for the first
        time: the cold requests of the window that computed it (their keys have it there) were
        its first demand, so they count as ``pid`` from now on. Without this the request that
        created a shared system prompt counts as no demand, and the prompt looks wanted by
        half the traffic when the next request is all of it."""
        if pid in self.count:
            return
        w = self.window
        for i, e in enumerate(w):
            if isinstance(e, ColdEntry) and len(e.keys) >= depth and e.keys[depth - 1] == pid:
                w[i] = pid
                self.count[pid] = self.count.get(pid, 0) + 1

    def fraction(self, pid: object) -> float:
        n = len(self.window)
        return self.count.get(pid, 0) / n if n else 0.0

    def fraction_low(self, pid: object, z: float) -> float:
        """A lower bound of :meth:`fraction` (Wilson score, ``z`` standard deviations): a
        window of a few decisions says little, so 4 requests of one of 32 groups among the
        first 19 are not taken for a fifth of the traffic, while a prompt that every request
        so far wanted still is hot after 2."""
        n = len(self.window)
        if not n:
            return 0.0
        f = self.count.get(pid, 0) / n
        z2n = z * z / n
        return max(0.0, (f + z2n / 2 - z * math.sqrt(f * (1 - f) / n + z2n / (4 * n))) / (1 + z2n))


@dataclass
class HolderDemand:
    """Sliding window of the last ``size`` hot decisions' holder sets; ``share[w]`` is the sum
    over the window of 1/len(holders) for every entry holding ``w`` (invariant: equals the
    window's contents; ``total`` = number of entries, cold decisions included as empty)."""

    size: int
    window: deque = field(default_factory=deque)
    share: dict[str, float] = field(default_factory=dict)

    def add(self, holders: tuple[str, ...]) -> None:
        self.window.append(holders)
        if holders:
            unit = 1.0 / len(holders)
            for h in holders:
                self.share[h] = self.share.get(h, 0.0) + unit
        while len(self.window) > self.size:
            old = self.window.popleft()
            if old:
                unit = 1.0 / len(old)
                for h in old:
                    v = self.share[h] - unit
                    if v <= 1e-9:
                        del self.share[h]
                    else:
                        self.share[h] = v

    def fraction(self, worker: str) -> float:
        n = len(self.window)
        return self.share.get(worker, 0.0) / n if n else 0.0
