"""Request parsing for routing: OpenAI body -> prompt text -> token ids -> block keys.

The router and the simulated worker use the same tokenizer (services.common.tokenizer) and the
same canonical keys, so the keys the router looks up are the keys the worker's KV events carry.
Prompts longer than ``offload_chars`` are tokenized in a thread, off the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.common.tokenizer import Tokenizer, prompt_from_request
from services.core.keys import block_keys, block_seed


class BadRequest(ValueError):
    """The body is not a valid completions / chat request (400)."""


@dataclass
class Parsed:
    body: dict[str, Any]
    chat: bool
    model: str
    prompt: str
    token_ids: list[int]
    max_tokens: int
    stream: bool
    seed: int  # block-key chain seed (cluster seed, LoRA, cache salt)


def _max_tokens(body: dict[str, Any], default: int) -> int:
    v = body.get("max_completion_tokens", body.get("max_tokens"))
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise BadRequest("'max_tokens' must be a positive integer")
    return v


class RequestParser:
    def __init__(
        self,
        tokenizer: Tokenizer,
        hash_seed: int = 0,
        default_max_tokens: int = 256,
        offload_chars: int = 32_768,
        is_lora: Callable[[str], bool] | None = None,
    ) -> None:
        """``is_lora(model)``: whether a request's ``model`` selects a LoRA adapter (the
        router's cluster state answers from heartbeats); such prompts are keyed with the
        adapter's seed, like the engine keys the blocks it stores for them."""
        self.tokenizer = tokenizer
        self.hash_seed = hash_seed
        self.default_max_tokens = default_max_tokens
        self.offload_chars = offload_chars
        self.is_lora = is_lora

    async def parse(self, body: Any, chat: bool) -> Parsed:
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        if chat and "messages" not in body:
            raise BadRequest("'messages' is required for chat completions")
        if not chat and "prompt" not in body:
            raise BadRequest("'prompt' is required for completions")
        model = body.get("model", "")
        if not isinstance(model, str):
            raise BadRequest("'model' must be a string")
        try:
            prompt = prompt_from_request(self.tokenizer, body)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        if len(prompt) > self.offload_chars:
            ids = await asyncio.to_thread(self.tokenizer.encode, prompt)
        else:
            ids = self.tokenizer.encode(prompt)
        salt = body.get("cache_salt")
        lora = model if model and self.is_lora is not None and self.is_lora(model) else None
        seed = block_seed(self.hash_seed, lora, salt if isinstance(salt, str) else None)
        return Parsed(
            body=body,
            chat=chat,
            model=model,
            prompt=prompt,
            token_ids=ids,
            max_tokens=_max_tokens(body, self.default_max_tokens),
            stream=bool(body.get("stream", False)),
            seed=seed,
        )

    @staticmethod
    def keys(parsed: Parsed, block_size: int) -> list[int]:
        return block_keys(parsed.token_ids, block_size, parsed.seed)
