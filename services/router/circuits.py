"""Circuit breaking for the router: one :class:`~services.router.breaker.Breaker` per worker
(the model and its parameters are in :mod:`services.router.breaker`), the worker's
``circuit_open`` in the cluster state, and the ``circuit_open`` alert.

Interface to the request path: :meth:`Circuits.sent` when a request is dispatched to a worker
(a half-open circuit counts its trials there), :meth:`Circuits.success` /
:meth:`Circuits.failure` after each attempt with the monotonic time it was sent. The sweeper
calls :meth:`Circuits.tick` every 100 ms.

Invariants:
- a worker's ``circuit_open`` in the cluster state is True exactly while its breaker is not
  :attr:`~services.router.breaker.Breaker.routable` (open, or half-open with all its trials
  admitted);
- one ``circuit_open`` alert per incident: ``firing`` at its first opening, ``resolved`` when
  it ends (closed for ``recovery_s``, or the worker left the cluster); re-openings inside an
  incident are logged and counted (``kvgate_router_breaker_openings_total``), not alerted;
- alerts are sent off the request path; a failure to send one is logged (rate-limited), never
  raised.
"""

from __future__ import annotations

import time

from services.common.bus import Bus
from services.common.logging import RateLimiter, get_logger
from services.common.schemas import Alert
from services.common.streams import raise_alert
from services.core.cluster import ClusterState
from services.router import metrics as M
from services.router.breaker import CLOSED, HALF_OPEN, OPEN, STATE_VALUE, Breaker, BreakerConfig
from services.router.signals import CapacitySignal, Spawner

log = get_logger("router")


class Circuits:
    def __init__(
        self,
        router_id: str,
        bus: Bus,
        state: ClusterState,
        capacity: CapacitySignal,
        spawner: Spawner,
        config: BreakerConfig,
    ) -> None:
        self.router_id = router_id
        self.bus = bus
        self.state = state
        self.capacity = capacity
        self.spawner = spawner
        self.config = config
        self.breakers: dict[str, Breaker] = {}
        self._log = RateLimiter(30.0)

    def state_of(self, wid: str) -> str:
        br = self.breakers.get(wid)
        return CLOSED if br is None else br.state

    def _breaker(self, wid: str) -> Breaker:
        br = self.breakers.get(wid)
        if br is None:
            br = self.breakers[wid] = Breaker(self.config)
            M.BREAKER.labels(wid).set(0)
        return br

    def sent(self, wid: str) -> None:
        """A request was dispatched to ``wid`` (called right after the decision, before any
        other decision can run, so a half-open circuit admits exactly its trials)."""
        br = self.breakers.get(wid)
        if br is None or br.state != HALF_OPEN:
            return
        br.sent()
        if not br.routable:
            self.state.set_breaker_open(wid, True)  # the last trial: wait for the verdicts

    def success(self, wid: str, sent_at: float) -> None:
        """A request sent to ``wid`` at ``sent_at`` (monotonic) succeeded."""
        br = self.breakers.get(wid)
        if br is None or (br.state == CLOSED and br.failures == 0):
            return
        was = br.state
        if br.success(time.monotonic(), sent_at) == CLOSED and was != CLOSED:
            self.state.set_breaker_open(wid, False)
            M.BREAKER.labels(wid).set(0)
            log.info(
                "circuit closed: trial requests succeeded",
                worker=wid,
                trials=br.config.trial_requests,
                recovery_s=br.config.recovery_s,
            )
            self.capacity.notify()

    def failure(self, wid: str, reason: str, sent_at: float | None = None) -> None:
        """A request sent at ``sent_at`` (default: now) failed."""
        br = self._breaker(wid)
        was = br.state
        if br.failure(time.monotonic(), sent_at) != OPEN or was == OPEN:
            return
        self.state.set_breaker_open(wid, True)
        M.BREAKER.labels(wid).set(2)
        M.BREAKER_OPENINGS.labels(wid).inc()
        log.warning(
            "circuit opened",
            worker=wid,
            reason=reason,
            was=was,
            opening=br.openings,
            open_s=br.wait_s,
        )
        if br.openings == 1:  # a new incident
            self._alert(
                wid,
                "firing",
                f"circuit open for worker {wid} after {self.config.failures_to_open} "
                f"consecutive failures ({reason})",
            )

    def tick(self, now: float) -> None:
        """Open circuits whose time is over go half-open (routable for their trials);
        incidents end; trials lost to cancelled requests are given again."""
        for wid, br in list(self.breakers.items()):
            if wid not in self.state.states:
                self._forget(wid, br)
                continue
            before, in_incident = br.state, br.in_incident
            after = br.tick(now)
            if before == OPEN and after == HALF_OPEN:
                M.BREAKER.labels(wid).set(STATE_VALUE[HALF_OPEN])
                self.state.set_breaker_open(wid, False)
                log.info("circuit half-open", worker=wid, trials=br.config.trial_requests)
                self.capacity.notify()
            elif after == HALF_OPEN and not br.routable and not self._in_flight(wid):
                br.trials_lost()
                self.state.set_breaker_open(wid, False)
                self.capacity.notify()
            elif in_incident and not br.in_incident:
                log.info("circuit incident over", worker=wid, recovery_s=br.config.recovery_s)
                self._alert(
                    wid,
                    "resolved",
                    f"circuit_open resolved: worker {wid} answered every request for "
                    f"{br.config.recovery_s:g} s after its circuit closed",
                )

    def _in_flight(self, wid: str) -> bool:
        return self.state.local_inflight().get(wid, 0) > 0

    def _forget(self, wid: str, br: Breaker) -> None:
        """The worker left the cluster: its breaker goes, and its incident ends with it."""
        del self.breakers[wid]
        M.BREAKER.labels(wid).set(0)
        if br.in_incident:
            self._alert(
                wid,
                "resolved",
                f"circuit_open resolved: worker {wid} left the cluster",
            )

    def _alert(self, wid: str, state: str, summary: str) -> None:
        alert = Alert(
            fingerprint=f"circuit_open:{wid}",
            kind="circuit_open",
            # critical: the worker is out of service (docs/api.md, alert severities)
            severity="critical",
            state=state,  # type: ignore[arg-type]
            source="router",
            worker_id=wid,
            summary=summary,
            remedy="The router stopped sending new requests to this worker; it lets a few "
            "requests through at growing intervals and closes the circuit when they all "
            "succeed. Check the engine's logs and health. Requests in flight were retried or "
            "migrated.",
            details={"router_id": self.router_id},
        )

        async def send() -> None:
            try:
                await raise_alert(self.bus, alert)
            except Exception as exc:
                if self._log.allow(wid):
                    log.warning("alert not sent", worker=wid, error=repr(exc))

        self.spawner.spawn(send())
