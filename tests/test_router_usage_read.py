"""What the outcome reads from a whole (non-streaming) answer: its completion tokens and the
cached tokens the engine reported, from ``usage`` alone; an answer without a readable usage
leaves them unknown and never fails the request."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from services.router.usage import read_usage


def _ctx() -> SimpleNamespace:
    return SimpleNamespace(completion_tokens=0, cached_reported=None)


def test_usage_of_a_whole_answer_is_read() -> None:
    body = msgspec.json.encode(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "choices": [{"index": 0, "text": "x" * 5000, "finish_reason": "length"}],
            "usage": {
                "prompt_tokens": 20,
                "completion_tokens": 8,
                "total_tokens": 28,
                "prompt_tokens_details": {"cached_tokens": 16},
            },
        }
    )
    ctx = _ctx()
    read_usage(ctx, body)
    assert ctx.completion_tokens == 8 and ctx.cached_reported == 16


@pytest.mark.parametrize(
    "body",
    [
        b'{"choices": []}',  # no usage
        b'{"usage": null}',
        b'{"usage": "8 tokens"}',  # not an object
        b"[1, 2]",  # not an object at all
        b"not json",
        b'{"usage": {"completion_tokens": "many"}}',
    ],
)
def test_an_unreadable_usage_leaves_the_counts_unknown(body: bytes) -> None:
    ctx = _ctx()
    read_usage(ctx, body)
    assert ctx.completion_tokens == 0 and ctx.cached_reported is None
