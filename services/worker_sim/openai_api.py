"""OpenAI request parsing and response shapes for the simulated worker. Pure, no I/O.

Invariant: :func:`parse_request` either returns a fully checked :class:`ParsedRequest` or
raises :class:`ApiError` with the HTTP status and an OpenAI-style message naming the field.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from services.common.tokenizer import Tokenizer, prompt_from_request

Kind = Literal["completion", "chat"]


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, etype: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.etype = etype or (
            "invalid_request_error" if status < 500 else "service_unavailable_error"
        )

    def body(self) -> dict[str, Any]:
        """OpenAI's error shape (vLLM adds the numeric code)."""
        return {
            "error": {
                "message": self.message,
                "type": self.etype,
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass
class ParsedRequest:
    kind: Kind
    model: str
    lora: str | None
    prompt: str
    max_tokens: int
    stream: bool
    include_usage: bool


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer, got {value!r}", name)
    if value <= 0:
        raise ApiError(400, f"'{name}' must be at least 1, got {value}", name)
    return value


def parse_request(
    kind: Kind,
    body: Any,
    tokenizer: Tokenizer,
    served_model: str,
    loras: tuple[str, ...] = (),
    default_max_tokens: int = 128,
    strict_model: bool = False,
) -> ParsedRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if kind == "chat" and "messages" not in body:
        raise ApiError(400, "'messages' is required", "messages")
    if kind == "completion" and "prompt" not in body:
        raise ApiError(400, "'prompt' is required", "prompt")
    model = body.get("model") or served_model
    if not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", "model")
    lora = model if model in loras else None
    if strict_model and lora is None and model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", "model", "NotFoundError")
    n = body.get("n", 1)
    if n != 1:
        raise ApiError(400, "only n=1 is supported", "n")
    max_tokens = _int_field(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    include_usage = bool(opts.get("include_usage", False))
    if kind == "chat":
        sub = {"messages": body["messages"]}
    else:
        sub = {"prompt": body["prompt"]}
    try:
        prompt = prompt_from_request(tokenizer, sub)
    except ValueError as exc:
        raise ApiError(400, str(exc), "messages" if kind == "chat" else "prompt") from None
    return ParsedRequest(
        kind=kind,
        model=model,
        lora=lora,
        prompt=prompt,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
    )


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def full_response(
    p: ParsedRequest,
    rid: str,
    text: str,
    finish_reason: str,
    use: dict[str, Any],
    created: int | None = None,
) -> dict[str, Any]:
    created = created or int(time.time())
    if p.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": p.model,
        "choices": [choice],
        "usage": use,
    }


def chunk(
    p: ParsedRequest,
    rid: str,
    created: int,
    text: str | None,
    finish_reason: str | None = None,
    role: bool = False,
    use: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One SSE chunk. ``text=None`` with ``use`` set is the final usage-only chunk."""
    if p.kind == "chat":
        obj = "chat.completion.chunk"
        choices: list[dict[str, Any]] = []
        if text is not None or finish_reason is not None or role:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choices = [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ]
    else:
        obj = "text_completion"
        choices = []
        if text is not None or finish_reason is not None:
            choices = [
                {
                    "index": 0,
                    "text": text or "",
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            ]
    out: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": p.model,
        "choices": choices,
    }
    if use is not None:
        out["usage"] = use
    elif p.include_usage:
        out["usage"] = None
    return out
