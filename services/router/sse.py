"""Server-sent events from OpenAI-compatible engines: split, inspect, re-frame. Pure.

An engine stream is lines ``data: {json}`` separated by blank lines, ending with
``data: [DONE]``. The router passes each event through as soon as it is complete, and reads
from it the text generated so far (for migration), the usage (cached tokens) and whether
the stream finished.

Cost: an event is decoded whole (:func:`inspect`) only where the router needs more than its
text: until the first token, and for the chunks that carry a ``usage`` (:func:`has_usage`,
a byte search); every other chunk is passed through as it came, its bytes kept for its
text, which :func:`text_of` (a typed decode of ``choices[].text`` / ``delta.content`` only)
reads only if a migration needs it. Once the first token is out, what one read brought is
not even split into events up to the first one that may need a look (:func:`plain_run`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

_decode = msgspec.json.decode
_encode = msgspec.json.encode

_CRLF_BOUNDARY = re.compile(rb"\r?\n\r?\n")


def split_events(buf: bytes) -> tuple[list[bytes], bytes]:
    """Complete events in ``buf`` (without their blank-line separator) and the rest (an
    incomplete event, kept for the next read)."""
    parts = buf.split(b"\n\n") if b"\r" not in buf else _CRLF_BOUNDARY.split(buf)
    return parts[:-1], parts[-1]


def payload_of(event: bytes) -> bytes:
    """The event's ``data:`` lines' content, joined (b"" for an event without data)."""
    if event.startswith(b"data:") and b"\n" not in event:
        return event[5:].strip()
    return b"".join(
        ln[5:].strip() for ln in event.replace(b"\r", b"").split(b"\n") if ln.startswith(b"data:")
    )


def has_usage(payload: bytes) -> bool:
    """Might the payload carry a ``usage`` object? (False only when it surely does not: no
    ``"usage"`` key, or ``"usage": null``; a JSON string never holds an unescaped quote.)"""
    i = payload.find(b'"usage"')
    if i < 0:
        return False
    return not payload[i + 7 : i + 16].lstrip(b": \t").startswith(b"null") or (
        payload.find(b'"usage"', i + 7) >= 0
    )


def plain_run(events: bytes) -> int:
    """How many leading bytes of ``events`` (whole events, each ending in a blank line, no CR)
    are events that surely carry neither a ``usage`` nor ``[DONE]``: the router may pass them
    through in one piece. A byte search over them all; an event it cannot rule out (a
    ``"usage"`` not followed by ``null``, the text ``[DONE]`` anywhere) ends the run."""
    stop = events.find(b"[DONE]")
    if stop < 0:
        stop = len(events)
    i = events.find(b'"usage"', 0, stop)
    while i >= 0:
        if not events[i + 7 : i + 16].lstrip(b": \t").startswith(b"null"):
            stop = i
            break
        i = events.find(b'"usage"', i + 7, stop)
    if stop == len(events):
        return stop
    end = events.rfind(b"\n\n", 0, stop)  # of the last event before the one to look at
    return end + 2 if end >= 0 else 0


def passthrough_split(buf: bytes) -> tuple[bytes, list[bytes], bytes]:
    """A read once the first token is out: the leading whole events that go out as they came
    (:func:`plain_run`), the whole events after them (without their blank line) to look at
    one by one, and the incomplete rest. Bytes with a CR: every event to look at."""
    if b"\r" in buf:
        events, rest = split_events(buf)
        return b"", events, rest
    end = buf.rfind(b"\n\n") + 2
    if end < 2:
        return b"", [], buf
    whole, rest = buf[:end], buf[end:]
    n = plain_run(whole)  # (a slice of all of it is ``whole`` itself, not a copy)
    return whole[:n], whole[n:].split(b"\n\n")[:-1], rest


def data_events(run: bytes) -> int:
    """The events with data in ``run`` (whole events, no CR): counted by their separators
    when each begins with its ``data:`` line (as engines write them), else one by one."""
    n = run.count(b"\n\n")
    if run.count(b"\n\ndata:") + run.startswith(b"data:") == n:
        return n
    parts, _ = split_events(run)
    return sum(1 for ev in parts if payload_of(ev))


def texts_of(events: bytes, chat: bool) -> str:
    """The generated text of whole events as they came (:func:`text_of` of each)."""
    parts, _ = split_events(events)
    return "".join(text_of(payload_of(ev), chat) for ev in parts)


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None


_chunk_decoder = msgspec.json.Decoder(_Chunk)


def text_of(payload: bytes, chat: bool) -> str:
    """The generated text of one chunk (as :func:`inspect` reads it), decoding only that."""
    try:
        chunk = _chunk_decoder.decode(payload)
    except msgspec.DecodeError:  # not the usual shape: the general reading
        return inspect(payload, chat).text
    if not chunk.choices:
        return ""
    if chat:
        parts = [c.delta.content for c in chunk.choices if c.delta is not None and c.delta.content]
    else:
        parts = [c.text for c in chunk.choices if c.text]
    return parts[0] if len(parts) == 1 else "".join(parts)  # type: ignore[arg-type]


@dataclass
class EventInfo:
    done: bool = False  # the [DONE] marker
    text: str = ""  # generated text in this event
    usage: dict[str, Any] | None = None
    usage_only: bool = False  # an include_usage chunk with no choices
    finished: bool = False  # a choice carried a finish_reason
    data: dict[str, Any] | None = None


def inspect(payload: bytes, chat: bool) -> EventInfo:
    """Look inside one ``data:`` payload (bytes after ``data: ``)."""
    payload = payload.strip()
    if payload == b"[DONE]":
        return EventInfo(done=True)
    try:
        data = _decode(payload)
    except msgspec.DecodeError:
        return EventInfo()
    if not isinstance(data, dict):
        return EventInfo()
    info = EventInfo(data=data)
    usage = data.get("usage")
    if isinstance(usage, dict):
        info.usage = usage
    choices = data.get("choices") or []
    if not choices and info.usage is not None:
        info.usage_only = True
    for ch in choices:
        if not isinstance(ch, dict):
            continue
        if chat:
            delta = ch.get("delta") or {}
            t = delta.get("content") if isinstance(delta, dict) else None
        else:
            t = ch.get("text")
        if isinstance(t, str):
            info.text += t
        if ch.get("finish_reason"):
            info.finished = True
    return info


def cached_tokens_of(usage: dict[str, Any] | None) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` (OpenAI / vLLM), if reported."""
    if not usage:
        return None
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return details["cached_tokens"]
    return None


def event(data: dict[str, Any]) -> bytes:
    return b"data: " + _encode(data) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def as_client_chunk(
    info: EventInfo, chat: bool, template: dict[str, Any] | None
) -> dict[str, Any] | None:
    """Re-frame a completions chunk from a migration target as the client's format.

    ``template`` is a chunk the client already received (id, created, model are kept)."""
    if info.data is None:
        return None
    if not chat:
        out = dict(info.data)
        if template:
            out["id"] = template.get("id", out.get("id"))
        return out
    finish = None
    for ch in info.data.get("choices") or []:
        if isinstance(ch, dict) and ch.get("finish_reason"):
            finish = ch["finish_reason"]
    base = template or {}
    out: dict[str, Any] = {
        "id": base.get("id", info.data.get("id", "")),
        "object": "chat.completion.chunk",
        "created": base.get("created", info.data.get("created", 0)),
        "model": base.get("model", info.data.get("model", "")),
        "choices": [{"index": 0, "delta": {"content": info.text}, "finish_reason": finish}]
        if not info.usage_only
        else [],
    }
    if info.usage is not None:
        out["usage"] = info.usage
    return out
