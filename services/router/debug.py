"""Debug views: ``/debug/state`` (the router's view of every worker) and ``/debug/route``
(explain the decision a request would get, without sending anything).

Invariant: read-only. ``/debug/route`` decides on a copy of the policy's state, so explaining
a decision advances no counter or random generator of the live policy.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

import msgspec

from services.common.redact import redact_url
from services.core.cluster import ClusterState
from services.router.canary import PolicySet
from services.router.circuits import Circuits
from services.router.decide import Decider
from services.router.http_server import Request, Response, json_response
from services.router.proxy import error_response, session_of
from services.router.tokenize import BadRequest, RequestParser

_json_decode = msgspec.json.decode


class DebugViews:
    def __init__(
        self,
        router_id: str,
        state: ClusterState,
        index_source: Any,
        policies: PolicySet,
        circuits: Circuits,
        parser: RequestParser,
        decider: Decider,
    ) -> None:
        self.router_id = router_id
        self.state = state
        self.index_source = index_source
        self.policies = policies
        self.circuits = circuits
        self.parser = parser
        self.decider = decider

    async def h_state(self, _r: Request) -> Response:
        workers = {}
        for wid, s in sorted(self.state.states.items()):
            workers[wid] = {
                "url": redact_url(s.url),
                "model": s.model,
                "routable": s.routable,
                "healthy": s.healthy,
                "cordoned": s.cordoned,
                "draining": s.draining,
                "circuit": self.circuits.state_of(wid),
                "inflight": s.inflight,
                "pending_prefill_tokens": s.pending_prefill_tokens,
                "kv_blocks_free": s.kv_blocks_free,
                "kv_usage": s.kv_usage,
                "telemetry_stale": s.telemetry_stale,
                "indexed_blocks": self.index_source.index.blocks_of(wid),
            }
        return json_response(
            {"router_id": self.router_id, "policy": self.policies.describe(), "workers": workers}
        )

    async def h_route(self, request: Request) -> Response:
        """Explain a decision without sending anything: body (or query) like a request."""
        try:
            if request.can_read_body:
                body = _json_decode(await request.read())
            else:
                q = request.query
                body = {"prompt": q.get("prompt", ""), "model": q.get("model", "")}
                if "max_tokens" in q:
                    body["max_tokens"] = int(q["max_tokens"])
            chat = isinstance(body, dict) and "messages" in body
            parsed = await self.parser.parse(body, chat)
        except (BadRequest, msgspec.DecodeError, ValueError) as exc:
            return error_response(400, f"bad request: {exc}", "invalid_request_error")
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        session_id = session_of(request.headers)
        arm = self.policies.arm(rid, session_id)
        policy = copy.copy(arm.policy)
        policy.state = copy.deepcopy(arm.policy.state)
        d, overlaps = self.decider.decide_for(parsed, rid, session_id, policy, set())
        return json_response(
            {
                "request_id": rid,
                "policy": policy.name,
                "policy_version": policy.version,
                "params": policy.params,
                "arm": arm.name,
                "canary_id": arm.canary_id,
                "worker": d.worker_id,
                "prefill_worker": d.prefill_worker,  # P/D: None when the decoder prefills
                "reason": d.reason,
                "wait": d.wait,
                "never_fits": d.never_fits,
                "scores": d.scores,
                "overlap_blocks": overlaps,
                "predicted_cached_tokens": d.cached_tokens,
                "replicate_to": list(d.replicate_to),
                "after": d.after,
                "hold_s": d.hold_s,
                "filtered": d.filtered,
                "prompt_tokens": len(parsed.token_ids),
                "max_tokens": parsed.max_tokens,
            }
        )
