"""OpenTelemetry tracing: off unless asked for, configured by the standard ``OTEL_*`` variables.

On when ``--otel`` (``KVGATE_OTEL``) is given or ``OTEL_TRACES_EXPORTER`` names an exporter
(and ``OTEL_SDK_DISABLED`` is not true). Then:

- exporters from ``OTEL_TRACES_EXPORTER`` (comma-separated: ``otlp`` = OTLP over HTTP/protobuf
  to ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``, default ``http://localhost:4318``; ``console`` =
  one JSON object per span on stdout; ``none``), ``otlp`` when only the flag is given; spans
  leave in batches (``OTEL_BSP_*``), off the request path;
- the sampler from ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` when set, else
  parent-based with ratio ``--otel-sample-ratio`` (a client's ``traceparent`` decides for its
  request: sampled or not; new traces are sampled at the ratio);
- ``service.name`` from ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``, else
  ``kvgate-<service>``.

Off, :func:`tracer` answers None and the services skip every span: the request path pays one
``is None`` test (and passes a client's ``traceparent`` through untouched).

Trace context travels as W3C ``traceparent`` / ``tracestate`` headers (:func:`extract`,
:func:`inject`), and log lines written while a span is current carry its ``trace_id`` and
``span_id`` (:func:`add_trace_ids`, a structlog processor).
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Mapping, MutableMapping
from typing import Any

from services.common.settings import option

OTEL = option(
    "otel",
    False,
    "export OpenTelemetry traces (exporter, endpoint, sampler and service name from the "
    "standard OTEL_* variables; also on when OTEL_TRACES_EXPORTER is set)",
)
OTEL_SAMPLE_RATIO = option(
    "otel_sample_ratio",
    1.0,
    "fraction of new traces sampled (parent-based: a client's traceparent decides for its "
    "request); OTEL_TRACES_SAMPLER, when set, takes precedence",
)
OPTIONS = (OTEL, OTEL_SAMPLE_RATIO)

EXPORTERS = ("otlp", "console", "none")

_provider: Any = None  # the installed TracerProvider (None: tracing off)
_tracers: dict[str, Any] = {}
_on = False  # read by add_trace_ids on every log line


class TracingError(ValueError):
    """A tracing setting the SDK cannot honour (unknown exporter, gRPC protocol)."""


def wanted(st: Any = None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether tracing is asked for: the flag, or an exporter named in the environment."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = [e for e in _names(env.get("OTEL_TRACES_EXPORTER", "")) if e != "none"]
    return bool(getattr(st, "otel", False)) or bool(exporters)


def _names(text: str) -> list[str]:
    return [e.strip().lower() for e in text.split(",") if e.strip()]


def setup(service: str, st: Any = None, environ: Mapping[str, str] | None = None) -> bool:
    """Install a tracer provider for ``service`` when tracing is asked for; whether it is on.
    A setting the SDK cannot honour raises :class:`TracingError` (the service does not start)."""
    env = os.environ if environ is None else environ
    if not wanted(st, env):
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    names = _names(env.get("OTEL_TRACES_EXPORTER", "")) or ["otlp"]
    unknown = sorted(set(names) - set(EXPORTERS))
    if unknown:
        raise TracingError(
            f"OTEL_TRACES_EXPORTER: unknown exporter(s) {unknown}; kvgate ships {list(EXPORTERS)}"
        )
    ratio = float(getattr(st, "otel_sample_ratio", 1.0))
    if not 0.0 <= ratio <= 1.0:
        raise TracingError(f"--otel-sample-ratio must be within [0, 1], not {ratio}")
    named = "OTEL_SERVICE_NAME" in env or "service.name=" in env.get("OTEL_RESOURCE_ATTRIBUTES", "")
    resource = Resource.create({} if named else {"service.name": f"kvgate-{service}"})
    sampler = None if env.get("OTEL_TRACES_SAMPLER") else ParentBased(TraceIdRatioBased(ratio))
    provider = TracerProvider(resource=resource, sampler=sampler, id_generator=_id_generator())
    for name in names:
        exporter = _exporter(name, env)
        if exporter is not None:
            provider.add_span_processor(BatchSpanProcessor(exporter))
    # the batch processor logs one warning per span it drops (its queue full: the collector
    # is slower than the spans come): one line a minute says it, with the count meanwhile
    logging.getLogger("opentelemetry.sdk._shared_internal").addFilter(_OncePerMinute())
    install(provider)
    return True


class _OncePerMinute(logging.Filter):
    """Passes a record at most once a minute per message; the next one says how many were
    held back."""

    def __init__(self) -> None:
        from services.common.logging import RateLimiter  # (that module imports this one)

        super().__init__()
        self.limiter = RateLimiter(60.0)

    def filter(self, record: logging.LogRecord) -> bool:
        key = record.msg
        if not self.limiter.allow(key):
            return False
        held = self.limiter.take_suppressed(key)
        if held:
            record.msg = f"{record.msg} ({held} more such lines held back in the last minute)"
        return True


def _exporter(name: str, env: Mapping[str, str]) -> Any:
    if name == "none":
        return None
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter(formatter=lambda s: s.to_json(indent=None) + os.linesep)
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    if protocol != "http/protobuf":
        raise TracingError(
            f"OTLP protocol {protocol!r}: kvgate ships the http/protobuf exporter only "
            "(collectors listen for it on port 4318)"
        )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def install(provider: Any) -> None:
    """Trace with ``provider`` from now on (also the global one, for libraries)."""
    global _provider, _on
    from opentelemetry import trace

    _provider = provider
    # begin() draws new traces' ids (tracers made from now on read the generator)
    provider.id_generator = _id_generator()
    _tracers.clear()
    _on = True
    _FAST.clear()
    _FAST.update(_fast_rule(provider.sampler))
    # the global provider can be set once per process; tests install several in turn
    if not isinstance(trace.get_tracer_provider(), type(provider)):
        trace.set_tracer_provider(provider)


def uninstall() -> None:
    """Tracing off again (tests): components built from now on get no tracer."""
    global _provider, _on
    _provider = None
    _tracers.clear()
    _on = False


def tracer(scope: str) -> Any:
    """The tracer of component ``scope`` (``kvgate.router``), or None while tracing is off.
    Components take theirs when built and test it for None on each request."""
    if _provider is None:
        return None
    t = _tracers.get(scope)
    if t is None:
        t = _tracers[scope] = _provider.get_tracer(scope)
    return t


def enabled() -> bool:
    return _on


# ---------------------------------------------------------------------- W3C trace context
def extract(headers: Mapping[str, str]) -> Any:
    """The OpenTelemetry context of a request's ``traceparent`` / ``tracestate`` (an empty
    context when it has none or a malformed one: the request starts a new trace)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(headers)


def inject(span: Any, headers: MutableMapping[str, str]) -> None:
    """``traceparent`` (and ``tracestate``) of ``span`` into outgoing ``headers``."""
    sc = span.get_span_context()
    if not sc.is_valid:
        return
    headers["traceparent"] = f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{sc.trace_flags:02x}"
    if sc.trace_state:
        headers["tracestate"] = sc.trace_state.to_header()


def _ids() -> Any:
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class PresetIds(RandomIdGenerator):
        """The SDK's random ids, except a new trace's id when :func:`begin` drew it first
        (the sampler decides on the trace id: the span gets the id it was sampled on)."""

        preset = 0

        def generate_trace_id(self) -> int:
            t = self.preset
            if t:
                self.preset = 0
                return t
            return super().generate_trace_id()

    return PresetIds()


_IDS: Any = None


def _id_generator() -> Any:
    global _IDS
    if _IDS is None:
        _IDS = _ids()
    return _IDS


_FAST: dict[str, int] = {}  # {"bound", "mask"} while the sampler is parent-based ratio


def _fast_rule(sampler: Any) -> dict[str, int]:
    """The SDK's parent-based ratio sampler with its default delegates, as two numbers: a
    new trace is sampled when its id's low 64 bits (``mask``) are below ``bound``
    (``TraceIdRatioBased.should_sample``); a client's trace when its sampled flag is set."""
    from opentelemetry.sdk.trace.sampling import (
        ALWAYS_OFF,
        ALWAYS_ON,
        ParentBased,
        TraceIdRatioBased,
    )

    if not isinstance(sampler, ParentBased):
        return {}
    root = getattr(sampler, "_root", None)
    delegates = (
        getattr(sampler, "_remote_parent_sampled", None),
        getattr(sampler, "_remote_parent_not_sampled", None),
    )
    if not isinstance(root, TraceIdRatioBased) or delegates != (ALWAYS_ON, ALWAYS_OFF):
        return {}
    return {"bound": root.bound, "mask": TraceIdRatioBased.TRACE_ID_LIMIT}


_HEX = frozenset("0123456789abcdef")
_random_bits = random.getrandbits  # ids of the traces not sampled (as the SDK draws them)


def _parse_traceparent(tp: str) -> tuple[int, bool] | None:
    """(trace id, sampled) of a valid version-00 ``traceparent`` (W3C), else None."""
    if len(tp) != 55 or tp[:3] != "00-" or tp[35] != "-" or tp[52] != "-":
        return None
    ids = tp[3:35] + tp[36:52] + tp[53:]
    if not _HEX.issuperset(ids):
        return None
    trace_id, span_id = int(tp[3:35], 16), int(tp[36:52], 16)
    if not trace_id or not span_id:
        return None
    return trace_id, bool(int(tp[53:], 16) & 1)


def begin(headers: Mapping[str, str]) -> tuple[Any, str | None]:
    """The sampler's decision for a request arriving with ``headers``, before any span: for a
    sampled one (the parent context to start its root span in, None); for one not sampled
    (None, the ``traceparent`` to forward: the client's trace, or a new one, marked not
    sampled). A dropped request thus costs one sampler call, not the SDK's span machinery
    (a non-recording span and its context: ~25 µs a request here)."""
    provider = _provider
    tp = headers.get("traceparent")
    fast = _FAST
    if fast:  # the default sampler's rule without its objects (~1 µs against ~4-9)
        parsed = _parse_traceparent(tp) if tp is not None else None
        if parsed is not None:
            trace_id, sampled = parsed
            if sampled:
                return extract(headers), None
        else:
            trace_id = _random_bits(128)
            if trace_id & fast["mask"] < fast["bound"]:
                provider.id_generator.preset = trace_id
                return None, None
        return None, f"00-{trace_id:032x}-{_random_bits(64):016x}-00"
    from opentelemetry import trace

    parent = None
    trace_id = 0
    if tp is not None:
        parent = extract(headers)
        sc = trace.get_current_span(parent).get_span_context()
        if sc.is_valid:
            trace_id = sc.trace_id
        else:
            parent = None
    ids = provider.id_generator  # ours (install)
    if not trace_id:
        trace_id = ids.generate_trace_id()
    result = provider.sampler.should_sample(parent, trace_id, "request")
    if result.decision.is_recording():
        if parent is None:
            ids.preset = trace_id  # the root span's trace id: the one sampled
        return parent, None
    return None, f"00-{trace_id:032x}-{_random_bits(64):016x}-00"


def as_json(value: Any) -> str:
    """A mapping as one span attribute (attributes hold scalars and lists only)."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True, default=str)


# ---------------------------------------------------------------------- logs
def add_trace_ids(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> Any:
    """structlog processor: ``trace_id`` / ``span_id`` of the current span, when one is."""
    if _on:
        from opentelemetry import trace

        sc = trace.get_current_span().get_span_context()
        if sc.is_valid:
            event.setdefault("trace_id", format(sc.trace_id, "032x"))
            event.setdefault("span_id", format(sc.span_id, "016x"))
    return event


# ---------------------------------------------------------------------- aiohttp servers
def aiohttp_middleware(tracer: Any, prefix: str, skip: tuple[str, ...] = ()) -> Any:
    """An aiohttp middleware: one server span per request (``<prefix> <METHOD> <route>``, the
    route as declared: ``/v1/policies/{name}``), child of the request's ``traceparent`` and
    current while the handler runs; requests whose path starts with one of ``skip`` (probes,
    scrapes) are not traced."""
    from aiohttp import web
    from opentelemetry import context, trace
    from opentelemetry.trace import SpanKind, Status, StatusCode

    @web.middleware
    async def traced(request: web.Request, handler: Any) -> Any:
        path = request.path
        if skip and path.startswith(skip):
            return await handler(request)
        info = request.match_info
        resource = info.route.resource if info.route is not None else None
        route = resource.canonical if resource is not None else path
        span = tracer.start_span(
            f"{prefix} {request.method} {route}",
            context=extract(request.headers) if "traceparent" in request.headers else None,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": request.method, "http.route": route},
        )
        token = context.attach(trace.set_span_in_context(span))
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as exc:
            status = exc.status
            raise
        except BaseException as exc:
            span.record_exception(exc)
            raise
        finally:
            context.detach(token)
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))
            span.end()

    return traced
