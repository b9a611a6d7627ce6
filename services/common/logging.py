"""Structured logging with structlog: JSON in containers, readable on a terminal.

Bind request / worker ids with ``structlog.contextvars.bound_contextvars(request_id=...)``;
every log line emitted inside carries them, and ``trace_id`` / ``span_id`` while an
OpenTelemetry span is current (services.common.tracing).
"""

from __future__ import annotations

import logging
import sys
import time

import structlog

from services.common.redact import redact_event, redact_text
from services.common.tracing import add_trace_ids


def configure_logging(service: str, level: str = "info", fmt: str = "auto") -> None:
    """Configure structlog and stdlib logging once per process."""
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: structlog.types.Processor
    if use_json:
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    level_no = getattr(logging, level.upper(), logging.INFO)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_trace_ids,  # trace_id / span_id while a span is current (tracing on)
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            redact_event,  # last before rendering: also covers formatted tracebacks
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service)
    # Libraries (aiohttp, nats, alembic) log through stdlib: keep them quiet but visible.
    logging.basicConfig(
        level=max(level_no, logging.WARNING),
        stream=sys.stderr,
        format="%(name)s %(levelname)s %(message)s",
    )
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _RedactFilter) for f in handler.filters):
            handler.addFilter(_RedactFilter())


class _RedactFilter(logging.Filter):
    """Masks URL secrets in stdlib log records (nats-py, aiohttp, alembic) before output."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = redact_text(message)
        if masked != message:
            record.msg, record.args = masked, None
        return True


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)


class RateLimiter:
    """Allows one event per key per ``period_s`` (e.g. one log line per worker per minute).

    Invariant: ``allow(key)`` returns True at most once per key in any window of ``period_s``;
    suppressed events are counted so the next allowed line can say how many were dropped.
    """

    def __init__(self, period_s: float = 60.0, clock=time.monotonic) -> None:
        self.period_s = period_s
        self._clock = clock
        self._last: dict[object, float] = {}
        self._suppressed: dict[object, int] = {}

    def allow(self, key: object) -> bool:
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self.period_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        self._last[key] = now
        return True

    def take_suppressed(self, key: object) -> int:
        return self._suppressed.pop(key, 0)
