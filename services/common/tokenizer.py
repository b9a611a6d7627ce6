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
from pathlib import Path
from typing import Any, Protocol

import jinja2.sandbox

Messages = Sequence[dict[str, Any]]


def _content_text(content: Any) -> str:
    """OpenAI content may be a string or a list of parts; only text parts carry tokens here."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise ValueError("message content must be a string or a list of parts")


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: Messages) -> str: ...


def default_chat_template(messages: Messages) -> str:
    parts = [f"<|{m.get('role', 'user')}|>\n{_content_text(m.get('content'))}\n" for m in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)


class ByteTokenizer:
    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i & 0xFF for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Messages) -> str:
        return default_chat_template(messages)


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
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
            tmpl = cfg.get("chat_template")
            if isinstance(tmpl, list):  # named templates: take "default"
                tmpl = next((t.get("template") for t in tmpl if t.get("name") == "default"), None)
            if tmpl:
                env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                    trim_blocks=True, lstrip_blocks=True
                )
                self._template = env.from_string(tmpl)
            for key in ("bos_token", "eos_token"):
                val = cfg.get(key)
                if isinstance(val, dict):
                    val = val.get("content")
                if isinstance(val, str):
                    self._special[key] = val

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))

    def apply_chat_template(self, messages: Messages) -> str:
        if self._template is None:
            return default_chat_template(messages)
        return self._template.render(
            messages=list(messages), add_generation_prompt=True, **self._special
        )


def load_tokenizer(path: str | None) -> Tokenizer:
    """``path`` empty -> byte-level; else a directory or tokenizer.json file."""
    if not path:
        return ByteTokenizer()
    return HFTokenizer(path)


def prompt_from_request(tokenizer: Tokenizer, body: dict[str, Any]) -> str:
    """The text an engine would tokenize for an OpenAI completions or chat request."""
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError("each message must be an object with a 'role'")
        return tokenizer.apply_chat_template(messages)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return prompt[0]
        raise ValueError("'prompt' must be a string (batched prompts are not supported)")
    if not isinstance(prompt, str):
        raise ValueError("'prompt' (string) or 'messages' (list) is required")
    return prompt
