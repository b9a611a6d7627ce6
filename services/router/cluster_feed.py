"""Bus inputs that describe the workers: heartbeats, telemetry and worker control, applied to
the router's :class:`ClusterState` on the monotonic clock.

Invariant: each input is applied in arrival order; whatever may add capacity (a worker up, a
control change, fresh telemetry while requests wait) notifies the capacity signal. A heartbeat
whose URL the worker's pin refuses (services.core.url_pin) changes nothing and is reported to
``reject`` (the router's BusTrust.reject: counted in
``kvgate_router_rejected_messages_total{type="WorkerHeartbeat",reason}``, logged and alerted as
``forged_message``, both rate-limited), with its URLs redacted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from services.common.logging import get_logger
from services.common.redact import redact_url
from services.common.schemas import WorkerControl, WorkerHeartbeat, WorkerLoad
from services.core.cluster import ClusterState
from services.router.signals import CapacitySignal

log = get_logger("router")

# (message type, reason, subject, detail): BusTrust.reject's signature
Reject = Callable[[str, str, str, str], None]


def _ignore(_type: str, _reason: str, _subject: str, _detail: str) -> None:
    pass


class ClusterFeed:
    def __init__(
        self, state: ClusterState, capacity: CapacitySignal, reject: Reject = _ignore
    ) -> None:
        self.state = state
        self.capacity = capacity
        self.reject = reject

    async def on_heartbeat(self, hb: WorkerHeartbeat, raw: Any) -> None:
        refusal = self.state.url_refusal(hb)
        if refusal is not None:
            pinned = self.state.pins.pinned(hb.worker_id)
            self.reject(
                "WorkerHeartbeat",
                refusal,
                getattr(raw, "subject", ""),
                f"worker {hb.worker_id} url {redact_url(hb.url)} refused (pinned: "
                f"{redact_url(pinned) if pinned else 'none'}); if it really moved, re-pin it "
                f"(POST /api/v1/workers/{hb.worker_id}/repin) or allow its network "
                "(--worker-url-allow)",
            )
            return
        if self.state.on_heartbeat(hb, time.monotonic()):
            log.info("worker up", worker=hb.worker_id, url=redact_url(hb.url), model=hb.model)
            self.capacity.notify()

    async def on_load(self, load: WorkerLoad, _raw: Any) -> None:
        self.state.on_load(load, time.monotonic())
        if self.capacity.waiting:
            self.capacity.notify()

    async def on_control(self, ctl: WorkerControl, _raw: Any) -> None:
        self.state.on_control(ctl, time.monotonic())
        if ctl.action == "repin":
            log.warning(
                "worker url re-pinned by an operator",
                worker=ctl.worker_id,
                url=redact_url(ctl.url) if ctl.url else "(next heartbeat's)",
                by=ctl.by,
            )
            return
        log.info("worker control", worker=ctl.worker_id, action=ctl.action, by=ctl.by)
        self.capacity.notify()
