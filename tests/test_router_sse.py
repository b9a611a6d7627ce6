"""The stream relay's byte-level reading (services/router/sse.py): once the first token is
out, a read's leading events go out in one piece (``passthrough_split``). Whatever the
engine's chunks hold and wherever its bytes are cut into reads: the client gets every byte
in order, no chunk with a usage and no ``[DONE]`` ever hides in a piece passed through, and
the counts and text read from the pieces are the ones read event by event."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from services.router import sse

TEXT = st.lists(
    st.sampled_from(["a", " ", '"', "\\", "\n", "é", "[DONE]", '"usage"', "usage: {"]),
    max_size=6,
).map("".join)


@st.composite
def events(draw) -> bytes:
    """One engine event, as bytes without its blank line."""
    kind = draw(st.sampled_from(["chunk", "chunk", "usage_null", "usage", "comment", "two_lines"]))
    text = draw(TEXT)
    choice = {"index": 0, "text": text, "finish_reason": None}
    if kind == "chunk":
        return b"data: " + json.dumps({"id": "c", "choices": [choice]}).encode()
    if kind == "usage_null":  # as engines that always name the field send it
        return b"data: " + json.dumps({"choices": [choice], "usage": None}).encode()
    if kind == "usage":
        return b"data: " + json.dumps({"choices": [], "usage": {"completion_tokens": 3}}).encode()
    if kind == "comment":
        return b": keep-alive"
    return b"event: message\ndata: " + json.dumps({"choices": [choice]}).encode()


def relay(stream: bytes, cuts: list[int]) -> list[tuple[bytes, list[bytes]]]:
    """``stream`` read in pieces cut at ``cuts``: per read, the piece passed through and the
    events to look at, as the relay gets them."""
    out, rest, prev = [], b"", 0
    for c in [*sorted(set(cuts)), len(stream)]:
        if c <= prev:
            continue
        run, evs, rest = sse.passthrough_split(rest + stream[prev:c])
        out.append((run, evs))
        prev = c
    assert rest == b""
    return out


def needs_a_look(ev: bytes) -> bool:
    payload = sse.payload_of(ev)
    return payload == b"[DONE]" or sse.inspect(payload, False).usage is not None


@settings(max_examples=300, deadline=None)
@given(
    evs=st.lists(events(), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=6),
)
def test_pieces_passed_through_hold_only_plain_events(evs: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(ev + b"\n\n" for ev in [*evs, b"data: [DONE]"])
    got = relay(stream, cuts)
    # every byte, in order
    assert b"".join(run + b"".join(ev + b"\n\n" for ev in looked) for run, looked in got) == stream
    for run, _ in got:
        in_run, tail = sse.split_events(run)
        assert tail == b""
        assert not any(needs_a_look(ev) for ev in in_run)
        # the counts and text of a piece, as event by event
        assert sse.data_events(run) == sum(1 for ev in in_run if sse.payload_of(ev))
        assert sse.texts_of(run, False) == "".join(
            sse.inspect(sse.payload_of(ev), False).text for ev in in_run
        )
    looked_at = [ev for _, looked in got for ev in looked]
    assert [ev for ev in [*evs, b"data: [DONE]"] if needs_a_look(ev)] == [
        ev for ev in looked_at if needs_a_look(ev)
    ]


def test_a_read_of_plain_chunks_goes_out_whole_and_crlf_streams_event_by_event() -> None:
    chunk = b'data: {"choices": [{"text": "ok"}]}'
    usage = b'data: {"choices": [], "usage": {"completion_tokens": 2}}'
    two = chunk + b"\n\n" + chunk + b"\n\n"
    assert sse.passthrough_split(two + b"data: {") == (two, [], b"data: {")
    assert sse.passthrough_split(two + usage + b"\n\ndata: [DONE]\n\n") == (
        two,
        [usage, b"data: [DONE]"],
        b"",
    )
    crlf = two.replace(b"\n", b"\r\n")
    assert sse.passthrough_split(crlf) == (b"", [chunk, chunk], b"")
