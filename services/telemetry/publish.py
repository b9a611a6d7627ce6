"""Publishing: worker samples on ``telemetry.<worker>`` and detector alerts on the alert
streams.

Invariants:
- Samples are queued while a tick runs and sent in one burst after it (:meth:`LoadPublisher.flush`);
  a failed publish is counted (``PUBLISH_ERRORS``) and logged, and the next sample replaces it.
- Alert transitions are never dropped while NATS is away: they stay queued, in order, and
  are retried at the next flush (:class:`AlertSender`); only a sent alert leaves the queue.
- A cancellation is never mistaken for a send error (nats-py can turn one into a timeout).
"""

from __future__ import annotations

import asyncio
from collections import deque

from services.common.bus import Bus
from services.common.logging import get_logger
from services.common.schemas import Alert, WorkerLoad, encode
from services.common.streams import raise_alert

from . import exporter
from .scrape import LogOnce

log = get_logger("telemetry")
_SCRAPES_OK = exporter.SCRAPES.labels("ok")


def raise_if_cancelling() -> None:
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class LoadPublisher:
    """Queues each tick's :class:`WorkerLoad` samples and publishes them in one burst."""

    def __init__(self, bus: Bus, log_once: LogOnce) -> None:
        self.bus = bus
        self._log_once = log_once
        self._outbox: list[WorkerLoad] = []
        self._ok_count = 0  # successful scrapes not yet added to the Prometheus counter
        self._subjects: dict[str, str] = {}  # worker -> telemetry subject
        self.published = 0

    def add(self, load: WorkerLoad, ok: bool) -> None:
        if ok:
            self._ok_count += 1  # added to the counter once per flush
        self._outbox.append(load)

    async def flush(self) -> None:
        out, self._outbox = self._outbox, []
        if self._ok_count:
            _SCRAPES_OK.inc(self._ok_count)
            self._ok_count = 0
        subjects = self._subjects
        publish = self.bus.client.publish
        for load in out:
            try:
                subject = subjects.get(load.worker_id)
                if subject is None:
                    subject = subjects[load.worker_id] = self.bus.subjects.telemetry(load.worker_id)
                await publish(subject, encode(load))
                self.published += 1
            except Exception as exc:
                raise_if_cancelling()
                exporter.PUBLISH_ERRORS.inc()
                self._log_once("publish", "telemetry publish failed", error=repr(exc))


class AlertSender:
    """Sends alert transitions with :func:`raise_alert`, in order, retrying while NATS is away."""

    def __init__(self, bus: Bus, log_once: LogOnce) -> None:
        self.bus = bus
        self._log_once = log_once
        self._pending: deque[Alert] = deque(maxlen=10_000)
        self.sent: list[Alert] = []  # last transitions (bounded), for /health and tests

    async def send(self, alerts: list[Alert]) -> None:
        self._pending.extend(alerts)
        await self.flush()

    async def flush(self) -> None:
        while self._pending:
            alert = self._pending[0]
            try:
                await raise_alert(self.bus, alert)
            except Exception as exc:
                raise_if_cancelling()  # nats-py can turn a cancellation into a timeout error
                exporter.ALERT_SEND_ERRORS.inc()
                self._log_once("alert-send", "alert send failed, will retry", error=repr(exc))
                return
            self._pending.popleft()
            exporter.ALERTS.labels(alert.kind, alert.state).inc()
            self.sent.append(alert)
            del self.sent[:-100]
            log.warning(
                "alert " + alert.state,
                kind=alert.kind,
                worker=alert.worker_id,
                summary=alert.summary,
                remedy=alert.remedy,
            )
