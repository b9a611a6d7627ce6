"""OpenAI request parsing and response shapes for the simulated worker, in vLLM's dialect.
Pure, no I/O.

Invariant: :func:`parse_request` either returns a fully checked :class:`ParsedRequest` or
raises :class:`ApiError` with vLLM's status and an OpenAI-shaped message naming the field
(``param``). Every option of vLLM's OpenAI-compatible server is either applied, checked and
applied to the synthetic output, or rejected; none is silently dropped (the tables in
docs/worker-sim.md list which is which). Limits and messages follow vLLM's
``SamplingParams._verify_args`` and its protocol validators.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import xxhash

from services.common.tokenizer import (
    Tokenizer,
    adds_special_tokens,
    completion_prompts,
    normalize_messages,
    render_chat,
    truncate_prompt,
)

Kind = Literal["completion", "chat"]

# vLLM defaults: --max-logprobs 20; completions max_tokens 16; int64 seeds
MAX_LOGPROBS = 20
COMPLETION_DEFAULT_MAX_TOKENS = 16
_INT64 = (-(2**63), 2**63 - 1)

# accepted and validated; they change only which token is sampled, so the synthetic text mixes
# them into its sampling seed (a different value gives a different, still deterministic text)
TOKEN_CHOICE_PARAMS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "bad_words",
    "allowed_token_ids",
)

# vLLM options the simulator cannot honour: rejected (400) rather than ignored
UNSUPPORTED: dict[str, str] = {
    "use_beam_search": "beam search is not simulated",
    "response_format": "structured output (response_format) is not simulated",
    "structured_outputs": "structured output is not simulated",
    "guided_json": "structured output is not simulated",
    "guided_regex": "structured output is not simulated",
    "guided_choice": "structured output is not simulated",
    "guided_grammar": "structured output is not simulated",
    "prompt_embeds": "prompt embeddings are not simulated",
    "suffix": "suffix is not currently supported",
    "logprob_token_ids": "logprob_token_ids is not simulated",
    "watermarking": "watermarking is not simulated",
    "repetition_detection": "repetition detection is not simulated",
    "return_weight_versions": "weight versions are not simulated",
    "return_token_offsets": "token offsets are not simulated",
    "return_prompt_text": "return_prompt_text is not simulated",
    "return_mm_kwargs": "multimodal inputs are not simulated",
    "mm_payload": "multimodal inputs are not simulated",
    "routed_experts_prompt_start": "expert routing is not simulated",
}


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
class Prompt:
    """One prompt of a request: its token ids and its text (decoded when given as ids)."""

    token_ids: list[int]
    text: str


@dataclass
class ParsedRequest:
    kind: Kind
    model: str
    lora: str | None
    prompts: list[Prompt]
    max_tokens: int | None  # None: vLLM's default (see max_tokens_for)
    stream: bool
    include_usage: bool
    n: int = 1
    continuous_usage: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    include_stop_str: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top-k alternatives per token; None: no logprobs
    prompt_logprobs: int | None = None
    echo: bool = False
    echo_text: str = ""  # chat echo: the last message's content when its role is assistant
    seed: int | None = None
    greedy: bool = False
    sampling_salt: int = 0  # hash of the token-choice options
    cache_salt: str | None = None
    return_token_ids: bool = False
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprob tokens as "token_id:N"
    stream_interval: int = 1  # tokens per streamed chunk
    request_id: str | None = None  # the client's id (the response id is built from it)
    # the tokens this request may generate (allowed_token_ids, logit_bias +-100, single-token
    # bad_words); None: the engine's whole output vocabulary
    vocab: tuple[int, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    priority: int = 0  # the engine's scheduling priority (lower first; priority policy only)

    @property
    def prompt(self) -> str:
        """The first prompt's text (single-prompt callers)."""
        return self.prompts[0].text

    @property
    def generates(self) -> bool:
        """False for the log-likelihood pattern: ``echo`` with ``max_tokens: 0`` returns the
        prompt only (vLLM still runs one decode step, and counts it)."""
        return not (self.echo and self.max_tokens == 0)

    def max_tokens_for(self, prompt_len: int, max_model_len: int, default: int = 0) -> int:
        """Tokens to generate for one prompt: the request's value; else the server default
        when set; else vLLM's (completions 16, chat the rest of the context)."""
        if self.max_tokens == 0:
            return 1
        if self.max_tokens is not None:
            return self.max_tokens
        room = max(max_model_len - prompt_len, 1)
        if default > 0:
            return min(default, room)
        if self.kind == "completion":
            return min(COMPLETION_DEFAULT_MAX_TOKENS, room)
        return room

    def choice_seed(self, prompt_index: int, choice: int) -> int:
        """Sampling seed of one output: greedy ignores the seed (all choices alike, as vLLM's
        greedy n>1); otherwise the request's seed, the token-choice options and the choice."""
        if self.greedy:
            return 0
        base = 0 if self.seed is None else self.seed & 0xFFFFFFFFFFFFFFFF
        return xxhash.xxh3_64_intdigest(
            f"{base}:{self.sampling_salt}:{prompt_index}:{choice}".encode()
        )


def _bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param)


def _number(body: dict[str, Any], name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _bad(f"'{name}' must be a number, got {v!r}", name)
    if not math.isfinite(v):
        raise _bad(f"{name} must be a finite number, got {v}.", name)
    return float(v)


def _integer(body: dict[str, Any], name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"'{name}' must be an integer, got {v!r}", name)
    return v


def _flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"'{name}' must be a boolean", name)
    return v


def _check_sampling(body: dict[str, Any]) -> tuple[bool, int]:
    """vLLM's SamplingParams checks; returns (greedy, hash of the token-choice options)."""
    t = _number(body, "temperature")
    if t is not None:
        if t < 0:
            raise _bad(f"temperature must be non-negative, got {t}.", "temperature")
        if t > 2:
            raise _bad(f"temperature must be in [0, 2], got {t}.", "temperature")
    top_p = _number(body, "top_p")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise _bad(f"top_p must be in (0, 1], got {top_p}.", "top_p")
    top_k = _integer(body, "top_k")
    if top_k is not None and top_k < -1:
        raise _bad(f"top_k must be 0 (disable), or at least 1, got {top_k}.", "top_k")
    min_p = _number(body, "min_p")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise _bad(f"min_p must be in [0, 1], got {min_p}.", "min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        v = _number(body, name)
        if v is not None and not -2.0 <= v <= 2.0:
            raise _bad(f"{name} must be in [-2, 2], got {v}.", name)
    rp = _number(body, "repetition_penalty")
    if rp is not None and rp <= 0:
        raise _bad(f"repetition_penalty must be greater than zero, got {rp}.", "repetition_penalty")
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in bias.values()
        ):
            raise _bad("'logit_bias' must map token ids to numbers", "logit_bias")
        for k in bias:
            try:
                int(k)
            except (TypeError, ValueError):
                raise _bad(f"logit_bias key {k!r} is not a token id", "logit_bias") from None
    bad_words = body.get("bad_words")
    if bad_words is not None:
        if not isinstance(bad_words, list) or not all(isinstance(w, str) for w in bad_words):
            raise _bad("'bad_words' must be a list of strings", "bad_words")
        if any(not w for w in bad_words):
            raise _bad("bad_words cannot contain an empty string.", "bad_words")
    allowed = body.get("allowed_token_ids")
    if allowed is not None and (
        not isinstance(allowed, list) or not allowed or not all(_is_id(x) for x in allowed)
    ):
        raise _bad("allowed_token_ids must be a non-empty list of token ids", "allowed_token_ids")
    greedy = t is not None and t < 1e-5
    salt = repr([body.get(k) for k in TOKEN_CHOICE_PARAMS if k != "temperature"])
    if not greedy:
        salt += repr(t)
    return greedy, xxhash.xxh3_64_intdigest(salt.encode())


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _stops(body: dict[str, Any]) -> tuple[tuple[str, ...], frozenset[int]]:
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise _bad("'stop' must be a string or a list of strings", "stop")
    if any(not s for s in stops):
        raise _bad("stop cannot contain an empty string.", "stop")
    ids = body.get("stop_token_ids")
    if ids is None:
        ids = []
    if not isinstance(ids, list) or not all(_is_id(x) for x in ids):
        raise _bad(f"stop_token_ids must contain only integers, got {ids!r}.", "stop_token_ids")
    return stops, frozenset(ids)


def _logprobs(kind: Kind, body: dict[str, Any]) -> tuple[int | None, int | None]:
    """(top-k per output token or None, prompt top-k or None), with vLLM's checks."""
    for name in ("prompt_logprobs", "logprobs" if kind == "completion" else "top_logprobs"):
        v = body.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise _bad(f"`{name}` must be an integer.", name)
    prompt_lp = body.get("prompt_logprobs")
    if prompt_lp is not None:
        if body.get("stream") and (prompt_lp > 0 or prompt_lp == -1):
            raise _bad("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        if prompt_lp < 0 and prompt_lp != -1:
            raise _bad("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs")
    if kind == "completion":
        lp = body.get("logprobs")
        if lp is not None and lp < 0 and lp != -1:
            raise _bad("`logprobs` must be a positive value or -1.", "logprobs")
        top = lp
        param = "logprobs"
    else:
        wants = body.get("logprobs")
        if wants is not None and not isinstance(wants, bool):
            raise _bad("'logprobs' must be a boolean", "logprobs")
        tl = body.get("top_logprobs")
        if tl is not None:
            if tl < 0 and tl != -1:
                raise _bad("`top_logprobs` must be a positive value or -1.", "top_logprobs")
            if (tl == -1 or tl > 0) and not wants:
                raise _bad(
                    "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
                )
        top = (tl or 0) if wants else None
        param = "top_logprobs"
    for value, name in ((top, param), (prompt_lp, "prompt_logprobs")):
        if value is not None and value > MAX_LOGPROBS:
            raise _bad(
                f"Requested sample logprobs of {value}, which is greater than max allowed: "
                f"{MAX_LOGPROBS}",
                name,
            )
    if top == -1:
        top = MAX_LOGPROBS
    if prompt_lp == -1:
        prompt_lp = MAX_LOGPROBS
    return top, prompt_lp


def _tool_choice(body: dict[str, Any]) -> None:
    """vLLM's check_tool_usage."""
    choice = body.get("tool_choice")
    if choice is None or choice == "none":
        return
    tools = body.get("tools")
    if not tools:
        raise _bad("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice in ("auto", "required"):
        return
    if not isinstance(choice, dict):
        raise _bad(
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" '
            'or "required" are supported.',
            "tool_choice",
        )
    fn = choice.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise _bad(
            'Invalid `tool_choice`! Correct usage: `{"type": "function", "function": '
            '{"name": "my_function"}}`',
            "tool_choice.function.name",
        )
    names = {(t.get("function") or {}).get("name") for t in tools if isinstance(t, dict)}
    if fn["name"] not in names:
        raise _bad(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            "tool_choice",
        )


def parse_request(
    kind: Kind,
    body: Any,
    tokenizer: Tokenizer,
    served_model: str,
    loras: tuple[str, ...] = (),
    strict_model: bool = False,
    max_model_len: int = 0,
    output_vocab: tuple[int, ...] = (),
    priority_scheduling: bool = False,
) -> ParsedRequest:
    """``priority_scheduling``: the engine runs vLLM's priority policy (a request's
    ``priority``, an int64, is used); else a non-zero ``priority`` is a 400, as vLLM's V0
    engine answered (vLLM 0.33's V1 engine ignores it; SGLang ignores it unless
    ``--abort-on-priority-when-disabled``)."""
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
    for name, why in UNSUPPORTED.items():
        v = body.get(name)
        if v is not None and v is not False and v != "" and v != []:
            if name == "response_format" and isinstance(v, dict) and v.get("type") == "text":
                continue
            raise _bad(f"{why} by the simulated worker", name)
    priority = 0
    if priority_scheduling:
        priority = _integer(body, "priority") or 0
        if not -(1 << 63) <= priority < (1 << 63):
            raise _bad("'priority' must be a signed 64-bit integer", "priority")
    elif body.get("priority") not in (None, 0):
        raise _bad("Priority scheduling is not enabled.", "priority")
    n = _integer(body, "n")
    n = 1 if n is None else n
    if n < 1:
        raise _bad(f"n must be at least 1, got {n}.", "n")
    echo = _flag(body, "echo")
    # max_completion_tokens wins only when it is set (null means "not given")
    mt_name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    max_tokens = _integer(body, mt_name)
    if (
        max_tokens is not None
        and max_tokens < 1
        and not (max_tokens == 0 and echo and kind == "completion")
    ):
        raise _bad(f"max_tokens must be at least 1, got {max_tokens}.", mt_name)
    min_tokens = _integer(body, "min_tokens") or 0
    if min_tokens < 0:
        raise _bad(
            f"min_tokens must be greater than or equal to 0, got {min_tokens}.", "min_tokens"
        )
    if max_tokens and min_tokens > max_tokens:
        raise _bad(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
            "min_tokens",
        )
    stream = _flag(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    if opts and not stream:
        raise _bad("Stream options can only be defined when `stream=True`.", "stream_options")
    opts = opts or {}
    include_usage = bool(opts.get("include_usage", False))
    continuous = bool(opts.get("continuous_usage_stats", False))
    seed = _integer(body, "seed")
    if seed is not None and not _INT64[0] <= seed <= _INT64[1]:
        raise _bad("'seed' must be a 64-bit integer", "seed")
    greedy, salt = _check_sampling(body)
    stops, stop_ids = _stops(body)
    top, prompt_lp = _logprobs(kind, body)
    vocab = _request_vocab(body, tokenizer, output_vocab)
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise _bad("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    interval = _integer(body, "stream_interval")
    if interval is not None and interval < 1:
        raise _bad(f"stream_interval must be at least 1, got {interval}.", "stream_interval")
    request_id = body.get("request_id")
    if request_id is not None and not isinstance(request_id, str):
        raise _bad("'request_id' must be a string", "request_id")
    try:
        special = adds_special_tokens(body, kind == "chat")
    except ValueError as exc:
        raise _bad(str(exc), "add_special_tokens") from None

    def encode(text: str) -> list[int]:
        try:
            return truncate_prompt(tokenizer.encode(text, special), body, max_model_len)
        except ValueError as exc:
            raise _bad(str(exc), "truncate_prompt_tokens") from None

    prompts: list[Prompt]
    echo_text = ""
    if kind == "chat":
        if body.get("chat_template") is not None:
            raise _bad(
                "Chat template is passed with request, but --trust-request-chat-template is "
                "not set. Refused request with untrusted chat template.",
                "chat_template",
            )
        _tool_choice(body)
        try:
            text = render_chat(tokenizer, body)
            messages = normalize_messages(body["messages"])
        except ValueError as exc:
            param = "tools" if "tools" in str(exc) else "messages"
            raise ApiError(400, str(exc), param) from None
        ids = encode(text)
        prompts = [Prompt(ids, tokenizer.decode(ids) if "truncate_prompt_tokens" in body else text)]
        last = messages[-1]
        if echo and last.get("role") == "assistant":
            echo_text = last["content"]
    else:
        try:
            raw = completion_prompts(body)
        except ValueError as exc:
            raise ApiError(400, str(exc), "prompt") from None
        prompts = []
        for p in raw:
            ids = encode(p) if isinstance(p, str) else encode_ids(p, body, max_model_len)
            text = (
                p if isinstance(p, str) and len(ids) == len(tokenizer.encode(p, special)) else None
            )
            prompts.append(Prompt(ids, text if text is not None else tokenizer.decode(ids)))
    return ParsedRequest(
        kind=kind,
        model=model,
        lora=lora,
        prompts=prompts,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        n=n,
        continuous_usage=continuous,
        stop=stops,
        stop_token_ids=stop_ids,
        include_stop_str=_flag(body, "include_stop_str_in_output"),
        min_tokens=min_tokens,
        logprobs=top,
        prompt_logprobs=prompt_lp,
        echo=echo,
        echo_text=echo_text,
        seed=seed,
        greedy=greedy,
        sampling_salt=salt,
        cache_salt=cache_salt,
        return_token_ids=_flag(body, "return_token_ids"),
        tokens_as_ids=_flag(body, "return_tokens_as_token_ids"),
        stream_interval=interval or 1,
        request_id=request_id,
        vocab=vocab,
        priority=priority,
    )


def _request_vocab(
    body: dict[str, Any], tokenizer: Tokenizer, base: tuple[int, ...]
) -> tuple[int, ...] | None:
    """What the sampling restrictions leave of the output vocabulary: ``allowed_token_ids``
    replaces it, a ``logit_bias`` of +100 forces its tokens and -100 bans them (vLLM clamps
    biases to [-100, 100]: these are the values that decide), single-token ``bad_words``
    (with and without a leading space, as vLLM tokenizes them) are banned."""
    allowed = body.get("allowed_token_ids")
    bias = body.get("logit_bias") or {}
    forced = tuple(int(k) for k, v in bias.items() if v >= 100)
    banned = {int(k) for k, v in bias.items() if v <= -100}
    for word in body.get("bad_words") or []:
        for variant in (word, " " + word):
            ids = tokenizer.encode(variant)
            if len(ids) == 1:
                banned.add(ids[0])
    if not (allowed or forced or banned):
        return None
    pool = forced or tuple(allowed or ()) or base
    vocab = tuple(t for t in dict.fromkeys(pool) if t not in banned)
    if not vocab:
        raise _bad("the sampling restrictions leave no token to generate", "logit_bias")
    return vocab


def encode_ids(ids: list[int], body: dict[str, Any], max_model_len: int) -> list[int]:
    try:
        return truncate_prompt(ids, body, max_model_len)
    except ValueError as exc:
        raise _bad(str(exc), "truncate_prompt_tokens") from None


# ---------------------------------------------------------------------- synthetic logprobs
def token_logprob(token: int, position: int, seed: int) -> float:
    """A deterministic, plausible log-probability in (-6, 0] for a sampled token."""
    h = xxhash.xxh3_64_intdigest(f"{seed}:{position}:{token}".encode())
    return -round((h % 6000) / 1000.0, 4)


def top_alternatives(
    token: int, position: int, seed: int, k: int, vocab: tuple[int, ...]
) -> list[tuple[int, float]]:
    """The sampled token and k-1 other vocabulary tokens, most likely first (the sampled one
    is the most likely: synthetic text is greedy-like), with strictly decreasing logprobs."""
    lp = token_logprob(token, position, seed)
    out = [(token, lp)]
    others = [t for t in dict.fromkeys(vocab) if t != token]
    start = xxhash.xxh3_64_intdigest(f"{seed}:{position}".encode()) % max(len(others), 1)
    for i in range(max(k - 1, 0)):
        if not others:
            break
        out.append((others[(start + i) % len(others)], round(lp - 0.5 * (i + 1), 4)))
    return out[: max(k, 1)]


@dataclass
class TokenLogprob:
    token: int
    text: str
    logprob: float | None
    top: list[tuple[str, float]] | None  # (token text, logprob) alternatives


def chat_logprobs(items: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI chat shape: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def one(text: str, lp: float) -> dict[str, Any]:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {
                **one(it.text, it.logprob or 0.0),
                "top_logprobs": [one(t, v) for t, v in it.top or []],
            }
            for it in items
        ]
    }


def completion_logprobs(items: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """OpenAI completions shape: parallel lists ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (a dict per token, None for an echoed first prompt token), ``text_offset``."""
    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for it in items:
        offsets.append(offset)
        offset += len(it.text)
        tokens.append(it.text)
        lps.append(it.logprob)
        tops.append(None if it.top is None else dict(it.top))
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens, "top_logprobs": tops}


# ---------------------------------------------------------------------- response shapes
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


@dataclass
class Choice:
    index: int
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: dict[str, Any] | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


def full_response(
    p: ParsedRequest,
    rid: str,
    choices: list[Choice],
    use: dict[str, Any],
    created: int | None = None,
) -> dict[str, Any]:
    created = created or int(time.time())
    out: list[dict[str, Any]] = []
    for c in choices:
        if p.kind == "chat":
            d: dict[str, Any] = {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text, "tool_calls": []},
                "logprobs": c.logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        else:
            d = {
                "index": c.index,
                "text": c.text,
                "logprobs": c.logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        if p.return_token_ids:
            d["token_ids"] = c.token_ids
            d["prompt_token_ids"] = c.prompt_token_ids
        out.append(d)
    return {
        "id": rid,
        "object": "chat.completion" if p.kind == "chat" else "text_completion",
        "created": created,
        "model": p.model,
        "choices": out,
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
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
    stop_reason: int | str | None = None,
) -> dict[str, Any]:
    """One SSE chunk. ``text=None`` with no finish reason and ``use`` set is a usage-only
    chunk (the final one, ``choices: []``); ``use`` on a content chunk is vLLM's
    ``continuous_usage_stats``."""
    choices: list[dict[str, Any]] = []
    if p.kind == "chat":
        obj = "chat.completion.chunk"
        if text is not None or finish_reason is not None or role:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choices = [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                }
            ]
    else:
        obj = "text_completion"
        if text is not None or finish_reason is not None:
            choices = [
                {
                    "index": index,
                    "text": text or "",
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                }
            ]
    if choices and finish_reason is not None:
        choices[0]["stop_reason"] = stop_reason
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
