"""One ext_proc stream: one HTTP request through the data plane, as a state machine.

    request headers --(end_of_stream: no body)--> pick
    request headers -> body chunks ... (end_of_stream) --> pick
    pick -> [headers response with the endpoint, body sent back] | ImmediateResponse (done)
    response headers -> response body chunks (passed back as they come, read for the first
    token, token chunks and usage: services/epp/response_watch.py) -> end

Invariants: answers go out in the order ext_proc requires (request headers, request body,
response headers, response body); the pick's ticket is released and its outcome recorded
exactly once, in :meth:`EppStream.close` (the servicer calls it in ``finally``, also when the
data plane drops the stream); the request body is sent back byte for byte.
"""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from services.router.http_server import Response

from . import metrics as M
from . import protocol as P
from .picker import Pick, Picker
from .response_watch import ResponseWatch


class ProtocolError(Exception):
    """The data plane sent something this EPP cannot follow (``reason`` labels the metric)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class EppStream:
    def __init__(self, picker: Picker, max_body_bytes: int, conformance: bool = False) -> None:
        self.picker = picker
        self.max_body_bytes = max_body_bytes
        self.conformance = conformance  # the GIE conformance suite's test EPP (protocol.py)
        self.headers: dict[str, str] | None = None
        self.subset: list[str] | None = None
        self.body = bytearray()
        self.pick: Pick | None = None
        self.done = False  # an ImmediateResponse went out: nothing more to answer
        self.response_started = False
        self.finished = False  # the response's last chunk was seen
        self.body_seen = False  # a response body message came
        self.watch: ResponseWatch | None = None

    async def on(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The answers to one message of the data plane (none while a body is buffered)."""
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            self.headers = P.headers_of(req.request_headers)
            self.subset = P.subset_hint(req)
            if self.conformance:  # the suite's selection header comes before any hint
                self.subset = P.test_selection(self.headers) or self.subset
            if req.request_headers.end_of_stream:
                return await self._decide(None)
            return []
        if kind == "request_body":
            if self.headers is None:
                raise ProtocolError("body_before_headers", "request body before its headers")
            self.body += req.request_body.body
            if len(self.body) > self.max_body_bytes:
                self.done = True
                M.PICKS.labels("413").inc()
                return [
                    self._immediate(
                        Response(
                            b'{"error":{"message":"request body too large","type":'
                            b'"invalid_request_error","param":null,"code":413}}',
                            413,
                        )
                    )
                ]
            if req.request_body.end_of_stream:
                return await self._decide(bytes(self.body))
            return []
        if kind == "request_trailers":
            # trailers end a body whose last chunk did not say so: decide on what came
            if self.pick is None and self.headers is not None:
                decided = await self._decide(bytes(self.body))
                return decided if self.done else [*decided, P.REQUEST_TRAILERS_PASS]
            return [P.REQUEST_TRAILERS_PASS]
        if kind == "response_headers":
            return self._on_response_headers(req)
        if kind == "response_body":
            self.body_seen = True
            chunk, end = req.response_body.body, req.response_body.end_of_stream
            if self.pick is not None:
                if chunk and self.pick.ctx.ttft is None:
                    self.picker.first_token(self.pick)
                if self.watch is not None:
                    self.watch.chunk(chunk, end)
                if end:
                    self.finished = True
            return [P.response_body_pass(chunk, end)]
        if kind == "response_trailers":
            self.finished = True
            return [P.RESPONSE_TRAILERS_PASS]
        raise ProtocolError("unknown_message", f"unexpected ext_proc message {kind!r}")

    def _on_response_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.response_started = True
        p = self.pick
        if p is not None:
            status, ctype = P.status_and_type(req.response_headers)
            p.ctx.http_status = status
            if p.ctx.trace is not None:
                p.ctx.trace.connected()
            if status >= 400:
                p.ctx.status = "error"
            streamed = "text/event-stream" in ctype
            self.watch = ResponseWatch(p.ctx, streamed)
            served = P.served_endpoint(req)
            if served:
                self.picker.served_by(p, served)
            if req.response_headers.end_of_stream:
                self.finished = True
        if self.conformance:
            return [P.conformance_served(req)]
        return [P.RESPONSE_HEADERS_PASS]

    async def _decide(self, body: bytes | None) -> list[pb.ProcessingResponse]:
        assert self.headers is not None
        got = await self.picker.pick(self.headers, body, self.subset)
        if isinstance(got, Response):
            self.done = True
            return [self._immediate(got)]
        self.pick = got
        echo = got.endpoint if self.conformance else None
        extra: dict[str, str] | None = None
        if got.ctx.trace is not None:  # the engine continues the EPP's trace
            extra = {}
            got.ctx.trace.headers_into(extra)
        elif got.ctx.traceparent is not None:  # not sampled: the engine is told so
            extra = {"traceparent": got.ctx.traceparent}
        n = None if body is None else len(body)
        out = [P.pick_response(got.value, n, echo, extra, got.prefill)]
        if body is not None:
            out.append(P.request_body_response(body))
        return out

    @staticmethod
    def _immediate(r: Response) -> pb.ProcessingResponse:
        headers = {k: v for k, v in r.headers.items() if k.lower() != "content-length"}
        return P.immediate(r.status, r.body, headers)

    def data_plane_closed(self) -> None:
        """The data plane closed its side of the stream (Envoy does when the request is over).
        A response whose headers came and whose body it does not send (``response_body_mode:
        NONE``) ended there, as far as the EPP can tell; one whose body was coming did not
        (the client left mid-body: cancelled)."""
        if self.response_started and not self.body_seen:
            self.finished = True

    def close(self) -> None:
        if self.pick is not None:
            p, self.pick = self.pick, None
            self.picker.settle(p, self.finished)
