"""Per-worker circuit breaker: one explicit model, a pure state machine; time is passed in.

The model, with its five parameters (router flags in brackets):

- **closed**: every request may go to the worker. ``failures_to_open`` consecutive failures
  [``--breaker-threshold``, 5] open the circuit. Only server-side trouble is a failure
  (connect errors, timeouts, 5xx); a client's 4xx is a success.
- **open**: no request goes to the worker. The *n*-th opening of one incident stays open
  ``n × open_s`` [``--breaker-open-s``, 5 s], at most ``max_open_s``
  [``--breaker-max-open-s``, 120 s] (Envoy's outlier ejection: base time × ejection count,
  capped), then the circuit is half-open.
- **half-open**: the decision may send the worker ``trial_requests``
  [``--breaker-trial-requests``, 3] real client requests (trials; a ``/health`` probe is no
  evidence that completions work, so there is none). All of them must succeed to close the
  circuit; any failure re-opens it at once (the next, longer open time). Trials whose requests
  ended without a verdict (the client left) are given again (:meth:`Breaker.trials_lost`).
- **incident**: from the first opening until the circuit has stayed closed ``recovery_s``
  [``--breaker-recovery-s``, 30 s]. Re-openings inside one incident count up (longer open
  times) and raise no new alert: the router fires ``circuit_open`` once when an incident starts
  and resolves it once when it ends; then the opening count restarts from zero.

A worker failing half its requests therefore opens once, raises one alert, and is tried again
at growing intervals (5, 10, 15, ... s) with three trials each time (all three pass with odds
1/8); a healthy worker ends its incident ``recovery_s`` after its trials pass.

Invariants:
- Only evidence sent after the last opening moves the breaker: the outcome of a request
  *dispatched* before ``opened_at`` is ignored (a stream in flight when the circuit opened says
  nothing about the worker now; counted again, a worker failing half its requests would flap).
- While half-open at most ``trial_requests`` requests are admitted (:attr:`routable` turns
  False at the last one), and only ``trial_requests`` successes close the circuit.
- ``openings`` is > 0 exactly during an incident; ``wait_s`` never exceeds ``max_open_s``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common import settings as S

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
STATE_VALUE = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}


@dataclass(frozen=True)
class BreakerConfig:
    failures_to_open: int = 5  # consecutive failures that open a closed circuit
    open_s: float = 5.0  # the first opening's open time; the n-th waits n x this
    max_open_s: float = 120.0  # cap on one open time
    trial_requests: int = 3  # real requests admitted half-open; all must succeed to close
    recovery_s: float = 30.0  # closed this long: the incident ends (alert resolved, count 0)

    def __post_init__(self) -> None:
        if self.failures_to_open < 1:
            raise ValueError("--breaker-threshold must be >= 1")
        if self.trial_requests < 1:
            raise ValueError("--breaker-trial-requests must be >= 1")
        if self.open_s <= 0:
            raise ValueError("--breaker-open-s must be > 0")
        if self.max_open_s < self.open_s:
            raise ValueError("--breaker-max-open-s must be >= --breaker-open-s")
        if self.recovery_s < 0:
            raise ValueError("--breaker-recovery-s must be >= 0")


@dataclass
class Breaker:
    config: BreakerConfig = field(default_factory=BreakerConfig)
    state: str = CLOSED
    failures: int = 0  # consecutive, while closed
    openings: int = 0  # openings in the current incident (0: no incident)
    opened_at: float = float("-inf")  # the last opening
    wait_s: float = 0.0  # the current (or last) open time
    closed_at: float = 0.0  # the last re-closing
    trials_sent: int = 0  # requests admitted while half-open
    trials_ok: int = 0  # of those, successes

    @property
    def routable(self) -> bool:
        """May the decision pick this worker now?"""
        return self.state == CLOSED or (
            self.state == HALF_OPEN and self.trials_sent < self.config.trial_requests
        )

    @property
    def in_incident(self) -> bool:
        return self.openings > 0

    def tick(self, now: float) -> str:
        """Open -> half-open when the open time is over; an incident ends after recovery."""
        if self.state == OPEN and now - self.opened_at >= self.wait_s:
            self.state = HALF_OPEN
            self.trials_sent = self.trials_ok = 0
        elif (
            self.state == CLOSED
            and self.openings
            and now - self.closed_at >= self.config.recovery_s
        ):
            self.openings = 0
        return self.state

    def sent(self) -> None:
        """A request was dispatched to the worker (a trial while half-open)."""
        if self.state == HALF_OPEN:
            self.trials_sent += 1

    def trials_lost(self) -> None:
        """Admitted trials ended without success or failure (cancelled): admit others."""
        if self.state == HALF_OPEN:
            self.trials_sent = self.trials_ok

    def success(self, now: float, dispatched_at: float) -> str:
        """A request sent at ``dispatched_at`` (same clock as ``now``) succeeded at ``now``."""
        if dispatched_at < self.opened_at:
            return self.state
        self.failures = 0
        if self.state == HALF_OPEN:
            self.trials_ok += 1
            if self.trials_ok >= self.config.trial_requests:
                self.state = CLOSED
                self.closed_at = now
        return self.state

    def failure(self, now: float, dispatched_at: float | None = None) -> str:
        """A request sent at ``dispatched_at`` (default: now) failed at ``now``."""
        if (now if dispatched_at is None else dispatched_at) < self.opened_at:
            return self.state
        if self.state == HALF_OPEN:
            self._open(now)
        elif self.state == CLOSED:
            self.failures += 1
            if self.failures >= self.config.failures_to_open:
                self._open(now)
        return self.state

    def _open(self, now: float) -> None:
        self.openings += 1
        self.wait_s = min(self.config.open_s * self.openings, self.config.max_open_s)
        self.state = OPEN
        self.opened_at = now
        self.failures = self.trials_sent = self.trials_ok = 0


OPTIONS = (
    S.option(
        "breaker_threshold",
        5,
        "consecutive worker failures (5xx, timeouts, connect errors) that open its circuit",
        env="KVGATE_ROUTER_BREAKER_THRESHOLD",
    ),
    S.option(
        "breaker_open_s",
        5.0,
        "seconds a circuit stays open the first time in an incident; the n-th opening of the "
        "same incident stays open n times this (up to --breaker-max-open-s)",
        env="KVGATE_ROUTER_BREAKER_OPEN_S",
    ),
    S.option(
        "breaker_max_open_s",
        120.0,
        "the longest a circuit stays open before it is tried again (seconds)",
        env="KVGATE_ROUTER_BREAKER_MAX_OPEN_S",
    ),
    S.option(
        "breaker_trial_requests",
        3,
        "real requests a half-open circuit lets through; all must succeed to close it, one "
        "failure re-opens it",
        env="KVGATE_ROUTER_BREAKER_TRIAL_REQUESTS",
    ),
    S.option(
        "breaker_recovery_s",
        30.0,
        "seconds a re-closed circuit must stay closed before its incident ends: the "
        "circuit_open alert resolves and the open time starts again from --breaker-open-s",
        env="KVGATE_ROUTER_BREAKER_RECOVERY_S",
    ),
)


def breaker_config(st: object) -> BreakerConfig:
    """The breaker's parameters from the router's settings."""
    return BreakerConfig(
        failures_to_open=int(getattr(st, "breaker_threshold", 5)),
        open_s=float(getattr(st, "breaker_open_s", 5.0)),
        max_open_s=float(getattr(st, "breaker_max_open_s", 120.0)),
        trial_requests=int(getattr(st, "breaker_trial_requests", 3)),
        recovery_s=float(getattr(st, "breaker_recovery_s", 30.0)),
    )
