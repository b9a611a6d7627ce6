"""The EPP's ext_proc answers, built from per-pick templates and field by field, are the same
messages as the nested construction they replaced (what Envoy reads must not change), and a
template is never changed by what one request adds to its copy."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from services.epp import protocol as P

OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _set(k: str, v: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=OVERWRITE
    )


def nested_pick(
    endpoint: str, sets: list[tuple[str, str]], prefill: str | None = None
) -> pb.ProcessingResponse:
    """``prefill``: the P/D answer's ``x-prefiller-host-port``; without it, the answer removes
    a client's own."""
    md = struct_pb2.Struct()
    md.fields[P.LB_NAMESPACE].struct_value.fields[P.DESTINATION_HEADER].string_value = endpoint
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(
            response=pb.CommonResponse(
                header_mutation=pb.HeaderMutation(
                    set_headers=[_set(P.DESTINATION_HEADER, endpoint)]
                    + ([] if prefill is None else [_set(P.PREFILL_HEADER, prefill)])
                    + [_set(k, v) for k, v in sets],
                    remove_headers=[P.PREFILL_HEADER] if prefill is None else [],
                ),
                clear_route_cache=True,
            )
        ),
        dynamic_metadata=md,
    )


def streamed(field: str, body: bytes, end: bool) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        **{
            field: pb.BodyResponse(
                response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(
                        streamed_response=pb.StreamedBodyResponse(body=body, end_of_stream=end)
                    )
                )
            )
        }
    )


def test_pick_answers_equal_the_nested_construction() -> None:
    ep = "10.0.0.7:8000"
    first = P.pick_response(ep, 120)
    assert first == nested_pick(ep, [("content-length", "120")])
    # the template behind ``first`` is not changed by the next request's headers
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    traced = P.pick_response(ep, 7, echo=ep, extra={"traceparent": tp, "tracestate": "a=b"})
    assert traced == nested_pick(
        ep,
        [
            ("traceparent", tp),
            ("tracestate", "a=b"),
            (P.ECHO_SET_HEADER, f"{P.CONFORMANCE_SERVED_HEADER}:{ep}"),
            ("content-length", "7"),
        ],
    )
    assert P.pick_response(ep, None) == nested_pick(ep, [])
    assert first == nested_pick(ep, [("content-length", "120")])
    # another pick value gets its own template (fallback lists included)
    two = "10.0.0.8:8000,10.0.0.7:8000"
    assert P.pick_response(two, 3) == nested_pick(two, [("content-length", "3")])
    assert (
        first.SerializeToString()
        == nested_pick(ep, [("content-length", "120")]).SerializeToString()
    )


def test_pd_pick_names_the_prefill_worker_and_leaves_the_template() -> None:
    """A P/D pick sets x-prefiller-host-port and removes nothing; the template it was copied
    from still removes the client's header for the next colocated pick."""
    ep, pre = "10.0.1.7:8000", "10.0.2.9:8000"
    pd = P.pick_response(ep, 12, prefill=pre)
    assert pd == nested_pick(ep, [("content-length", "12")], prefill=pre)
    assert P.pick_response(ep, 12) == nested_pick(ep, [("content-length", "12")])
    assert list(
        P.pick_response(ep, None).request_headers.response.header_mutation.remove_headers
    ) == [P.PREFILL_HEADER]


def test_body_answers_equal_the_nested_construction() -> None:
    assert P.request_body_response(b'{"a":1}') == streamed("request_body", b'{"a":1}', True)
    assert P.response_body_pass(b"data: x\n\n", False) == streamed(
        "response_body", b"data: x\n\n", False
    )
    assert P.response_body_pass(b"", True) == streamed("response_body", b"", True)


def test_status_and_type() -> None:
    def hs(**kv: str) -> pb.HttpHeaders:
        return pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in kv.items()]
            )
        )

    got = P.status_and_type(hs(**{":status": "503", "Content-Type": "text/event-stream"}))
    assert got == (503, "text/event-stream")
    assert P.status_and_type(hs(server="x")) == (200, "")
    # ``value`` (not ``raw_value``) is read too, as headers_of reads it
    h = pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", value="404")])
    )
    assert P.status_and_type(h) == (404, "")
