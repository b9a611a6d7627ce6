"""The router's OpenAI-compatible HTTP handlers and its health view: thin adapters that hand
each request to the request path or read the cluster state. No routing logic here.
"""

from __future__ import annotations

import time
from typing import Any

from services.common.bus import Bus
from services.core.cluster import ClusterState
from services.router.canary import PolicySet
from services.router.http_server import Reply, Request, Response, json_response
from services.router.readiness import index_synced
from services.router.request_path import RequestPath
from services.router.signals import CapacitySignal


class Handlers:
    def __init__(
        self,
        router_id: str,
        path: RequestPath,
        state: ClusterState,
        bus: Bus,
        index_source: Any,
        policies: PolicySet,
        capacity: CapacitySignal,
    ) -> None:
        self.router_id = router_id
        self.path = path
        self.state = state
        self.bus = bus
        self.index_source = index_source
        self.policies = policies
        self.capacity = capacity

    async def completions(self, request: Request) -> Reply:
        return await self.path.handle(request, chat=False)

    async def chat(self, request: Request) -> Reply:
        return await self.path.handle(request, chat=True)

    async def models(self, _r: Request) -> Response:
        now = int(time.time())
        data = [
            {"id": m, "object": "model", "created": now, "owned_by": "kvgate", "workers": n}
            for m, n in sorted(self.state.models().items())
        ]
        return json_response({"object": "list", "data": data})

    async def health(self, _r: Request) -> Response:
        return json_response(
            {
                "status": "ok",
                "router_id": self.router_id,
                "workers": self.state.routable_count(),
                "nats": self.bus.is_connected,
                "index_ready": index_synced(self.index_source),
                "policy": self.policies.control_label,  # name@version
                "policy_algorithm": self.policies.control.name,
                "policy_revision": self.policies.revision,
                "queue_length": self.capacity.waiting,
                # the other routers this one shares in-flight counts with (heard on the bus)
                "peer_routers": sorted(self.state.remote_routers),
            }
        )
