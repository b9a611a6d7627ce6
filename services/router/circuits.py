"""Circuit breaking for the router: one :class:`Breaker` per worker, half-open health probes,
and the ``circuit_open`` alert (firing when a circuit opens, resolved when it closes).

Interface to the request path: :meth:`Circuits.success` / :meth:`Circuits.failure` after each
attempt, with the monotonic time the attempt was sent (only evidence from after a circuit
opened moves it, see :mod:`services.router.breaker`); the decision sees the result through ``ClusterState.set_breaker_open`` (the worker's
``circuit_open``). The sweeper calls :meth:`Circuits.tick`.

Invariants: a worker's circuit is open in the cluster state exactly while its breaker is open
or half-open with a probe in flight; at most one probe per worker at a time; alerts are sent
off the request path and a failure to send them is logged (rate-limited), never raised.
"""

from __future__ import annotations

import time

import aiohttp

from services.common.bus import Bus
from services.common.logging import RateLimiter, get_logger
from services.common.schemas import Alert
from services.common.streams import raise_alert
from services.core.cluster import ClusterState
from services.router import metrics as M
from services.router.breaker import STATE_VALUE, Breaker
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
        threshold: int,
        open_s: float,
        probe_timeout_s: float,
    ) -> None:
        self.router_id = router_id
        self.bus = bus
        self.state = state
        self.capacity = capacity
        self.spawner = spawner
        self.threshold = threshold
        self.open_s = open_s
        self.probe_timeout_s = probe_timeout_s
        self.breakers: dict[str, Breaker] = {}
        self.session: aiohttp.ClientSession | None = None  # set by the router at start
        self._log = RateLimiter(30.0)

    def state_of(self, wid: str) -> str:
        br = self.breakers.get(wid)
        return "closed" if br is None else br.state

    def _breaker(self, wid: str) -> Breaker:
        br = self.breakers.get(wid)
        if br is None:
            br = self.breakers[wid] = Breaker(threshold=self.threshold, open_s=self.open_s)
            M.BREAKER.labels(wid).set(0)
        return br

    def success(self, wid: str, sent_at: float) -> None:
        """A request (or probe) sent to ``wid`` at ``sent_at`` (monotonic) succeeded."""
        br = self.breakers.get(wid)
        if br is None or (br.state == "closed" and br.failures == 0):
            return
        was = br.state
        br.success(sent_at)
        if was != "closed" and br.state == "closed":
            self.state.set_breaker_open(wid, False)
            M.BREAKER.labels(wid).set(0)
            log.info("circuit closed", worker=wid)
            self._alert(
                wid,
                "resolved",
                f"circuit_open resolved: worker {wid} answers again, circuit closed",
            )
            self.capacity.notify()

    def failure(self, wid: str, reason: str, sent_at: float | None = None) -> None:
        """A request sent at ``sent_at`` (default: now) failed."""
        br = self._breaker(wid)
        was = br.state
        br.failure(time.monotonic(), sent_at)
        if br.state == "open":
            self.state.set_breaker_open(wid, True)
            M.BREAKER.labels(wid).set(2)
            if was == "closed":
                log.warning("circuit opened", worker=wid, reason=reason, failures=br.failures)
                self._alert(
                    wid,
                    "firing",
                    f"circuit open for worker {wid} after {br.failures} consecutive failures ({reason})",
                )

    def tick(self, now: float) -> None:
        """Move open circuits whose wait is over to half-open and probe them."""
        for wid, br in list(self.breakers.items()):
            before = br.state
            if br.tick(now) == "half_open" and not br.probing:
                br.start_probe()
                self.state.set_breaker_open(wid, True)
                self.spawner.spawn(self._probe(wid))
            if before != br.state:
                M.BREAKER.labels(wid).set(STATE_VALUE[br.state])

    async def _probe(self, wid: str) -> None:
        """Half-open probe: GET /health on the worker; success closes the breaker."""
        ws = self.state.states.get(wid)
        ok = False
        sent_at = time.monotonic()
        if ws is not None and self.session is not None:
            try:
                async with self.session.get(
                    ws.url + "/health",
                    timeout=aiohttp.ClientTimeout(total=self.probe_timeout_s),
                ) as r:
                    ok = r.status == 200
            except Exception:
                ok = False
        if ok:
            self.success(wid, sent_at)
        else:
            self.failure(wid, "health probe failed", sent_at)

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
            remedy="The router stopped sending new requests to this worker and probes it; "
            "check the engine's logs and health. Requests in flight were retried or migrated.",
            details={"router_id": self.router_id},
        )

        async def send() -> None:
            try:
                await raise_alert(self.bus, alert)
            except Exception as exc:
                if self._log.allow(wid):
                    log.warning("alert not sent", worker=wid, error=repr(exc))

        self.spawner.spawn(send())
