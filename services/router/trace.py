"""One request's trace in the router (OpenTelemetry, services.common.tracing; built only while
tracing is on).

Spans (names, then what they measure):

- ``router.request`` (server): the whole request, child of the client's ``traceparent``;
  - ``router.parse``: body read and JSON decode; ``router.tokenize``: template and tokenizer;
  - ``router.decide`` (one per decision): the decision's inputs (prompt / max tokens, SLO,
    excluded workers, prefix overlaps per worker) and outputs (worker, reason, per-worker
    scores, filter verdicts, predicted cached tokens, replicas, hold);
  - ``router.queue``: waiting in the admission queue for capacity;
  - ``router.hold``: a follower waiting for its leader's first token;
  - ``router.upstream`` (client, one per attempt; its context is the ``traceparent`` the
    engine gets): ``upstream.connect`` (sent until the response's head), ``upstream.first_token``
    (head until the first token; streams), ``upstream.stream`` (first token until the stream's end);
  - ``router.migrate``: a broken stream continued on another worker, whose attempt is a
    ``router.upstream`` under it;
  - ``router.replicate`` (client, one per hot-prefix replica the decision sent; its context is
    the ``traceparent`` the replica's engine gets): the one-token copy, from its send to its
    answer (it may end after the request).

A request not sampled (the ratio, or a client's unsampled ``traceparent``) has no trace at
all: :func:`services.common.tracing.begin` decided so before any span, and the engine gets a
``traceparent`` marked not sampled (``Ctx.traceparent``).
Spans that end where they begin in code are live; the short steps are recorded after the
fact with the times measured on the way (no context switch on the request path).
"""

from __future__ import annotations

import time
from typing import Any

from services.common import tracing


class RequestTrace:
    __slots__ = (
        "attempt",
        "connected_ns",
        "ctx",
        "migration",
        "first_ns",
        "parent",
        "prefix",
        "recording",
        "root",
        "root_ctx",
        "start_ns",
        "tracer",
    )

    def __init__(
        self, tracer: Any, parent: Any, path: str, start_ns: int, prefix: str = "router"
    ) -> None:
        """The sampled request's root span, under ``parent`` (a client's context, from
        :func:`services.common.tracing.begin`; None: a new trace)."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        self.tracer = tracer
        self.prefix = prefix  # of span names: "router" (kvgate router), "epp" (kvgate epp)
        self.start_ns = start_ns
        self.root = tracer.start_span(
            f"{prefix}.request",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=start_ns,
            attributes={"http.request.method": "POST", "url.path": path},
        )
        self.recording: bool = self.root.is_recording()
        self.root_ctx = trace.set_span_in_context(self.root)
        self.parent = self.root_ctx  # of the next attempt: the root's, or a migration's
        self.attempt: Any = None  # the attempt in flight (its context goes upstream)
        self.connected_ns = 0
        self.first_ns = 0
        self.ctx: Any = None  # the request's Ctx once it has one (bind)
        self.migration: Any = None  # the migration span in progress

    def bind(self, ctx: Any) -> RequestTrace:
        self.ctx = ctx
        return self

    # ------------------------------------------------------------------ recorded after the fact
    def step(
        self, name: str, start_ns: int, end_ns: int, attrs: dict[str, Any] | None = None
    ) -> None:
        """A finished step ``<prefix>.<name>`` of ``start_ns``..``end_ns`` under the request."""
        if self.recording:
            span = self.tracer.start_span(
                f"{self.prefix}.{name}",
                context=self.root_ctx,
                start_time=start_ns,
                attributes=attrs,
            )
            span.end(end_ns)

    def decided(self, start_ns: int, end_ns: int, ctx: Any, d: Any, overlaps: dict) -> None:
        """One decision: what it was asked and what it answered."""
        if not self.recording:
            return
        p = ctx.parsed
        attrs: dict[str, Any] = {
            "kvgate.policy": ctx.arm.label,
            "kvgate.arm": ctx.arm.name,
            "kvgate.model": p.model or "",
            "kvgate.prompt_tokens": len(p.token_ids),
            "kvgate.max_tokens": p.max_tokens,
            "kvgate.decision.overlap_blocks_by_worker": tracing.as_json(overlaps),
            "kvgate.decision.scores": tracing.as_json(
                {w: round(s, 6) for w, s in d.scores.items()}
            ),
            "kvgate.decision.reason": d.reason,
        }
        if d.worker_id is not None:
            attrs["kvgate.worker"] = d.worker_id
            attrs["kvgate.decision.overlap_blocks"] = d.overlap_blocks
            attrs["kvgate.decision.cached_tokens"] = d.cached_tokens
        if d.available_tokens:  # reuse attribution (services.core.policy.attribution)
            attrs["kvgate.decision.available_tokens"] = d.available_tokens
        if d.lost_reason:
            attrs["kvgate.decision.lost_reason"] = d.lost_reason
        if d.filtered:
            attrs["kvgate.decision.filtered"] = tracing.as_json(d.filtered)
        if ctx.excluded:
            attrs["kvgate.decision.excluded"] = sorted(ctx.excluded)
        if ctx.session_id:
            attrs["kvgate.session"] = ctx.session_id
        if ctx.slo.ttft_s is not None:
            attrs["kvgate.slo.ttft_s"] = ctx.slo.ttft_s
        if ctx.slo.tpot_s is not None:
            attrs["kvgate.slo.tpot_s"] = ctx.slo.tpot_s
        if d.wait:
            attrs["kvgate.decision.wait"] = True
        if d.shed:
            attrs["kvgate.decision.shed"] = True
        if d.never_fits:
            attrs["kvgate.decision.never_fits"] = d.never_fits
        if d.replicate_to:
            attrs["kvgate.decision.replicate_to"] = list(d.replicate_to)
        if d.after is not None:
            attrs["kvgate.decision.after"] = d.after
            attrs["kvgate.decision.hold_s"] = d.hold_s
        if d.prefill_worker is not None:
            attrs["kvgate.decision.prefill_worker"] = d.prefill_worker
        self.step("decide", start_ns, end_ns, attrs)

    # ------------------------------------------------------------------ live spans
    def start_attempt(self, worker_id: str, url: str, attempt: int) -> None:
        """An attempt on ``worker_id`` begins: its span is the engine's parent."""
        if not self.recording:
            return
        self.attempt = self._client_span(
            "upstream",
            self.parent,
            {"kvgate.worker": worker_id, "server.address": url, "kvgate.attempt": attempt},
        )
        self.connected_ns = self.first_ns = 0

    def start_replica(self, worker_id: str, url: str, request_id: str) -> Any:
        """A hot-prefix replica this request's decision sent (a one-token copy, in the
        background): a client span under the request (it may end after the request does),
        whose context the engine gets; None when the request is not recording."""
        if not self.recording:
            return None
        return self._client_span(
            "replicate",
            self.root_ctx,
            {"kvgate.worker": worker_id, "server.address": url, "kvgate.request_id": request_id},
        )

    def _client_span(self, name: str, context: Any, attributes: dict[str, Any]) -> Any:
        """A CLIENT span ``<prefix>.<name>`` under ``context``: a call this request makes."""
        from opentelemetry.trace import SpanKind

        return self.tracer.start_span(
            f"{self.prefix}.{name}", context=context, kind=SpanKind.CLIENT, attributes=attributes
        )

    def connected(self) -> None:
        """The worker's response head arrived."""
        if self.attempt is not None and not self.connected_ns:
            self.connected_ns = time.time_ns()

    def first_token(self) -> None:
        if self.attempt is not None and not self.first_ns:
            self.first_ns = time.time_ns()
            if not self.connected_ns:
                self.connected_ns = self.first_ns

    def end_attempt(self, status: str, error: str | None = None, streamed: bool = False) -> None:
        """The attempt ended: its steps recorded under it."""
        span = self.attempt
        if span is None:
            return
        self.attempt = None
        from opentelemetry import trace

        end = time.time_ns()
        under = trace.set_span_in_context(span)
        start = span.start_time
        steps = []
        if self.connected_ns:
            # (a whole response's head is its first token: connect is all there is to show)
            steps.append(("upstream.connect", start, self.connected_ns))
            if self.first_ns and streamed:
                steps.append(("upstream.first_token", self.connected_ns, self.first_ns))
                steps.append(("upstream.stream", self.first_ns, end))
        for name, s, e in steps:
            self.tracer.start_span(name, context=under, start_time=s).end(e)
        span.set_attribute("kvgate.outcome", status)
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end)

    def start_migration(self, failed: str, reason: str, generated_tokens: int) -> None:
        """A broken stream is continued elsewhere: the broken attempt (and a previous
        continuation) end; the next attempt is this migration's child."""
        if not self.recording:
            return
        from opentelemetry import trace

        self.end_attempt("broken", reason, streamed=True)
        self.end_migration("broken")
        span = self.migration = self.tracer.start_span(
            f"{self.prefix}.migrate",
            context=self.root_ctx,
            attributes={
                "kvgate.failed_worker": failed,
                "kvgate.reason": reason,
                "kvgate.generated_tokens": generated_tokens,
            },
        )
        self.parent = trace.set_span_in_context(span)

    def end_migration(self, outcome: str) -> None:
        span, self.migration = self.migration, None
        self.parent = self.root_ctx
        if span is not None:
            self.end_attempt(outcome, streamed=True)
            span.set_attribute("kvgate.outcome", outcome)
            span.end()

    def headers_into(self, headers: dict[str, str]) -> None:
        """The engine's ``traceparent``: the attempt's context (the request's when it is not
        sampled: the engine learns it is not)."""
        tracing.inject(self.attempt if self.attempt is not None else self.root, headers)

    def finish(self, ctx: Any) -> None:
        """The request is over: its outcome on the root span."""
        root = self.root
        if self.recording:
            self.end_migration(ctx.status)
            if self.attempt is not None:  # cancelled mid-attempt
                self.end_attempt(ctx.status)
            attrs: dict[str, Any] = {
                "kvgate.request_id": ctx.request_id,
                "kvgate.outcome": ctx.status,
                "http.response.status_code": ctx.http_status,
                "kvgate.stream": bool(ctx.parsed.stream) if ctx.parsed is not None else False,
                "kvgate.retries": ctx.retries,
                "kvgate.migrations": ctx.migrated,
            }
            if ctx.worker_id is not None:
                attrs["kvgate.worker"] = ctx.worker_id
                attrs["kvgate.predicted_cached_tokens"] = ctx.predicted_cached
            if ctx.cached_reported is not None:
                attrs["kvgate.reported_cached_tokens"] = ctx.cached_reported
            if ctx.ttft is not None:
                attrs["kvgate.ttft_s"] = ctx.ttft
            root.set_attributes(attrs)
            if ctx.http_status >= 500:
                from opentelemetry.trace import Status, StatusCode

                root.set_status(Status(StatusCode.ERROR, ctx.status))
        root.end()

    def refused(self, status: int) -> None:
        """Refused before it had a context (a bad body): the root ends with the refusal."""
        if self.recording:
            self.root.set_attributes(
                {"http.response.status_code": status, "kvgate.outcome": "rejected"}
            )
        self.root.end()


def end_replica(span: Any, outcome: str, error: str | None) -> None:
    """A replica's span (:meth:`RequestTrace.start_replica`) ends with its outcome."""
    span.set_attribute("kvgate.outcome", outcome)
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end()
