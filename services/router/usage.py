"""Usage of a stream continued on another worker (migration), as the client should see it.

The continuation is a completions request on ``prompt + generated`` text, so its worker
counts the tokens generated before the migration as *prompt*. The client asked one question
and got one answer: its usage must read as if one worker had done it all.

Invariant: ``total_tokens`` is unchanged; ``carried`` tokens move from prompt to completion
(a 300-token answer cut after 92 tokens and finished elsewhere reports 300 completion
tokens and the original prompt count); cached tokens never exceed the prompt.
"""

from __future__ import annotations

from typing import Any


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
