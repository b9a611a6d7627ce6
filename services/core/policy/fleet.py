"""A policy's incremental view of a tracked snapshot's workers (:class:`FleetView`).

A decision over 1,000 workers cannot afford a Python pass over every worker. The snapshot of a
:class:`~services.core.cluster.ClusterState` reports every change of a worker's state
(``ClusterSnapshot.watchers``); this view keeps, per worker, what the filters read (routable,
model, capacity, in flight, free KV blocks) and aggregates over the routable workers (min / max
in flight, min free blocks, the block sizes and models), so a policy can tell in O(changes) that
every routable worker passes the filters for a request, and a policy-defined lower bound of each
worker's cost in heaps, so it can score the workers in order of that bound and stop where the
bound passes the best cost found.

Invariants: after :meth:`sync`, every row equals what a from-scratch evaluation of the snapshot
gives (``rows`` has exactly the snapshot's workers, ``pos`` is their order in it); ``dirty``
holds every worker changed since the policy last cleared it (the policy's own per-worker
bookkeeping is due for those only). Heaps are lazy: an entry counts only while its version is
the worker's current one. The bounds are the policy's: each worker's lower bound of its cost
(request terms aside), in one heap per group the policy names (``slo_aware`` groups by
decoding sequences, whose request term differs per request).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from services.core.policy.pickers import TIE_EPS
from services.core.policy.types import ClusterSnapshot, WorkerState

INF = float("inf")
MAX_WATCHERS = 8  # views registered on one snapshot (a replaced policy's view is dropped)


@dataclass(slots=True)
class Row:
    obj: WorkerState
    pos: int
    ver: int
    routable: bool
    model: str
    bs: int
    blocks: int
    mml: int
    seqs: int
    inflight: int
    free: float  # kv_blocks_free, INF when unknown


def exceeds(bound: float, best: float) -> bool:
    """Does a lower bound of a cost prove it above ``best`` + the pick's tie margin? (The
    margin covers the bound's own rounding: it is summed in another order than the cost.)"""
    return bound - 1e-6 - 1e-12 * abs(bound) > best + TIE_EPS


class FleetView:
    def __init__(self, snapshot: ClusterSnapshot) -> None:
        assert snapshot.watchers is not None
        self.snapshot = snapshot
        self.workers = snapshot.workers
        self.changed: set[str] = set()
        ws = snapshot.watchers
        ws.append(self.changed)
        if len(ws) > MAX_WATCHERS:
            del ws[0]
        self.rows: dict[str, Row] = {}
        self.dirty: set[str] = set()
        self._ver = 0
        self._rebuild()

    def __deepcopy__(self, memo: dict) -> None:
        """A copy of a policy's state (the router's explain endpoint decides on one) starts
        without a view: it builds its own if it decides (sharing this one's change set would
        take changes from it)."""
        return None

    def __del__(self) -> None:
        """Stop receiving notifications (a dropped policy's view is not fed forever)."""
        ws = self.snapshot.watchers
        if ws:
            for i, s in enumerate(ws):
                if s is self.changed:
                    del ws[i]
                    break

    def live(self, snapshot: ClusterSnapshot) -> bool:
        """Is this view still fed by ``snapshot``'s notifications?"""
        ws = snapshot.watchers
        return snapshot is self.snapshot and ws is not None and any(s is self.changed for s in ws)

    # ------------------------------------------------------------------ rows
    def _row(self, w: WorkerState, pos: int) -> Row:
        self._ver += 1
        c = w.capacity
        free = w.kv_blocks_free
        return Row(
            w,
            pos,
            self._ver,
            # colocated policies' view: a P/D fleet's prefill / decode engines are not theirs
            w.healthy and not (w.cordoned or w.draining or w.circuit_open) and w.role == "both",
            w.model,
            c.block_size,
            c.num_gpu_blocks,
            c.max_model_len,
            c.max_num_seqs,
            w.inflight,
            INF if free is None else free,
        )

    def _rebuild(self) -> None:
        self.changed.clear()
        self.rows = {wid: self._row(w, i) for i, (wid, w) in enumerate(self.workers.items())}
        self.dirty = set(self.rows)
        self._lbs: dict[int, list] = {}  # per group: a heap of (bound, pos, bound version)
        self._lb_n = 0  # entries in them
        self._bver: dict[int, int] = {}  # pos -> version of its current bound
        self._bseq = 0
        self._popped: dict[int, list] = {}
        self.bound: dict[str, float] = {}  # worker -> its current bound
        self.group: dict[str, int] = {}  # worker -> the group of that bound
        self._reaggregate()

    def _reaggregate(self) -> None:
        """Capacity aggregates and the in-flight / free heaps from the rows (O(workers))."""
        r = [x for x in self.rows.values() if x.routable]
        self.n = len(r)
        self.routable = {x.obj.worker_id for x in r}
        self.block_sizes = {x.bs for x in r}
        self.models: dict[str, int] = {}
        for x in r:
            self.models[x.model] = self.models.get(x.model, 0) + 1
        self.min_blocks = min((x.blocks for x in r), default=0)
        self.min_mml = min((x.mml for x in r), default=0)
        self._caps = {x.obj.worker_id: (x.bs, x.blocks, x.mml, x.seqs, x.model) for x in r}
        self._h_inf_min = [(x.inflight, x.pos, x.ver) for x in r]
        self._h_inf_max = [(-x.inflight, x.pos, x.ver) for x in r]
        self._h_over = [(x.seqs - x.inflight, x.pos, x.ver) for x in r]  # min: seqs - inflight
        self._h_free = [(x.free, x.pos, x.ver) for x in r]
        for h in (self._h_inf_min, self._h_inf_max, self._h_over, self._h_free):
            heapq.heapify(h)
        self._by_pos = {x.pos: x for x in self.rows.values()}

    def sync(self) -> None:
        """Apply the changes reported since the last call."""
        if not self.changed:
            return
        changed = list(self.changed)
        self.changed.clear()
        self.dirty.update(changed)
        rows, workers = self.rows, self.workers
        recaps = False
        for wid in changed:
            w = workers.get(wid)
            old = rows.get(wid)
            if w is None or old is None or old.obj is not w:
                self._rebuild()  # a worker joined, left or came back: positions change
                return
            new = rows[wid] = self._row(w, old.pos)
            self._by_pos[new.pos] = new
            if new.routable != old.routable or (
                new.routable
                and ((new.bs, new.blocks, new.mml, new.seqs, new.model) != self._caps.get(wid))
            ):
                recaps = True
            elif new.routable:
                t = (new.pos, new.ver)
                heapq.heappush(self._h_inf_min, (new.inflight, *t))
                heapq.heappush(self._h_inf_max, (-new.inflight, *t))
                heapq.heappush(self._h_over, (new.seqs - new.inflight, *t))
                heapq.heappush(self._h_free, (new.free, *t))
        if recaps or len(self._h_free) > 4 * len(rows) + 64:
            self._reaggregate()

    def _top(self, h: list) -> float:
        by_pos = self._by_pos
        while h:
            v, pos, ver = h[0]
            x = by_pos.get(pos)
            if x is not None and x.ver == ver and x.routable:
                return v
            heapq.heappop(h)
        return INF

    def min_inflight(self) -> float:
        return self._top(self._h_inf_min)

    def max_inflight(self) -> float:
        return -self._top(self._h_inf_max)

    def min_seq_room(self) -> float:
        """min over routable workers of max_num_seqs - in flight."""
        return self._top(self._h_over)

    def min_free(self) -> float:
        return self._top(self._h_free)

    def routable_states(self) -> list[WorkerState]:
        """The routable workers in snapshot order (O(workers): for rare paths)."""
        return [x.obj for x in self.rows.values() if x.routable]

    def unroutable_states(self) -> list[WorkerState]:
        return [x.obj for x in self.rows.values() if not x.routable]

    # ------------------------------------------------------------------ cost bounds
    def set_bound(self, wid: str, bound: float, group: int = 0) -> None:
        """The policy's lower bound of ``wid``'s cost (request terms aside), valid until the
        worker is next in ``dirty``; it replaces the worker's previous one. Workers are kept
        in one heap per ``group`` (a policy whose request terms scale with some per-worker
        count groups by it, so each group's bound can be completed exactly)."""
        x = self.rows[wid]
        self._bseq += 1
        self._bver[x.pos] = self._bseq
        self.bound[wid] = bound
        self.group[wid] = group
        h = self._lbs.get(group)
        if h is None:
            h = self._lbs[group] = []
        heapq.heappush(h, (bound, x.pos, self._bseq))
        self._lb_n += 1
        if self._lb_n > 2 * len(self.rows) + 64:
            bver = self._bver
            live = {}
            for g, h in self._lbs.items():
                h = [e for e in h if bver.get(e[1]) == e[2]]
                if h:
                    heapq.heapify(h)
                    live[g] = h
            self._lbs = live
            self._lb_n = sum(map(len, live.values()))

    def by_bound(self, group: int = 0):
        """Routable workers of ``group`` in increasing bound, lazily (a generator; entries
        popped while iterating are pushed back at :meth:`restore`)."""
        h, by_pos, bver = self._lbs.get(group, []), self._by_pos, self._bver
        popped = self._popped[group] = []
        while h:
            e = heapq.heappop(h)
            x = by_pos.get(e[1])
            if x is None or bver.get(e[1]) != e[2]:
                self._lb_n -= 1
                continue  # replaced: dropped for good
            popped.append(e)
            if x.routable:
                yield e[0], x

    def heads(self) -> list[tuple[float, int, Row]]:
        """Per group, its routable worker of the lowest bound: (bound, group, row)."""
        out = []
        for g, h in self._lbs.items():
            top = self._top_of(g, h)
            if top is not None:
                out.append((top[0], g, top[1]))
        return out

    def advance(self, group: int) -> tuple[float, Row] | None:
        """Set ``group``'s head (from :meth:`heads`) aside until :meth:`restore`; its next
        routable worker of the lowest bound, or None."""
        h = self._lbs[group]
        self._popped.setdefault(group, []).append(heapq.heappop(h))
        return self._top_of(group, h)

    def _top_of(self, group: int, h: list) -> tuple[float, Row] | None:
        """The routable entry on top of ``group``'s heap ``h``: replaced entries are dropped
        for good, unroutable ones set aside until :meth:`restore`."""
        by_pos, bver = self._by_pos, self._bver
        while h:
            b, pos, ver = h[0]
            x = by_pos.get(pos)
            if x is None or bver.get(pos) != ver:
                heapq.heappop(h)
                self._lb_n -= 1
            elif not x.routable:
                self._popped.setdefault(group, []).append(heapq.heappop(h))
            else:
                return b, x
        return None

    def restore(self) -> None:
        for g, popped in self._popped.items():
            h = self._lbs[g]
            for e in popped:
                heapq.heappush(h, e)
        self._popped = {}
