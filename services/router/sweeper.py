"""The router's clock tick: every 100 ms age the cluster state and tick the circuits.

Invariants: while NATS is down no worker ages out (no heartbeat can arrive, so the last known
state keeps serving); any change in who is routable notifies the capacity signal.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from services.common.bus import Bus
from services.core.cluster import ClusterState
from services.router import metrics as M
from services.router.circuits import Circuits
from services.router.signals import CapacitySignal


class Sweeper:
    def __init__(
        self, bus: Bus, state: ClusterState, circuits: Circuits, capacity: CapacitySignal
    ) -> None:
        self.bus = bus
        self.state = state
        self.circuits = circuits
        self.capacity = capacity
        self.outliers: Any = None  # services.router.ejection.RouterOutliers, set by the router

    async def run(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            if not self.bus.is_connected:
                self.state.keep_alive(now)  # keep serving from last known state while down
            if self.state.sweep(now):
                self.capacity.notify()
            M.WORKERS.set(self.state.routable_count())
            self.circuits.tick(now)
            if self.outliers is not None:
                self.outliers.evaluate(now)
