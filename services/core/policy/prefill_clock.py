"""The prefill clock: where a policy's own dispatched prefills stand on each worker, on the
snapshot's clock (:class:`PrefillClock`). ``kv_aware`` counts a worker's queued prefill with
it, ``slo_aware`` counts it in full and calibrates its latency model from its samples. Pure
state, no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container
from dataclasses import dataclass, field

from services.core.policy.types import WorkerState, drop_departed


@dataclass
class PrefillClock:
    """Where this policy's own dispatched prefills stand, on the snapshot's clock.

    Per worker, a FIFO of ``[dispatched_at, pending, compute]`` for requests this policy sent
    whose first token has not come back: ``pending`` is what the request added to the worker's
    ``pending_prefill_tokens`` (uncached by the index), ``compute`` the tokens it will really
    compute (uncached by index and routed-prefix memory). Engines prefill first come first
    served, so when ``pending_prefill_tokens`` falls below the FIFO's total, its oldest entries
    are done: they are dropped, and their duration (from when they could start to the worker's
    ``first_token_at``) teaches ``spt``, seconds per computed prompt token (exponentially
    weighted; only batches of ``min_tokens`` or more, where per-step overheads are small).

    :meth:`queued` is what is left to compute at ``now`` (each entry starts when the one before
    it ends and takes ``slack`` x ``spt`` per token), plus other routers' part of the worker's
    ``pending_prefill_tokens``: a worker whose cold prefill is almost done is almost free, which
    ``pending_prefill_tokens`` (it drops only at the first token) cannot tell. Invariants:
    ``own[w]`` = sum of ``fifo[w]``'s pending, ``computing[w]`` = sum of its compute (so
    counting every entry in full is O(1), not O(entries): a worker with hundreds of requests
    before their first token is decided on as fast as an idle one); without a clock (``now``
    always 0) no sample is ever taken, ``spt`` stays None and every entry counts in full.
    """

    min_tokens: int
    slack: float = 1.5  # queued prefills are expected to take this x the learned speed
    decay: float = 0.8
    spt: float | None = None
    dur_sum: float = 0.0
    tok_sum: float = 0.0
    fifo: dict[str, deque] = field(default_factory=dict)
    own: dict[str, int] = field(default_factory=dict)
    computing: dict[str, int] = field(default_factory=dict)
    last_done: dict[str, float] = field(default_factory=dict)
    # when a list: every sample taken is appended as (worker, computed tokens, seconds), for a
    # caller that calibrates its own model from them (``slo_aware``)
    samples: list | None = None
    # False: :meth:`queued` counts every entry in full until its first token (the samples are
    # still taken); ``slo_aware`` does, see its docstring
    discount: bool = True
    # per worker, entries ever appended to / removed from its FIFO: entry number k (1-based) is
    # still queued while done_n < k (routed-prefix memory asks this of a prefix's leader)
    sent_n: dict[str, int] = field(default_factory=dict)
    done_n: dict[str, int] = field(default_factory=dict)

    MAX_ENTRIES = 512  # per worker: a bound if first tokens are never observed

    def dispatched(self, wid: str, now: float, pending: int, compute: int) -> None:
        """This policy sent a request: ``pending`` tokens were added to the worker's queued
        prefill, of which it will compute ``compute``."""
        if pending <= 0:
            return
        q = self.fifo.get(wid)
        if q is None:
            q = self.fifo[wid] = deque()
        q.append((now, pending, compute))
        self.own[wid] = self.own.get(wid, 0) + pending
        self.computing[wid] = self.computing.get(wid, 0) + compute
        self.sent_n[wid] = self.sent_n.get(wid, 0) + 1
        if len(q) > self.MAX_ENTRIES:
            _, pend, comp = q.popleft()
            self.own[wid] -= pend
            self.computing[wid] -= comp
            self.done_n[wid] = self.done_n.get(wid, 0) + 1

    def forget(self, live: Container[str]) -> None:
        """Drop the queues of workers not in ``live`` (they left the cluster). ``sent_n`` and
        ``done_n`` stay: routed-prefix memory may still name such a worker with an entry
        number, and a worker that comes back under the same id must not find its old entries
        counted as queued again (two integers per worker that ever was)."""
        for per_worker in (self.fifo, self.own, self.computing, self.last_done):
            drop_departed(per_worker, live)

    def observe(self, w: WorkerState, now: float) -> None:
        """Drop the entries whose prefill is done (learning ``spt`` from them)."""
        wid = w.worker_id
        own = self.own.get(wid, 0)
        left = w.pending_prefill_tokens
        if own <= left:
            return
        q = self.fifo[wid]
        first = q[0][0]
        compute = 0
        n = 0
        while q and own > left:
            _, pend, comp = q.popleft()
            own -= pend
            compute += comp
            n += 1
        self.own[wid] = own
        self.computing[wid] -= compute
        self.done_n[wid] = self.done_n.get(wid, 0) + n
        done = w.first_token_at
        if done is None or done < first or done > now:
            done = now
        start = self.last_done.get(wid, first)
        if start < first:
            start = first
        self.last_done[wid] = done
        if compute >= self.min_tokens and done > start:
            self.dur_sum = self.decay * self.dur_sum + (done - start)
            self.tok_sum = self.decay * self.tok_sum + compute
            self.spt = self.dur_sum / self.tok_sum
            if self.samples is not None:
                self.samples.append((wid, compute, done - start))

    def queued(self, w: WorkerState, now: float) -> float:
        """The worker's queued prefill in computed tokens: what other routers queued (its
        ``pending_prefill_tokens`` beyond this FIFO) plus, per FIFO entry, the ``compute``
        tokens not yet done at ``now`` (each entry starts when the one before it ends and runs
        at ``spt`` per token; without ``spt``, none is done)."""
        wid = w.worker_id
        q = self.fifo.get(wid)
        if not q:
            return w.pending_prefill_tokens
        other = w.pending_prefill_tokens - self.own[wid]
        left = float(other) if other > 0 else 0.0
        spt = self.spt if self.discount else None
        if spt is None:
            # every entry in full: integers below 2**53, so the same float as adding them one
            # by one
            return left + self.computing[wid]
        spt *= self.slack
        free = self.last_done.get(wid, 0.0)
        for at, _, comp in q:
            start = at if at > free else free
            end = start + comp * spt
            if now < end:
                left += comp if now <= start else comp * (end - now) / (end - start)
            free = end
        return left
