"""The router's side of latency outlier ejection: feeds finished requests to the pure
:class:`~services.router.outlier.OutlierDetector`, takes ejected workers out of rotation
(like an open circuit) and raises / resolves the ``latency_outlier`` alert.

Invariant: a worker is out of rotation for latency exactly while the detector holds it
ejected; one alert per incident: its first ejection fires it, the incident's end (back a
whole window without a new ejection) resolves it; re-ejections inside it are logged and
counted (``kvgate_router_outlier_ejections_total``), not alerted.
"""

from __future__ import annotations

import time
from typing import Any

from services.common.bus import Bus
from services.common.logging import get_logger
from services.common.schemas import Alert
from services.common.streams import raise_alert
from services.core.cluster import ClusterState
from services.router import metrics as M
from services.router.outlier import Ejection, OutlierConfig, OutlierDetector
from services.router.signals import CapacitySignal, Spawner

log = get_logger("router.outlier")


def outlier_config(st: Any) -> OutlierConfig | None:
    """The detector's parameters from the router's settings (None: ejection off)."""
    ratio = float(getattr(st, "outlier_ratio", 3.0))
    if ratio <= 0:
        return None
    return OutlierConfig(
        ratio=ratio,
        window_s=float(getattr(st, "outlier_window_s", 30.0)),
        eject_s=float(getattr(st, "outlier_eject_s", 30.0)),
        min_requests=int(getattr(st, "outlier_min_requests", 5)),
        max_eject_s=float(getattr(st, "outlier_max_eject_s", 300.0)),
    )


class RouterOutliers:
    def __init__(
        self,
        router_id: str,
        bus: Bus,
        state: ClusterState,
        capacity: CapacitySignal,
        spawner: Spawner,
        config: OutlierConfig | None,
    ) -> None:
        self.router_id = router_id
        self.bus = bus
        self.state = state
        self.capacity = capacity
        self.spawner = spawner
        self.detector = OutlierDetector(config) if config is not None else None

    def record(self, ctx: Any, e2e_s: float) -> None:
        if self.detector is None or ctx.worker_id is None or ctx.migrated:
            return
        self.detector.record(ctx.worker_id, time.monotonic(), e2e_s, ctx.completion_tokens)

    def evaluate(self, now: float) -> None:
        if self.detector is None:
            return
        for change in self.detector.evaluate(now):
            self._apply(change, now)

    def _apply(self, ch: Ejection, now: float) -> None:
        wid = ch.worker_id
        if ch.recovered:
            log.info("latency outlier incident over", worker=wid)
            summary = f"latency_outlier resolved: worker {wid} kept pace with the fleet"
            self._alert(ch, "resolved", summary)
            return
        self.state.set_ejected(wid, ch.ejected)
        M.OUTLIER_EJECTED.labels(wid).set(1 if ch.ejected else 0)
        if ch.ejected:
            M.OUTLIER_EJECTIONS.labels(wid).inc()
            log.warning(
                "latency outlier ejected",
                worker=wid,
                s_per_token=round(ch.latency, 4),
                fleet_s_per_token=round(ch.fleet, 4),
                eject_s=round(ch.until - now, 1),
                ejection=ch.count,
            )
            if ch.count == 1:  # a new incident
                summary = (
                    f"worker {wid} is a latency outlier: {ch.latency * 1000:.1f} ms per output "
                    f"token against the other workers' median {ch.fleet * 1000:.1f} ms "
                    f"({ch.latency / ch.fleet:.1f}x); ejected for {ch.until - now:.0f} s"
                )
                self._alert(ch, "firing", summary)
        else:
            log.info("latency outlier returns", worker=wid, ejection=ch.count)
            self.capacity.notify()

    def _alert(self, ch: Ejection, state: str, summary: str) -> None:
        wid = ch.worker_id
        alert = Alert(
            fingerprint=f"latency_outlier:{wid}",
            kind="latency_outlier",
            severity="warning",  # degraded, still answering (see docs/api.md)
            state=state,  # type: ignore[arg-type]
            source="router",
            worker_id=wid,
            summary=summary,
            remedy="The router sends it no new requests for a while. Check the worker's GPU "
            "(clocks, thermal throttling, XID errors), its batch size and its neighbours; a "
            "fleet-wide slowdown does not eject anyone.",
            details={
                "router_id": self.router_id,
                "s_per_token": ch.latency,
                "fleet_s_per_token": ch.fleet,
            },
        )

        async def send() -> None:
            try:
                await raise_alert(self.bus, alert)
            except Exception as exc:
                log.warning("alert not sent", worker=wid, error=repr(exc))

        self.spawner.spawn(send())
