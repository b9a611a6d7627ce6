"""Server-sent events from OpenAI-compatible engines: split, inspect, re-frame. Pure.

An engine stream is lines ``data: {json}`` separated by blank lines, ending with
``data: [DONE]``. The router passes each event through as soon as it is complete, and reads
from it the text generated so far (for migration), the usage (cached tokens) and whether
the stream finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

_decode = msgspec.json.decode
_encode = msgspec.json.encode


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
