"""The Endpoint Picker Protocol (GIE proposal 004) in ext_proc messages.

Data plane -> EPP: request headers, then the body in FULL_DUPLEX_STREAMED chunks until
``end_of_stream``; an optional subset hint in ``metadata_context.filter_metadata
["envoy.lb.subset_hint"]["x-gateway-destination-endpoint-subset"]`` (a list of ``ip:port``);
on the response, the endpoint that really served it in ``filter_metadata["envoy.lb"]
["x-gateway-destination-endpoint-served"]``.

EPP -> data plane: the pick as the ``x-gateway-destination-endpoint`` request header AND as
``dynamic_metadata["envoy.lb"]["x-gateway-destination-endpoint"]``, always the same value
(the spec forbids two different ones), on the request-headers response (with
``clear_route_cache``); the body sent back unchanged as one streamed chunk; or an
ImmediateResponse (503: no endpoint, 429: shed, 400 / 404: the router's answers).

Disaggregated serving (a P/D policy): the pick is the decode worker, and the request header
``x-prefiller-host-port: <ip:port>`` names the prefill worker, for llm-d's routing sidecar on
the decode pod (llm-d/llm-d-inference-scheduler v0.8.0 ``pkg/common/common.go``
``PrefillEndpointHeader``, ``pkg/common/routing/common.go`` on main at 520af47; read in
``pkg/sidecar/proxy/chat_completions.go``). Every other answer removes that header: a
client's own never reaches the sidecar (it would choose where the sidecar sends the prompt),
as llm-d's EPP deletes it before it decides (``.../profilehandler/disagg/
disagg_headers_handler.go``).

The GIE conformance suite's test EPP (``kvgate epp --conformance-test-epp``; as
kubernetes-sigs/gateway-api-inference-extension v1.6.0's lightweight EPP does,
``pkg/lwepp/handlers/request.go`` and ``response.go``, header names from
``conformance/utils/headers/headers.go``): the ``test-epp-endpoint-selection`` request header
(comma-separated ``ip`` or ``ip:port``) restricts the pick, before any subset hint; the pick
also goes out as ``X-Echo-Set-Header: x-conformance-test-served-endpoint:<pick>`` (the
suite's echo server sets that response header from it); on the response the EPP sets
``x-conformance-test-served-endpoint`` to the served endpoint the data plane reports, or
``fail: missing ...`` when it reports none.

Invariant: builders only; nothing here decides or keeps state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

DESTINATION_HEADER = "x-gateway-destination-endpoint"
PREFILL_HEADER = "x-prefiller-host-port"  # llm-d's routing sidecar: where to prefill
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
TEST_SELECTION_HEADER = "test-epp-endpoint-selection"
CONFORMANCE_SERVED_HEADER = "x-conformance-test-served-endpoint"
ECHO_SET_HEADER = "x-echo-set-header"

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def headers_of(h: pb.HttpHeaders) -> dict[str, str]:
    """Header name (lower case) -> value; Envoy sends ``raw_value`` (bytes) or ``value``."""
    out: dict[str, str] = {}
    for hv in h.headers.headers:
        raw = hv.raw_value
        out[hv.key.lower()] = raw.decode("utf-8", "replace") if raw else hv.value
    return out


def status_and_type(h: pb.HttpHeaders) -> tuple[int, str]:
    """A response's ``:status`` (200 when absent or empty; ValueError when not a number)
    and ``content-type`` ("" when absent): the only response headers the EPP reads."""
    status, ctype = "", ""
    for hv in h.headers.headers:
        key = hv.key.lower()
        if key == ":status" or key == "content-type":
            raw = hv.raw_value
            v = raw.decode("utf-8", "replace") if raw else hv.value
            if key == ":status":
                status = v
            else:
                ctype = v
    return int(status or 200), ctype


def _field(req: pb.ProcessingRequest, namespace: str, key: str) -> struct_pb2.Value | None:
    md = req.metadata_context.filter_metadata
    if namespace not in md:
        return None
    fields = md[namespace].fields
    return fields[key] if key in fields else None


def subset_hint(req: pb.ProcessingRequest) -> list[str] | None:
    """The endpoints the pick must come from; None when the data plane set no hint (an empty
    list is a hint: nothing is eligible). A comma-separated string is read as a list too."""
    v = _field(req, SUBSET_NAMESPACE, SUBSET_KEY)
    if v is None:
        return None
    kind = v.WhichOneof("kind")
    if kind == "list_value":
        return [x.string_value for x in v.list_value.values if x.string_value]
    if kind == "string_value":
        return [e.strip() for e in v.string_value.split(",") if e.strip()]
    return []


def served_endpoint(req: pb.ProcessingRequest) -> str | None:
    v = _field(req, LB_NAMESPACE, SERVED_KEY)
    if v is None or v.WhichOneof("kind") != "string_value":
        return None
    return v.string_value.split(",")[0].strip() or None


def test_selection(headers: Mapping[str, str]) -> list[str] | None:
    """The endpoints the conformance suite's ``test-epp-endpoint-selection`` header names
    (None when absent or empty)."""
    v = headers.get(TEST_SELECTION_HEADER, "")
    picked = [e.strip() for e in v.split(",") if e.strip()]
    return picked or None


def conformance_served(req: pb.ProcessingRequest) -> pb.ProcessingResponse:
    """The response-headers answer of the conformance test EPP: the served endpoint echoed
    in ``x-conformance-test-served-endpoint`` (the lightweight EPP's ``fail: ...`` text when
    the data plane did not report it)."""
    md = req.metadata_context.filter_metadata
    if LB_NAMESPACE not in md:
        value = "fail: missing envoy lb metadata"
    else:
        v = _field(req, LB_NAMESPACE, SERVED_KEY)
        ok = v is not None and v.WhichOneof("kind") == "string_value"
        value = v.string_value if ok else "fail: missing destination endpoint served metadata"
    return pb.ProcessingResponse(
        response_headers=pb.HeadersResponse(
            response=pb.CommonResponse(
                header_mutation=pb.HeaderMutation(
                    set_headers=[_set(CONFORMANCE_SERVED_HEADER, value)]
                )
            )
        )
    )


def _set(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
    )


def _add(sets: Any, key: str, value: str) -> None:
    """One more header set (``OVERWRITE_IF_EXISTS_OR_ADD``) on a ``set_headers`` field."""
    hv = sets.add()
    hv.header.key = key
    hv.header.raw_value = value.encode()
    hv.append_action = _OVERWRITE


# the pick's answer without its per-request headers, per pick value (a handful: one per
# endpoint, or per fallback list); copied and completed per request
_PICK_TEMPLATES: dict[str, pb.ProcessingResponse] = {}
_PICK_TEMPLATES_MAX = 4096


def _pick_template(endpoint: str) -> pb.ProcessingResponse:
    t = _PICK_TEMPLATES.get(endpoint)
    if t is None:
        if len(_PICK_TEMPLATES) >= _PICK_TEMPLATES_MAX:
            _PICK_TEMPLATES.clear()
        t = pb.ProcessingResponse()
        common = t.request_headers.response
        common.clear_route_cache = True
        _add(common.header_mutation.set_headers, DESTINATION_HEADER, endpoint)
        common.header_mutation.remove_headers.append(PREFILL_HEADER)
        md = t.dynamic_metadata.fields[LB_NAMESPACE].struct_value
        md.fields[DESTINATION_HEADER].string_value = endpoint
        _PICK_TEMPLATES[endpoint] = t
    return t


def pick_response(
    endpoint: str,
    body_len: int | None,
    echo: str | None = None,
    extra: dict[str, str] | None = None,
    prefill: str | None = None,
) -> pb.ProcessingResponse:
    """The request-headers answer naming the pick (header + ``envoy.lb`` metadata). The
    client's own ``x-gateway-destination-endpoint`` is overwritten, never kept. ``echo``
    (the conformance test EPP): the endpoint the suite's echo server is asked to report.
    ``extra``: more request headers for the engine (``traceparent`` while tracing is on).
    ``prefill``: the prefill worker's ``ip:port`` (``x-prefiller-host-port``); None: the
    client's ``x-prefiller-host-port``, if any, is removed."""
    out = pb.ProcessingResponse()
    out.CopyFrom(_pick_template(endpoint))
    mutation = out.request_headers.response.header_mutation
    sets = mutation.set_headers
    if prefill is not None:
        del mutation.remove_headers[:]
        _add(sets, PREFILL_HEADER, prefill)
    if extra:
        for k, v in extra.items():
            _add(sets, k, v)
    if echo is not None:
        _add(sets, ECHO_SET_HEADER, f"{CONFORMANCE_SERVED_HEADER}:{echo}")
    if body_len is not None:  # the body is sent back as a mutation: Envoy wants its length
        _add(sets, "content-length", str(body_len))
    return out


def request_body_response(body: bytes) -> pb.ProcessingResponse:
    """FULL_DUPLEX_STREAMED: the buffered request body goes back as one last chunk."""
    out = pb.ProcessingResponse()
    s = out.request_body.response.body_mutation.streamed_response
    s.body = body
    s.end_of_stream = True
    return out


# the answers that carry nothing of the request: one object each (never changed)
RESPONSE_HEADERS_PASS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
REQUEST_TRAILERS_PASS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
RESPONSE_TRAILERS_PASS = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def response_body_pass(chunk: bytes, end: bool) -> pb.ProcessingResponse:
    """FULL_DUPLEX_STREAMED: each response chunk goes back as it came."""
    out = pb.ProcessingResponse()
    s = out.response_body.response.body_mutation.streamed_response
    s.body = chunk
    s.end_of_stream = end
    return out


def immediate(
    status: int, body: bytes, headers: Mapping[str, str] | None = None, details: str = ""
) -> pb.ProcessingResponse:
    """The data plane answers the client at once with ``status`` (the request goes nowhere)."""
    sets = [_set(k.lower(), v) for k, v in (headers or {}).items()]
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),  # type: ignore[arg-type]
            headers=pb.HeaderMutation(set_headers=sets),
            body=body,
            details=details,
        )
    )
