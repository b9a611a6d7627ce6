"""A response's ``usage``: what an outcome reads from it, and how a stream continued on
another worker reports it.

Reading (:func:`take_usage`, :func:`read_usage`): the completion tokens and the cached tokens
the engine reported (``prompt_tokens_details.cached_tokens``), from a streamed usage chunk or
a whole answer; one reading for both front doors, the router's proxy (services/router/send.py)
and the EPP's response watch (services/epp/response_watch.py). Best effort: a usage that
cannot be read leaves the counts as they were and never fails the request.

Continued (:func:`continued_usage`, migration): the continuation is a completions request on
``prompt + generated`` text, so its worker counts the tokens generated before the migration
as *prompt*. The client asked one question and got one answer: its usage must read as if one
worker had done it all. Invariant: ``total_tokens`` is unchanged; ``carried`` tokens move from prompt to completion
(a 300-token answer cut after 92 tokens and finished elsewhere reports 300 completion
tokens and the original prompt count); cached tokens never exceed the prompt.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from services.router.sse import cached_tokens_of


def continued_usage(usage: dict[str, Any], carried: int) -> dict[str, Any]:
    """The continuation worker's ``usage`` with ``carried`` generated tokens moved back."""
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int) or carried <= 0:
        return usage
    carried = min(carried, prompt)
    out = dict(usage)
    out["prompt_tokens"] = prompt - carried
    out["completion_tokens"] = completion + carried
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        out["prompt_tokens_details"] = {
            **details,
            "cached_tokens": min(details["cached_tokens"], out["prompt_tokens"]),
        }
    return out


class Counts(Protocol):
    completion_tokens: int
    cached_reported: int | None


class _UsageOnly(msgspec.Struct):
    """A whole response as far as the outcome reads it: msgspec skips the other fields
    (choices, their text) without building them (1.2 against 2.3 µs for a short completion,
    3.1 against 5.3 for 5 kB)."""

    usage: dict[str, Any] | None = None


_usage_decoder = msgspec.json.Decoder(_UsageOnly)


def take_usage(ctx: Counts, usage: dict[str, Any]) -> None:
    """A response's ``usage`` object into ``ctx``."""
    tokens = usage.get("completion_tokens")
    if isinstance(tokens, int) and tokens >= 0:
        ctx.completion_tokens = tokens
    ctx.cached_reported = cached_tokens_of(usage)


def read_usage(ctx: Counts, body: bytes) -> None:
    """The ``usage`` of a whole (non-streaming) answer's bytes into ``ctx``."""
    try:
        usage = _usage_decoder.decode(body).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return
    if usage:
        take_usage(ctx, usage)
