"""One request's lifecycle in the router, on an injected clock: the code the live router and
the cluster simulator share.

    decide --(wait)--> flow control's queue (services.core.flow) --(capacity)--> decide again
           --(worker)--> dispatch: ticket on the worker, follower hold?, hot-prefix replicas
           (a P/D decision: dispatch_pd, a ticket on the decoder and one on the prefiller
            --> prefilled: the prefiller's claim released, the KV moves to the decoder)
           --> first token (prefill done; followers released)
           --> decoded (a streamed answer's mean inter-token gap calibrates the latency model)
           --> end (ticket released)

The callers own time and the engine calls: the live router (services/router/) passes the
monotonic / wall clock and sends over HTTP with asyncio; the simulator (bench/simcore.py)
passes its virtual clock and hands requests to the engine model (services.core.engine).
What happens *between* the steps (an HTTP stream, an engine step) is theirs; the bookkeeping
at each step is here, so the two cannot drift apart.

Invariants:
- every ticket from :meth:`RequestLifecycle.dispatch` / :meth:`RequestLifecycle.replicas` is
  released exactly once by :meth:`RequestLifecycle.end` (``ClusterState.release`` is
  idempotent);
- a request is *pending* in :class:`FirstTokenHolds` from its dispatch until its first token
  or its end, whichever is first; a follower is held only on a pending leader, and every
  follower held on a leader is handed back exactly once: by the leader's first token / end,
  or by :meth:`FirstTokenHolds.drop` (its hold timed out);
- deciding reads the cluster state and changes nothing in it.
No I/O, no clock: ``now`` / ``wall`` are arguments.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from services.core.cluster import ClusterState, Ticket
from services.core.policy import Decision, Policy, RequestInfo, decide
from services.core.policy.types import ClusterSnapshot, replica_id

F = TypeVar("F")


class FirstTokenHolds(Generic[F]):
    """Which dispatched requests have no first token yet, and which followers wait on them.

    ``kv_aware`` may answer "send this request after request X's first token"
    (``Decision.after``): X computes the prefix this request needs on the same worker, and an
    engine that starts both in one step computes the prefix twice. A follower is whatever the
    caller needs to wake it (an asyncio.Event live, the simulated request in the simulator).
    """

    def __init__(self) -> None:
        self._pending: dict[str, list[F]] = {}  # request id -> followers held on it

    def __len__(self) -> int:
        return len(self._pending)

    def sent(self, request_id: str) -> None:
        """``request_id`` was dispatched and has no first token yet."""
        self._pending.setdefault(request_id, [])

    def pending(self, request_id: str) -> bool:
        return request_id in self._pending

    def hold(self, leader: str, follower: F) -> bool:
        """Hold ``follower`` until ``leader``'s first token; False (not held) when ``leader``
        is not pending (nothing to wait for)."""
        followers = self._pending.get(leader)
        if followers is None:
            return False
        followers.append(follower)
        return True

    def drop(self, leader: str, follower: F) -> None:
        """``follower`` stops waiting (its hold timed out)."""
        followers = self._pending.get(leader)
        if followers is not None:
            for i, f in enumerate(followers):
                if f is follower:
                    del followers[i]
                    break

    def done(self, request_id: str) -> list[F]:
        """``request_id`` has its first token, or ended: its followers, to be released."""
        return self._pending.pop(request_id, None) or []


@dataclass(slots=True)
class Replica:
    """A one-token copy of a request sent to ``worker_id`` so it computes the hot prefix."""

    request_id: str
    worker_id: str
    ticket: Ticket


class RequestLifecycle(Generic[F]):
    """The request lifecycle over one :class:`ClusterState`; see the module docstring."""

    def __init__(self, state: ClusterState, holds: FirstTokenHolds[F] | None = None) -> None:
        self.state = state
        self.holds: FirstTokenHolds[F] = holds if holds is not None else FirstTokenHolds()

    @staticmethod
    def wants_block_keys(policy: Policy) -> bool:
        """Does ``policy`` get the prompt's whole block-key chain in ``RequestInfo.block_keys``?
        Only policies that remember where they sent a prefix (``routed_ttl`` > 0) use it, and
        hashing the whole chain costs the live router a pass over the prompt; a policy that
        gets keys also tells prefixes apart by them, so both callers must ask here. The policy
        says (:meth:`PolicyImpl.wants_block_keys`)."""
        return policy.impl.wants_block_keys()

    def decide(
        self,
        policy: Policy,
        request: RequestInfo,
        overlaps: dict[str, int],
        now: float,
        excluded: Iterable[str] = (),
    ) -> Decision:
        """The policy's decision over the current state (without the ``excluded`` workers);
        ``now`` is the policy's clock (the one :meth:`first_token` stamps prefills with)."""
        excluded = set(excluded)
        if excluded:
            states = {k: v for k, v in self.state.states.items() if k not in excluded}
            snap = ClusterSnapshot(states, now, max_block_size=self.state.snapshot.max_block_size)
        else:
            snap = self.state.snapshot
            snap.now = now
        return decide(policy, request, snap, overlaps)

    def dispatch(
        self,
        request_id: str,
        worker_id: str,
        prompt_tokens: int,
        max_tokens: int,
        cached_tokens: int,
        wall: float,
    ) -> Ticket:
        """The request's claim on ``worker_id``; it is pending until its first token."""
        ticket = self.state.reserve(worker_id, prompt_tokens, max_tokens, cached_tokens, wall)
        self.holds.sent(request_id)
        return ticket

    def dispatch_pd(
        self, request_id: str, d: Decision, prompt_tokens: int, max_tokens: int, wall: float
    ) -> tuple[Ticket, Ticket | None]:
        """A P/D decision's claims: on the decoder (``d.worker_id``: the whole request's KV,
        pending until its first token) and, when ``d.prefill_worker`` is set, on the prefiller
        (the prompt + 1 token; released by :meth:`prefilled`). The decoder then computes no
        prompt: its queued prefill is the prefiller's."""
        ticket = self.dispatch(
            request_id, d.worker_id or "", prompt_tokens, max_tokens, d.cached_tokens, wall
        )
        if d.prefill_worker is None:
            return ticket, None
        self.state.first_token(ticket)  # no prompt to compute on the decoder
        pre = self.state.reserve(d.prefill_worker, prompt_tokens, 1, d.prefill_cached_tokens, wall)
        return ticket, pre

    def prefilled(
        self, policy: Policy, request_id: str, ticket: Ticket, ttft_s: float, now: float
    ) -> None:
        """The remote prefill of ``request_id`` has its token (its KV is ready to move,
        ``ttft_s`` after dispatch): the prefiller's claim is released and the policy told."""
        self.state.first_token(ticket, now)
        self.state.release(ticket)
        self.prefill_observed(policy, request_id, ticket.worker_id, ttft_s)

    @staticmethod
    def prefill_observed(policy: Policy, request_id: str, worker_id: str, ttft_s: float) -> None:
        """``request_id``'s prompt was computed on ``worker_id`` ``ttft_s`` after dispatch (a
        remote prefill, or a P/D policy's local one): for the policy's prefill model
        (:meth:`~services.core.policy.base.PolicyImpl.observe_prefill`)."""
        policy.impl.observe_prefill(request_id, worker_id, ttft_s, policy.state)

    def must_hold(self, d: Decision) -> bool:
        """Should the request wait for ``d.after``'s first token before it is sent?"""
        return d.after is not None and self.holds.pending(d.after)

    def replicas(
        self,
        request_id: str,
        d: Decision,
        prompt_tokens: int,
        overlaps: dict[str, int],
        wall: float,
    ) -> list[Replica]:
        """Claims for the decision's hot-prefix replicas (one-token copies), on workers still
        known; each is pending like a request and ends with :meth:`end`."""
        out: list[Replica] = []
        for wid in d.replicate_to:
            s = self.state.states.get(wid)
            if s is None:
                continue
            rid = replica_id(request_id, wid)
            cached = min(overlaps.get(wid, 0) * s.capacity.block_size, prompt_tokens)
            out.append(Replica(rid, wid, self.dispatch(rid, wid, prompt_tokens, 1, cached, wall)))
        return out

    def first_token(self, request_id: str, ticket: Ticket, now: float) -> list[F]:
        """The request's first token (its prefill is done): the followers it releases."""
        if not ticket.prefilling or ticket.released:
            return []
        self.state.first_token(ticket, now)
        return self.holds.done(request_id)

    def decoded(
        self, policy: Policy, worker_id: str, tokens: int, first_at: float, end_at: float
    ) -> None:
        """A request streamed ``tokens`` tokens on ``worker_id``, the first at ``first_at``
        and the last at ``end_at`` (one clock, seconds): one inter-token observation, the
        mean gap ``(end - first) / (tokens - 1)``, for the policy
        (:meth:`~services.core.policy.base.PolicyImpl.observe_decode`; ``slo_aware``'s latency
        model of that worker, ignored by the others). Its decode load is the worker's at the
        end, before this request's release: the requests in flight there (this one included).
        Called before :meth:`end`."""
        if tokens < 2 or not end_at > first_at:
            return
        s = self.state.states.get(worker_id)
        if s is None:
            return
        gap = (end_at - first_at) / (tokens - 1)
        policy.impl.observe_decode(worker_id, gap, max(1, s.inflight), policy.state)

    def end(self, request_id: str, ticket: Ticket) -> list[F]:
        """The request ended (answered, failed, refused): release its claim; the followers
        still held on it."""
        followers = self.holds.done(request_id)
        self.state.release(ticket)
        return followers


__all__ = ["FirstTokenHolds", "Replica", "RequestLifecycle"]
