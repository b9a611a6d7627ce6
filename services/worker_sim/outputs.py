"""One output sequence (one choice) of a simulated request: token ids in, text out, with vLLM's
stop handling and synthetic logprobs. Pure, no I/O.

Invariants:
- ``text`` is the decoded output cut at the first stop string (found only once ``min_tokens``
  tokens exist), with the stop string kept only when ``include_stop_str_in_output``;
- while streaming, the last ``max(len(stop)) - 1`` characters are held back (they could be the
  start of a stop string), as vLLM does; :meth:`finish` releases them;
- ``num_tokens`` counts every token consumed, the stopping one included (vLLM's
  ``completion_tokens``); tokens that arrive after the output stopped are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.common.tokenizer import Tokenizer
from services.worker_sim.openai_api import (
    ParsedRequest,
    Prompt,
    TokenLogprob,
    chat_logprobs,
    completion_logprobs,
    top_alternatives,
)

DETOK_WINDOW = 5


@dataclass
class Output:
    request_id: str  # the engine request behind this choice
    index: int  # choice index: prompt_index * n + choice
    prompt_index: int
    prompt: Prompt
    max_tokens: int
    seed: int  # synthetic logprobs' seed
    p: ParsedRequest
    tokenizer: Tokenizer
    vocab: tuple[int, ...]
    token_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    decoded: str = ""  # all decoded output so far (before the stop cut)
    text: str = ""  # final text (valid once finished)
    emitted: int = 0  # characters of the output already streamed
    logprob_items: list[TokenLogprob] = field(default_factory=list)
    emitted_logprobs: int = 0
    text_offset: int = 0  # completions logprobs: where the next streamed token's text starts
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cached_tokens: int | None = None
    engine_done: bool = False
    # tracing: wall time (ns) its first tokens reached the handler; engine time it was admitted
    first_ns: int = 0
    admitted_time: float | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def holdback(self) -> int:
        p = self.p
        if not p.stop or p.include_stop_str:
            return 0
        return max(len(s) for s in p.stop) - 1

    def feed(self, tokens: list[int]) -> bool:
        """Consume generated tokens; True when this output just stopped (stop string or stop
        token), so the caller can abort its engine request."""
        if self.done or not self.p.generates:
            self.num_tokens += 0 if self.done else len(tokens)
            return False
        p = self.p
        for tok in tokens:
            pos = self.num_tokens
            self.num_tokens += 1
            piece = self._next_piece(tok)
            self.token_ids.append(tok)
            if p.logprobs is not None:
                self.logprob_items.append(self._item(tok, self._token_str(tok), pos))
            if tok in p.stop_token_ids and self.num_tokens > p.min_tokens:
                self._stop(len(self.decoded), "", tok)
                return True
            before = len(self.decoded)
            self.decoded += piece
            if p.stop and self.num_tokens > p.min_tokens:
                hit = self._find_stop(before)
                if hit is not None:
                    at, s = hit
                    self._stop(at, s, s)
                    return True
            if self.num_tokens >= self.max_tokens:
                self._finish_length()
                return False
        return False

    def _next_piece(self, tok: int) -> str:
        """The text ``tok`` adds to the output, decoded in the context of the last few tokens
        (a tokenizer's decoder may put spaces between tokens), like vLLM's incremental
        detokenizer: decode(window + tok) minus decode(window)."""
        window = self.token_ids[-DETOK_WINDOW:]
        if not window:
            return self.tokenizer.decode([tok])
        before = self.tokenizer.decode(window)
        after = self.tokenizer.decode([*window, tok])
        if after.startswith(before):
            return after[len(before) :]
        return self.tokenizer.decode([tok])

    def _find_stop(self, before: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self.p.stop:
            at = self.decoded.find(s, max(0, before - len(s) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        return best

    def _stop(self, at: int, stop_str: str, reason: int | str) -> None:
        keep = self.p.include_stop_str
        self.text = self.decoded[: at + (len(stop_str) if keep else 0)]
        self.finish_reason = "stop"
        self.stop_reason = reason

    def _finish_length(self) -> None:
        self.text = self.decoded
        self.finish_reason = "length"

    def finish(self, cached_tokens: int, engine_reason: str) -> None:
        """The engine reported this request finished (or aborted after a stop)."""
        self.engine_done = True
        self.cached_tokens = cached_tokens
        if not self.done:
            if not self.p.generates:
                self.text = ""
                self.finish_reason = "length"
            elif engine_reason == "abort":
                self.text = self.decoded
                self.finish_reason = "abort"
            else:
                self._finish_length()

    # ------------------------------------------------------------------ logprobs
    def _token_str(self, tok: int) -> str:
        """A token as logprobs name it: its text, or ``token_id:N`` when the request asked
        for ids (return_tokens_as_token_ids)."""
        return f"token_id:{tok}" if self.p.tokens_as_ids else self.tokenizer.decode([tok])

    def _item(self, tok: int, piece: str, pos: int) -> TokenLogprob:
        k = self.p.logprobs or 0
        top = top_alternatives(tok, pos, self.seed, max(k, 1), self.vocab)
        return TokenLogprob(
            token=tok,
            text=piece,
            logprob=top[0][1],
            top=[(self._token_str(t), v) for t, v in top[:k]],
        )

    def prompt_items(self) -> list[TokenLogprob]:
        """Synthetic logprobs of the prompt tokens (echo): the first has none."""
        k = self.p.logprobs or 0
        items: list[TokenLogprob] = []
        for i, tok in enumerate(self.prompt.token_ids):
            piece = self._token_str(tok)
            if i == 0:
                items.append(TokenLogprob(tok, piece, None, None))
                continue
            top = top_alternatives(tok, -i, self.seed, max(k, 1), self.vocab)
            items.append(
                TokenLogprob(tok, piece, top[0][1], [(self._token_str(t), v) for t, v in top[:k]])
            )
        return items

    def prompt_logprobs(self) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token ``{id: {logprob, rank,
        decoded_token}}``, None for the first."""
        out: list[dict[str, Any] | None] = [None]
        k = self.p.prompt_logprobs or 0
        for i, tok in enumerate(self.prompt.token_ids[1:], start=1):
            top = top_alternatives(tok, -i, self.seed, max(k, 1), self.vocab)
            entry = {
                str(t): {"logprob": v, "rank": r + 1, "decoded_token": self.tokenizer.decode([t])}
                for r, (t, v) in enumerate(top[: max(k, 1)])
            }
            out.append(entry)
        return out

    def logprobs_json(self, items: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
        if self.p.kind == "chat":
            return chat_logprobs(items)
        return completion_logprobs(items, offset)

    # ------------------------------------------------------------------ text out
    def stream_echo(self) -> tuple[str, dict[str, Any] | None]:
        """The echoed prompt as a stream's first chunk (text, and its logprobs for
        completions); text offsets of the output continue after it."""
        text = self.echo_prefix()
        lp = None
        if self.p.logprobs is not None and self.p.kind == "completion":
            items = self.prompt_items()
            lp = self.logprobs_json(items)
            self.text_offset = sum(len(it.text) for it in items)
        return text, lp

    def echo_prefix(self) -> str:
        if not self.p.echo:
            return ""
        return self.prompt.text if self.p.kind == "completion" else self.p.echo_text

    def full_text(self) -> str:
        return self.echo_prefix() + (self.text if self.p.generates else "")

    def full_logprobs(self) -> dict[str, Any] | None:
        if self.p.logprobs is None:
            return None
        items = list(self.logprob_items) if self.p.generates else []
        if self.p.echo and self.p.kind == "completion":
            items = self.prompt_items() + items
        return self.logprobs_json(items)

    def take_delta(self, final: bool) -> tuple[str, dict[str, Any] | None]:
        """Text (and logprobs) not streamed yet; holds back a possible stop-string start
        until ``final``."""
        if self.done or final:
            visible = self.text if self.done else self.decoded
        else:
            visible = self.decoded[: max(len(self.decoded) - self.holdback, self.emitted)]
        delta = visible[self.emitted :] if self.p.generates else ""
        self.emitted = max(self.emitted, len(visible))
        lp = None
        if self.p.logprobs is not None:
            items = self.logprob_items[self.emitted_logprobs :]
            self.emitted_logprobs = len(self.logprob_items)
            lp = self.logprobs_json(items, self.text_offset)
            self.text_offset += sum(len(it.text) for it in items)
        return delta, lp
