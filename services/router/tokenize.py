"""Request parsing for routing: OpenAI body -> the prompt the engine builds -> token ids ->
block keys.

The router and the simulated worker use the same tokenizer (services.common.tokenizer) and the
same canonical keys, so the keys the router looks up are the keys the worker's KV events carry.
A chat request is keyed by its chat template rendered with everything the engine renders it
with (messages, tools, tool_choice, documents, generation-prompt flags, chat_template_kwargs).
Completions prompts given as token ids are keyed directly, without the tokenizer. Prompts
longer than ``offload_chars`` are tokenized in a thread, off the event loop.

Batched prompts (``prompt: ["a", "b"]`` or lists of token-id lists) and ``n > 1`` go to ONE
worker, as one request, and that engine does the fan-out (as vLLM's own server does): the
router cannot merge several workers' streams into one response, and a batch of prompts that
share a prefix (few-shot evaluation) is served best by the one engine that caches the prefix
once. Such a request is keyed by its first prompt's blocks (the shared prefix is among them)
and counted with all its prompt tokens and all its outputs' tokens for admission and load.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec

from services.common.tokenizer import (
    Tokenizer,
    adds_special_tokens,
    completion_prompts,
    render_chat,
    truncate_prompt,
)
from services.core.keys import block_keys, block_seed


class BadRequest(ValueError):
    """The body is not a valid request (400); ``param`` names the field, as OpenAI does."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Parsed(msgspec.Struct):
    """A request as the router keys and counts it (a msgspec struct: one per request, built
    in a fifth of a dataclass's time)."""

    body: dict[str, Any]
    chat: bool
    model: str
    prompt: str
    # ids the request is keyed by and counted with: the prompt's; for a batch, every prompt's
    # ids one after the other (the first prompt's full blocks are its real keys)
    token_ids: list[int]
    max_tokens: int  # every output's tokens together (n x per-output x prompts)
    stream: bool
    seed: int  # block-key chain seed (cluster seed, LoRA, cache salt)
    # a broken stream can continue elsewhere as prompt + generated text: one text prompt,
    # one output, no echo or logprobs to re-create
    migratable: bool = True
    num_prompts: int = 1
    n: int = 1


def _int_or_none(body: dict[str, Any], name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"'{name}' must be an integer, got {v!r}", name)
    return v


# vLLM's completions default (CompletionRequest.max_tokens)
COMPLETION_DEFAULT_MAX_TOKENS = 16


def _max_tokens(
    body: dict[str, Any], default: int, chat: bool, prompt_len: int, context: Callable[[], int]
) -> int:
    """Tokens one output may generate. ``max_completion_tokens`` wins only when it is set:
    a ``null`` does not override ``max_tokens``. ``max_tokens: 0`` is the echo
    log-likelihood pattern (the engine still runs one step). Omitted: ``default`` when > 0,
    else vLLM's defaults: 16 for completions, the rest of the context (``context()``: the
    smallest among the workers serving the model; 0 = unknown; asked only here, as it looks
    at every worker) for chat."""
    name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    v = _int_or_none(body, name)
    if v is None:
        ctx = context()
        room = ctx - prompt_len if ctx > prompt_len else 0
        if default > 0:
            return min(default, room) if room else default
        if not chat:
            return (
                min(COMPLETION_DEFAULT_MAX_TOKENS, room) if room else COMPLETION_DEFAULT_MAX_TOKENS
            )
        return room or COMPLETION_DEFAULT_MAX_TOKENS
    if v == 0 and body.get("echo") is True and "prompt" in body:
        return 1
    if v < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {v}.", name)
    return v


class RequestParser:
    def __init__(
        self,
        tokenizer: Tokenizer,
        hash_seed: int = 0,
        default_max_tokens: int = 256,
        offload_chars: int = 32_768,
        is_lora: Callable[[str], bool] | None = None,
        context_len: Callable[[str], int] | None = None,
    ) -> None:
        """``is_lora(model)``: whether a request's ``model`` selects a LoRA adapter (the
        router's cluster state answers from heartbeats); such prompts are keyed with the
        adapter's seed, like the engine keys the blocks it stores for them.
        ``context_len(model)``: the context the workers serving ``model`` have (0: unknown),
        for vLLM's chat default of ``max_tokens`` (the rest of the context);
        ``default_max_tokens`` <= 0 means vLLM's defaults."""
        self.tokenizer = tokenizer
        self.hash_seed = hash_seed
        self.default_max_tokens = default_max_tokens
        self.offload_chars = offload_chars
        self.is_lora = is_lora
        self.context_len = context_len

    async def _encode(self, text: str, special: bool = False) -> list[int]:
        if len(text) > self.offload_chars:
            return await asyncio.to_thread(self.tokenizer.encode, text, special)
        return self.tokenizer.encode(text, special)

    async def render_chat(self, body: dict[str, Any]) -> str:
        """The chat template rendered as the engine renders it (in a thread when long)."""
        size = sum(
            len(str(m.get("content") or ""))
            for m in body.get("messages") or []
            if isinstance(m, dict)
        )
        try:
            if size > self.offload_chars:
                return await asyncio.to_thread(render_chat, self.tokenizer, body)
            return render_chat(self.tokenizer, body)
        except ValueError as exc:
            raise BadRequest(str(exc), "tools" if "tools" in str(exc) else "messages") from None

    async def parse(self, body: Any, chat: bool, path: str = "") -> Parsed:
        """``path``: /v1/embeddings keys ``input`` like a completions prompt; another routed
        pass-through path keys ``messages``, ``prompt`` or ``input`` when it has one (else
        the request is only load-balanced)."""
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        passthrough = bool(path) and path not in ("/v1/completions", "/v1/chat/completions")
        if passthrough:
            if "messages" in body:
                chat = True
            elif "input" in body and "prompt" not in body:
                body_for_prompt = {"prompt": body["input"]}
                return await self._parse(body, False, body_for_prompt, "input", passthrough)
            elif "prompt" not in body:
                return self._unkeyed(body)
        if chat and "messages" not in body:
            raise BadRequest("'messages' is required for chat completions", "messages")
        if not chat and "prompt" not in body:
            raise BadRequest("'prompt' is required for completions", "prompt")
        return await self._parse(body, chat, body, "prompt", passthrough)

    def _unkeyed(self, body: dict[str, Any]) -> Parsed:
        model = body.get("model", "")
        return Parsed(
            body=body,
            chat=False,
            model=model if isinstance(model, str) else "",
            prompt="",
            token_ids=[],
            max_tokens=1,
            stream=bool(body.get("stream", False)),
            seed=block_seed(self.hash_seed, None, None),
            migratable=False,
        )

    async def _parse(
        self,
        body: dict[str, Any],
        chat: bool,
        prompt_body: dict[str, Any],
        prompt_param: str,
        passthrough: bool,
    ) -> Parsed:
        model = body.get("model", "")
        if not isinstance(model, str):
            raise BadRequest("'model' must be a string", "model")
        n = _int_or_none(body, "n")
        n = 1 if n is None else n
        if n < 1:
            raise BadRequest(f"n must be at least 1, got {n}.", "n")
        try:
            special = adds_special_tokens(body, chat)
        except ValueError as exc:
            raise BadRequest(str(exc), "add_special_tokens") from None
        if chat:
            prompt = await self.render_chat(body)
            ids = self._truncate(await self._encode(prompt, special), body)
            num_prompts = 1
            text_prompt = True
        else:
            try:
                prompts = completion_prompts(prompt_body)
            except ValueError as exc:
                raise BadRequest(
                    str(exc).replace("'prompt'", f"'{prompt_param}'"), prompt_param
                ) from None
            ids = []
            for p in prompts:
                one = await self._encode(p, special) if isinstance(p, str) else p
                ids.extend(self._truncate(one, body))
            num_prompts = len(prompts)
            text_prompt = num_prompts == 1 and isinstance(prompts[0], str)
            prompt = prompts[0] if text_prompt else ""  # type: ignore[assignment]
        salt = body.get("cache_salt")
        lora = model if model and self.is_lora is not None and self.is_lora(model) else None
        seed = block_seed(self.hash_seed, lora, salt if isinstance(salt, str) else None)
        if passthrough:
            per_output = 1
        else:
            ctx = self.context_len

            def context() -> int:
                return ctx(model) if ctx is not None else 0

            longest = len(ids) if num_prompts == 1 else len(ids) // num_prompts
            per_output = _max_tokens(body, self.default_max_tokens, chat, longest, context)
        stream = bool(body.get("stream", False))
        plain = (
            not passthrough
            and text_prompt
            and n == 1
            and not body.get("echo")
            and not body.get("logprobs")
            and body.get("prompt_logprobs") is None
        )
        return Parsed(
            body=body,
            chat=chat,
            model=model,
            prompt=prompt,
            token_ids=ids,
            max_tokens=per_output * n * num_prompts,
            stream=stream,
            seed=seed,
            migratable=plain,
            num_prompts=num_prompts,
            n=n,
        )

    def continuation_ids(self, parsed: Parsed, text: str) -> list[int]:
        """Token ids of a migrated stream's continuation (prompt + generated text, sent as a
        completions prompt): special tokens as the worker will add them (none after a chat
        template, which wrote its own)."""
        special = False if parsed.chat else adds_special_tokens(parsed.body, False)
        return self.tokenizer.encode(text, special)

    @staticmethod
    def _truncate(ids: list[int], body: dict[str, Any]) -> list[int]:
        try:
            return truncate_prompt(ids, body)
        except ValueError as exc:
            raise BadRequest(str(exc), "truncate_prompt_tokens") from None

    @staticmethod
    def keys(parsed: Parsed, block_size: int) -> list[int]:
        return block_keys(parsed.token_ids, block_size, parsed.seed)
