"""The admission queue in service order: requests waiting for capacity (every worker at
capacity, or the latency model says no worker meets the SLO), served

1. by priority band (critical, then standard, then sheddable: strictly);
2. within a band, from the backlogged flow (tenant) with the least virtual token counter
   (:class:`~services.core.flow.vtc.VirtualCounters`), ties to the flow whose first request
   came first;
3. within a flow, first come first served.

Bounded by ``size``: a request that finds the queue full takes the place of the youngest
request of the lowest band below its own (that one is *bumped*: the caller answers it 429),
or is refused when there is none. A request may wait ``timeout_s`` (then the caller refuses
it).

Invariants: the queue holds exactly the entries joined and not left; an entry is in exactly
one flow's FIFO of one band; ``head()`` is the entry the order above names, recomputed only
after a join, a leave or a charge (O(backlogged flows of the first non-empty band)).
"""

from __future__ import annotations

from collections import deque
from collections.abc import KeysView
from dataclasses import dataclass
from typing import Generic, TypeVar

from services.common.tenancy import Priority, RequestTenancy
from services.core.flow.vtc import VirtualCounters

Q = TypeVar("Q")
_BANDS = len(Priority)


@dataclass(frozen=True, slots=True)
class Joined(Generic[Q]):
    """What :meth:`FlowQueue.join` did: ``ok`` (queued, or refused: the queue is full of
    requests of the same band or above), and the entry it ``bumped`` to make room."""

    ok: bool
    bumped: Q | None = None


class FlowQueue(Generic[Q]):
    def __init__(self, counters: VirtualCounters, size: float, timeout_s: float) -> None:
        self.counters = counters
        self.size = size
        self.timeout_s = timeout_s
        # per band: flow -> its waiting entries, oldest first (dicts keep first-backlog order)
        self._bands: list[dict[str, deque[Q]]] = [{} for _ in range(_BANDS)]
        self._where: dict[Q, tuple[float, int, str, int]] = {}  # entry -> (since, band, flow, seq)
        self._backlog: dict[str, int] = {}  # flow -> its entries waiting (any band)
        self._seq = 0
        self._head: Q | None = None
        self._head_at = -1  # counters.version the cached head was computed at; -1: stale

    def __len__(self) -> int:
        return len(self._where)

    def __bool__(self) -> bool:
        return bool(self._where)

    def __contains__(self, entry: object) -> bool:
        return entry in self._where

    def backlogged(self) -> KeysView[str]:
        """The flows with a request waiting."""
        return self._backlog.keys()

    def floor(self) -> float | None:
        """The least counter among the backlogged flows (None: none is)."""
        if not self._backlog:
            return None
        get = self.counters.get
        return min(get(f) for f in self._backlog)

    def ahead(self, rank: int) -> bool:
        """Does a request of band ``rank`` or above wait?"""
        return any(self._bands[b] for b in range(rank + 1))

    def join(self, entry: Q, tenancy: RequestTenancy, now: float) -> Joined[Q]:
        """Wait from ``now`` in ``tenancy``'s band and flow."""
        band = tenancy.priority.rank
        bumped = None
        if len(self._where) >= self.size:
            bumped = self._youngest_below(band)
            if bumped is None:
                return Joined(False)
            self.leave(bumped)
        flow = tenancy.flow
        if flow not in self._backlog:
            self.counters.lift(flow, self.floor())
            self._backlog[flow] = 0
        self._backlog[flow] += 1
        self._seq += 1
        self._bands[band].setdefault(flow, deque()).append(entry)
        self._where[entry] = (now, band, flow, self._seq)
        self._head_at = -1
        return Joined(True, bumped)

    def leave(self, entry: Q) -> None:
        """``entry`` stops waiting (dispatched, refused or gone); no-op when not queued."""
        w = self._where.pop(entry, None)
        if w is None:
            return
        _, band, flow, _ = w
        flows = self._bands[band]
        fifo = flows[flow]
        if fifo[0] is entry:
            fifo.popleft()
        else:
            fifo.remove(entry)
        if not fifo:
            del flows[flow]
        n = self._backlog[flow] - 1
        if n:
            self._backlog[flow] = n
        else:
            del self._backlog[flow]
        self._head_at = -1

    def head(self) -> Q | None:
        """The entry served next (None: the queue is empty)."""
        if self._head_at == self.counters.version:
            return self._head
        head = None
        for flows in self._bands:
            if flows:
                get, where = self.counters.get, self._where
                best = min(flows, key=lambda f: (get(f), where[flows[f][0]][3]))
                head = flows[best][0]
                break
        self._head, self._head_at = head, self.counters.version
        return head

    def flow_heads(self) -> list[Q]:
        """Each backlogged flow's oldest entry per band, by band, then first come (a copy: the
        caller may leave entries while it walks it). O(flows): for passing a held head (the
        entries of a flow in a band share its tenancy)."""
        where = self._where
        heads = [fifo[0] for flows in self._bands for fifo in flows.values()]
        return sorted(heads, key=lambda e: (where[e][1], where[e][3]))

    def left_s(self, entry: Q, now: float) -> float:
        """Seconds ``entry`` may still wait (<= 0: it waited ``timeout_s``)."""
        return self._where[entry][0] + self.timeout_s - now

    def expired(self, entry: Q, now: float) -> bool:
        return now - self._where[entry][0] > self.timeout_s

    def _youngest_below(self, band: int) -> Q | None:
        for b in range(_BANDS - 1, band, -1):
            flows = self._bands[b]
            if flows:
                where = self._where
                return max((fifo[-1] for fifo in flows.values()), key=lambda e: where[e][3])
        return None
