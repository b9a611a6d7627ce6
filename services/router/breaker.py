"""Per-worker circuit breaker: a pure state machine; time is passed in.

closed --(``threshold`` consecutive failures)--> open --(``open_s`` elapsed)--> half_open
half_open: one probe at a time (a request, or the router's health probe);
probe success -> closed; probe failure -> open again with the wait doubled (up to ``max_open_s``).

Only server-side trouble counts as failure (connect errors, timeouts, 5xx); a client's 4xx
is a success for the breaker.

Invariants:
- :meth:`allow` is False while open, and while half-open with a probe already in flight.
- Only evidence gathered after the circuit opened moves it: an open (or half-open) circuit
  closes only through a success of a request *dispatched* at or after ``opened_at`` (the
  half-open probe, or a request let through while half-open). A stream that was already in
  flight when the circuit opened and then succeeds says nothing about the worker now (a worker
  failing half its requests would otherwise flap open/closed many times a minute); its failure
  likewise does not re-open a half-open circuit.
"""

from __future__ import annotations

from dataclasses import dataclass

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
STATE_VALUE = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}


@dataclass
class Breaker:
    threshold: int = 5
    open_s: float = 5.0
    max_open_s: float = 60.0
    state: str = CLOSED
    failures: int = 0
    opened_at: float = 0.0
    wait_s: float = 0.0
    probing: bool = False

    def allow(self, now: float) -> bool:
        """May a request go to this worker now? (May move open -> half_open.)"""
        self.tick(now)
        if self.state == CLOSED:
            return True
        if self.state == HALF_OPEN and not self.probing:
            return True
        return False

    def tick(self, now: float) -> str:
        if self.state == OPEN and now - self.opened_at >= self.wait_s:
            self.state = HALF_OPEN
            self.probing = False
        return self.state

    def start_probe(self) -> None:
        if self.state == HALF_OPEN:
            self.probing = True

    def _stale(self, dispatched_at: float) -> bool:
        """Was the request sent before the circuit (last) opened?"""
        return self.state != CLOSED and dispatched_at < self.opened_at

    def success(self, dispatched_at: float) -> str:
        """A request sent at ``dispatched_at`` (same clock as ``now``) succeeded."""
        if self._stale(dispatched_at):
            return self.state
        self.failures = 0
        self.probing = False
        if self.state != CLOSED:
            self.state = CLOSED
            self.wait_s = 0.0
        return self.state

    def failure(self, now: float, dispatched_at: float | None = None) -> str:
        """A request sent at ``dispatched_at`` (default: now) failed at ``now``."""
        if self._stale(now if dispatched_at is None else dispatched_at):
            return self.state
        self.failures += 1
        if self.state == HALF_OPEN:
            self.wait_s = min(max(self.wait_s, self.open_s) * 2, self.max_open_s)
            self._open(now)
        elif self.state == CLOSED and self.failures >= self.threshold:
            self.wait_s = self.open_s
            self._open(now)
        return self.state

    def _open(self, now: float) -> None:
        self.state = OPEN
        self.opened_at = now
        self.probing = False

    @property
    def blocks_new_requests(self) -> bool:
        return self.state == OPEN or (self.state == HALF_OPEN and self.probing)
