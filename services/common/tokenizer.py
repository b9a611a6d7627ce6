"""The tokenizer abstraction shared by the router and the simulated worker.

Router and worker must turn the same request into the same token ids, or their block keys
disagree and prefix routing silently degrades. Two implementations:

- :class:`ByteTokenizer` (default): UTF-8 bytes are the token ids; no files needed.
- :class:`HFTokenizer`: a local HuggingFace ``tokenizer.json`` (``tokenizers`` library) and,
  when present beside it, the chat template from ``tokenizer_config.json`` rendered with jinja2.
  Never downloads anything.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import jinja2.sandbox

Messages = Sequence[dict[str, Any]]


def _content_text(content: Any) -> str:
    """OpenAI content may be a string or a list of parts; only text parts carry tokens here.
    Text parts are joined with a newline, as vLLM does for templates that take string content.
    A malformed part is a ValueError (the caller answers 400), never a TypeError."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for i, part in enumerate(content):
            if not isinstance(part, dict):
                raise ValueError(f"message content part {i} must be an object")
            ptype = part.get("type", "text")
            if ptype in ("text", "input_text"):
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError(
                        f"message content part {i}: 'text' must be a string, got {text!r}"
                    )
                texts.append(text)
        return "\n".join(texts)
    raise ValueError("message content must be a string or a list of parts")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check an OpenAI ``messages`` list and flatten each content to a string (what a chat
    template receives). Raises ValueError naming the first bad message."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"message {i} must be an object with a 'role'")
        if not isinstance(m["role"], str):
            raise ValueError(f"message {i}: 'role' must be a string")
        try:
            content = _content_text(m.get("content"))
        except ValueError as exc:
            raise ValueError(f"message {i}: {exc}") from None
        out.append({**m, "content": content})
    return out


@dataclass(frozen=True)
class ChatOptions:
    """What a chat template is rendered with besides the messages (vLLM's chat params):
    tools (whole ``{"type": "function", ...}`` objects, as vLLM passes them), tool_choice
    (only with tools), documents, generation-prompt flags and ``chat_template_kwargs``."""

    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    documents: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def template_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = dict(self.extra)
        kw.update(
            tools=self.tools,
            tool_choice=self.tool_choice if self.tools else None,
            documents=self.documents,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
        )
        return kw


def chat_options(body: dict[str, Any]) -> ChatOptions:
    """The template-relevant fields of a chat request, checked (ValueError names the field)."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise ValueError("'tools' must be a list of objects")
        if not tools:
            raise ValueError(
                "`tools` must not be an empty array. Either provide at least one tool or omit "
                "the field entirely."
            )
    documents = body.get("documents")
    if documents is not None and (
        not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents)
    ):
        raise ValueError("'documents' must be a list of objects")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ValueError("'chat_template_kwargs' must be an object")
    agp = body.get("add_generation_prompt", True)
    cfm = body.get("continue_final_message", False)
    if not isinstance(agp, bool) or not isinstance(cfm, bool):
        raise ValueError("'add_generation_prompt' and 'continue_final_message' must be booleans")
    if agp and cfm and "add_generation_prompt" in body:
        raise ValueError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    if cfm:
        agp = False
    tool_choice = body.get("tool_choice")
    if tools and tool_choice is None:
        tool_choice = "auto"
    extra = dict(kwargs)
    effort = body.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise ValueError("'reasoning_effort' must be a string")
        # vLLM passes it to the template, and turns thinking on for templates that ask
        extra.setdefault("reasoning_effort", effort)
        extra.setdefault("enable_thinking", effort != "none")
    return ChatOptions(
        tools=tools,
        tool_choice=tool_choice,
        documents=documents,
        add_generation_prompt=agp,
        continue_final_message=cfm,
        extra=extra,
    )


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> str: ...


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    """HuggingFace's ``tojson`` filter (not jinja2's HTML-escaping one): plain json.dumps."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kw)


def default_chat_template(messages: Messages, options: ChatOptions | None = None) -> str:
    """kvgate's template when the tokenizer has none: each message as ``<|role|>\\ntext\\n``,
    tool schemas and documents right after the system prompt (where most model templates put
    them), then the generation prompt."""
    opts = options or ChatOptions()
    extras: list[str] = []
    if opts.tools:
        extras.append(f"<|tools|>\n{_tojson(opts.tools, sort_keys=True)}\n")
    if opts.documents:
        extras.append(f"<|documents|>\n{_tojson(opts.documents, sort_keys=True)}\n")
    parts: list[str] = []
    msgs = list(messages)
    if msgs and msgs[0].get("role") == "system":
        parts.append(f"<|system|>\n{_content_text(msgs[0].get('content'))}\n")
        msgs = msgs[1:]
    parts.extend(extras)
    parts.extend(f"<|{m.get('role', 'user')}|>\n{_content_text(m.get('content'))}\n" for m in msgs)
    if opts.continue_final_message and parts:
        parts[-1] = parts[-1][:-1]  # the last message stays open
    elif opts.add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


class ByteTokenizer:
    name = "bytes"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i & 0xFF for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Messages, options: ChatOptions | None = None) -> str:
        return default_chat_template(messages, options)


class HFTokenizer:
    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _HFTok

        p = Path(path)
        tok_file = p / "tokenizer.json" if p.is_dir() else p
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {tok_file}")
        self._tok = _HFTok.from_file(str(tok_file))
        self.name = str(tok_file)
        self._template = None
        self._special: dict[str, str] = {}
        cfg_file = tok_file.parent / "tokenizer_config.json"
        jinja_file = tok_file.parent / "chat_template.jinja"  # newer HF layout
        cfg: dict[str, Any] = {}
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
        tmpl = cfg.get("chat_template")
        if isinstance(tmpl, list):  # named templates: take "default"
            tmpl = next((t.get("template") for t in tmpl if t.get("name") == "default"), None)
        if not tmpl and jinja_file.is_file():
            tmpl = jinja_file.read_text()
        if tmpl:
            # the environment HuggingFace renders chat templates in (transformers'
            # _compile_jinja_template): loop controls, its tojson, raise_exception
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(tmpl)
        if cfg:
            for key in ("bos_token", "eos_token"):
                val = cfg.get(key)
                if isinstance(val, dict):
                    val = val.get("content")
                if isinstance(val, str):
                    self._special[key] = val

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``add_special_tokens``: what the tokenizer's post-processor adds (a BOS token for
        most models); vLLM adds them to completions prompts, not to rendered chat templates
        (the template writes its own)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))

    def apply_chat_template(self, messages: Messages, options: ChatOptions | None = None) -> str:
        opts = options or ChatOptions()
        if self._template is None:
            return default_chat_template(messages, opts)
        kwargs = {**self._special, **opts.template_kwargs()}
        try:
            return self._template.render(messages=list(messages), **kwargs)
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template failed: {exc}") from None


def load_tokenizer(path: str | None) -> Tokenizer:
    """``path`` empty -> byte-level; else a directory or tokenizer.json file."""
    if not path:
        return ByteTokenizer()
    return HFTokenizer(path)


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)


def render_chat(tokenizer: Tokenizer, body: dict[str, Any]) -> str:
    """The prompt text an engine builds for a chat request: its template rendered with the
    messages and every template input of the request (tools, tool_choice, documents,
    generation-prompt flags, chat_template_kwargs). ValueError on a malformed request."""
    messages = normalize_messages(body.get("messages"))
    return tokenizer.apply_chat_template(messages, chat_options(body))


PromptInput = str | list[int]


def completion_prompts(body: dict[str, Any]) -> list[PromptInput]:
    """A completions ``prompt`` in every form vLLM accepts, as a list: a string, a list of
    token ids, or a batch of either (``["a", "b"]``, ``[[1, 2], [3]]``). Token ids are kept as
    ids: they need no tokenizer. ValueError on anything else or an empty prompt."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("Either prompt or prompt_embeds must be provided and non-empty.")
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(
            "'prompt' must be a string, a list of token ids, or a list of strings or of "
            "token-id lists"
        )
    if all(_is_token_id(t) for t in prompt):
        return [list(prompt)]
    out: list[PromptInput] = []
    for i, p in enumerate(prompt):
        if isinstance(p, str) and p:
            out.append(p)
        elif isinstance(p, list) and p and all(_is_token_id(t) for t in p):
            out.append(list(p))
        else:
            raise ValueError(
                f"prompt {i} must be a non-empty string or a non-empty list of token ids "
                "(integers >= 0)"
            )
    return out


def adds_special_tokens(body: dict[str, Any], chat: bool) -> bool:
    """vLLM's ``add_special_tokens``: default True for completions, False for chat."""
    v = body.get("add_special_tokens")
    if v is None:
        return not chat
    if not isinstance(v, bool):
        raise ValueError("'add_special_tokens' must be a boolean")
    return v


def truncate_prompt(ids: list[int], body: dict[str, Any], max_model_len: int = 0) -> list[int]:
    """vLLM's ``truncate_prompt_tokens`` (-1: the model's context) and ``truncation_side``
    (default left: keep the end of the prompt). ValueError on a bad value."""
    k = body.get("truncate_prompt_tokens")
    if k is None:
        return ids
    if isinstance(k, bool) or not isinstance(k, int) or k < -1:
        raise ValueError("'truncate_prompt_tokens' must be an integer >= -1")
    if k == -1:
        if not max_model_len:
            return ids
        k = max_model_len
    side = body.get("truncation_side") or "left"
    if side not in ("left", "right"):
        raise ValueError("'truncation_side' must be 'left' or 'right'")
    if len(ids) <= k:
        return ids
    return ids[len(ids) - k :] if side == "left" else ids[:k]


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def prompt_from_request(tokenizer: Tokenizer, body: dict[str, Any]) -> str:
    """The text an engine would tokenize for an OpenAI chat request or a single-string
    completions request (batched and token-id prompts: :func:`completion_prompts`)."""
    if "messages" in body:
        return render_chat(tokenizer, body)
    prompts = completion_prompts(body)
    if len(prompts) != 1 or not isinstance(prompts[0], str):
        raise ValueError("'prompt' must be a single string here")
    return prompts[0]
