"""Deciding: the prefix index's overlaps plus the policy core's decision for one request.

Invariant: deciding never waits on the network and never changes the cluster state: it reads
the local index replica and asks the lifecycle (``services.core.lifecycle``, the code the
simulator runs too) for the policy's decision over the local :class:`ClusterState`,
excluding workers that already failed this request. The policy's clock is the monotonic one
(the same clock ``first_token`` stamps prefills with).
"""

from __future__ import annotations

import time
from typing import Any

from services.core.cluster import ClusterState
from services.core.lifecycle import RequestLifecycle
from services.core.policy import Decision, Policy, RequestInfo
from services.router.slo import NO_TARGETS, SloTargets
from services.router.tokenize import Parsed, RequestParser


class Decider:
    def __init__(
        self, lifecycle: RequestLifecycle[Any], index_source: Any, parser: RequestParser
    ) -> None:
        self.lifecycle = lifecycle
        self.state: ClusterState = lifecycle.state
        self.index_source = index_source
        self.parser = parser

    def overlaps(
        self, parsed: Parsed, states: dict, keys: tuple[int, ...] = (), keys_bs: int = 0
    ) -> dict[str, int]:
        """Leading matched blocks per worker: from ``keys`` (the prompt's whole chain at block
        size ``keys_bs``) when the caller already hashed it, else hashing lazily (stops where
        no worker matches)."""
        index = self.index_source.index
        sizes = self.state.block_sizes
        if not sizes:
            return {}
        match = getattr(index, "match_prompt", None)

        def one(bs: int) -> dict[str, int]:
            if keys and bs == keys_bs:
                return index.find_matches(keys)
            if match is not None:
                return match(parsed.token_ids, bs, parsed.seed)
            return index.find_matches(self.parser.keys(parsed, bs))

        if len(sizes) == 1:
            return one(next(iter(sizes)))
        out: dict[str, int] = {}
        for bs in sorted(sizes):
            for wid, n in one(bs).items():
                s = states.get(wid)
                if s is not None and s.capacity.block_size == bs:
                    out[wid] = n
        return out

    def decide_for(
        self,
        parsed: Parsed,
        request_id: str,
        session_id: str | None,
        policy: Policy,
        excluded: set[str],
        slo_targets: SloTargets = NO_TARGETS,
    ) -> tuple[Decision, dict[str, int]]:
        states = self.state.states
        if excluded:
            states = {k: v for k, v in states.items() if k not in excluded}
        keys: tuple[int, ...] = ()
        bs = 0
        if self.lifecycle.wants_block_keys(policy) and len(self.state.block_sizes) == 1:
            # only policies that remember where they sent a prefix need the full key chain;
            # hashed once, it also answers the index match (no second hashing of the prompt)
            bs = next(iter(self.state.block_sizes))
            keys = tuple(self.parser.keys(parsed, bs))
        overlaps = self.overlaps(parsed, states, keys, bs)
        req = RequestInfo(
            request_id=request_id,
            model=parsed.model,
            prompt_tokens=len(parsed.token_ids),
            max_tokens=parsed.max_tokens,
            block_keys=keys,
            session_id=session_id,
            slo_ttft_s=slo_targets.ttft_s,
            slo_tpot_s=slo_targets.tpot_s,
        )
        now = time.monotonic()  # the policy's clock (prefill progress), as in first_token
        return self.lifecycle.decide(policy, req, overlaps, now, excluded), overlaps
