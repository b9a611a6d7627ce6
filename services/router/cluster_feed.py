"""Bus inputs that describe the workers: heartbeats, telemetry and worker control, applied to
the router's :class:`ClusterState` on the monotonic clock.

Invariant: each input is applied in arrival order; whatever may add capacity (a worker up, a
control change, fresh telemetry while requests wait) notifies the capacity signal.
"""

from __future__ import annotations

import time
from typing import Any

from services.common.logging import get_logger
from services.common.schemas import WorkerControl, WorkerHeartbeat, WorkerLoad
from services.core.cluster import ClusterState
from services.router.signals import CapacitySignal

log = get_logger("router")


class ClusterFeed:
    def __init__(self, state: ClusterState, capacity: CapacitySignal) -> None:
        self.state = state
        self.capacity = capacity

    async def on_heartbeat(self, hb: WorkerHeartbeat, _raw: Any) -> None:
        if self.state.on_heartbeat(hb, time.monotonic()):
            log.info("worker up", worker=hb.worker_id, url=hb.url, model=hb.model)
            self.capacity.notify()

    async def on_load(self, load: WorkerLoad, _raw: Any) -> None:
        self.state.on_load(load, time.monotonic())
        if self.capacity.waiting:
            self.capacity.notify()

    async def on_control(self, ctl: WorkerControl, _raw: Any) -> None:
        self.state.on_control(ctl, time.monotonic())
        log.info("worker control", worker=ctl.worker_id, action=ctl.action, by=ctl.by)
        self.capacity.notify()
