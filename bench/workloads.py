"""Workload generators for ``kvgate bench`` and ``kvgate simulate``. Pure: no I/O except reading a
trace file, no clocks; the same parameters and seed always give the same requests.

Every prompt is ASCII text. The default tokenizer of the router and the workers is byte-level
(a token id is a UTF-8 byte), so ``len(prompt)`` is the prompt's token count and equal text
prefixes are equal token prefixes, i.e. equal KV-cache prefixes.

A workload is a list of :class:`BenchRequest` sorted by ``arrival_s`` (seconds from the start of
the run). Open-loop runs send each request at its arrival time; closed-loop runs ignore arrival
times and keep a fixed number in flight. A request with ``session_id`` and ``turn > 0`` is never
sent before the previous turn of its session has finished (multi-turn chat: the next turn's
prompt extends the previous one).

Built-in workloads (see :data:`WORKLOADS`):

- ``shared-system-prompt``: one long system prompt, unique user questions (seed 000: a shared
  system prompt makes pure prefix routing pile every request onto one worker);
- ``generated-shared-prefix``: SGLang's bench: ``groups`` x ``prompts_per_group``, each group a
  shared prefix, each prompt a unique question, shuffled;
- ``multi-turn``: conversations whose every turn extends the previous context;
- ``tool-agent``: tool-calling agents: shared tool schemas, histories that grow by each tool
  call and its result, short outputs and short gaps between turns;
- ``mooncake``: Mooncake (FAST'25) JSONL trace replay; each hash id becomes a deterministic block
  of text, so equal hash-id chains are equal prefixes;
- ``azure``: Azure LLM inference CSV trace replay (arrivals and lengths only, no sharing).
"""

from __future__ import annotations

import csv
import inspect
import json
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from services.core.keys import block_keys

# 64 printable characters; random bytes map onto them with bytes.translate (fast and uniform)
_ALPHABET = b"abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,"
_TABLE = bytes(_ALPHABET[i % len(_ALPHABET)] for i in range(256))


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload. ``prompt`` is ASCII, so its length is its token count."""

    request_id: str
    prompt: str
    max_tokens: int
    arrival_s: float = 0.0
    session_id: str | None = None
    turn: int = 0
    group: int | None = None
    # multi-tenant workloads (bench/bench_tenants.py): the tenant it is for (None: tenant-less)
    # and its priority band (services.common.tenancy.Priority)
    tenant: str | None = None
    priority: str = "standard"

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    def token_ids(self) -> list[int]:
        return list(self.prompt.encode("ascii"))


@dataclass
class Workload:
    """A named, parameterised list of requests sorted by arrival time."""

    name: str
    requests: list[BenchRequest]
    params: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    def summary(self) -> dict[str, Any]:
        n = len(self.requests)
        prompt = sum(r.prompt_tokens for r in self.requests)
        out = sum(r.max_tokens for r in self.requests)
        return {
            "name": self.name,
            "params": self.params,
            "requests": n,
            "prompt_tokens": prompt,
            "max_output_tokens": out,
            "mean_prompt_tokens": prompt / n if n else 0.0,
            "arrival_span_s": self.duration_s,
            "sessions": len({r.session_id for r in self.requests if r.session_id}),
        }


# ---------------------------------------------------------------------------- text helpers
def random_text(rng: random.Random, n: int) -> str:
    """``n`` printable ASCII characters drawn from ``rng`` (deterministic per rng state)."""
    if n <= 0:
        return ""
    return rng.randbytes(n).translate(_TABLE).decode("ascii")


def block_text(block_id: int, n: int, seed: int = 0) -> str:
    """The deterministic text of one trace block: a function of (block id, seed) only."""
    return random_text(random.Random((seed << 32) ^ (block_id * 0x9E3779B1) ^ 0x5DEECE66D), n)


def _length(rng: random.Random, n: int, range_ratio: float) -> int:
    """``n`` when ``range_ratio`` >= 1, else uniform in [max(1, ratio x n), n]."""
    if range_ratio >= 1.0 or n <= 1:
        return n
    return rng.randint(max(1, int(n * range_ratio)), n)


def poisson_arrivals(rng: random.Random, n: int, rate: float, start: float = 0.0) -> list[float]:
    """``n`` arrival times of a Poisson process at ``rate`` per second (rate <= 0: all at start)."""
    if rate <= 0 or math.isinf(rate):
        return [start] * n
    t, out = start, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def _sorted(requests: Iterable[BenchRequest]) -> list[BenchRequest]:
    # stable: equal arrival times keep generation order (e.g. a session's turns)
    return sorted(requests, key=lambda r: r.arrival_s)


# ---------------------------------------------------------------------------- generators
def shared_system_prompt(
    num_requests: int = 256,
    system_len: int = 2048,
    question_len: int = 64,
    output_len: int = 64,
    rate: float = 0.0,
    warmup_s: float = 0.5,
    range_ratio: float = 1.0,
    seed: int = 0,
) -> Workload:
    """Seed 000: every request = one shared system prompt + a unique user question.

    The first request arrives alone at t=0 and the rest from ``warmup_s`` on (Poisson at
    ``rate``): the system prompt is already cached on exactly one worker when the traffic
    starts, as in production, which is what makes pure prefix affinity pile onto that worker.
    ``range_ratio`` < 1 draws question and output lengths uniformly from [ratio x len, len]
    (SGLang bench's --random-range-ratio).
    """
    params = _params(locals())
    rng = random.Random(seed)
    system = random_text(rng, system_len)
    arrivals = [0.0] + poisson_arrivals(rng, num_requests - 1, rate, start=warmup_s)
    reqs = [
        BenchRequest(
            request_id=f"ssp-{i}",
            prompt=system + random_text(rng, _length(rng, question_len, range_ratio)),
            max_tokens=_length(rng, output_len, range_ratio),
            arrival_s=arrivals[i],
            group=0,
        )
        for i in range(num_requests)
    ]
    return Workload("shared-system-prompt", _sorted(reqs), params)


def generated_shared_prefix(
    groups: int = 64,
    prompts_per_group: int = 16,
    prefix_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    rate: float = 0.0,
    seed: int = 0,
) -> Workload:
    """SGLang's generated-shared-prefix bench: groups x prompts per group, shuffled."""
    params = _params(locals())
    rng = random.Random(seed)
    prefixes = [random_text(rng, prefix_len) for _ in range(groups)]
    items = [
        (g, j, prefixes[g] + random_text(rng, question_len))
        for g in range(groups)
        for j in range(prompts_per_group)
    ]
    rng.shuffle(items)
    arrivals = poisson_arrivals(rng, len(items), rate)
    reqs = [
        BenchRequest(
            request_id=f"gsp-{g}-{j}",
            prompt=prompt,
            max_tokens=output_len,
            arrival_s=arrivals[i],
            group=g,
        )
        for i, (g, j, prompt) in enumerate(items)
    ]
    return Workload("generated-shared-prefix", _sorted(reqs), params)


def multi_turn(
    sessions: int = 32,
    turns: int = 4,
    system_len: int = 512,
    user_len: int = 128,
    output_len: int = 64,
    think_s: float = 1.0,
    rate: float = 2.0,
    seed: int = 0,
) -> Workload:
    """Conversations: turn k's prompt = turn k-1's prompt + a reply + a new user message.

    Sessions start as a Poisson process at ``rate`` per second; a turn is sent no earlier than
    ``think_s`` after its session's previous turn (and never before that turn has finished).
    Every session has its own system prompt, so sessions share nothing with each other.
    """
    params = _params(locals())
    rng = random.Random(seed)
    starts = poisson_arrivals(rng, sessions, rate)
    reqs: list[BenchRequest] = []
    for s in range(sessions):
        context = random_text(rng, system_len)
        for k in range(turns):
            context += random_text(rng, user_len)
            reqs.append(
                BenchRequest(
                    request_id=f"mt-{s}-{k}",
                    prompt=context,
                    max_tokens=output_len,
                    arrival_s=starts[s] + k * think_s,
                    session_id=f"s{s}",
                    turn=k,
                    group=s,
                )
            )
            # the "assistant reply" joins the context; deterministic stand-in for the model's text
            context += random_text(rng, output_len)
    return Workload("multi-turn", _sorted(reqs), params)


def tool_agent(
    sessions: int = 48,
    turns: int = 8,
    toolsets: int = 2,
    tools_len: int = 4096,
    task_len: int = 256,
    call_len: int = 64,
    result_len: int = 768,
    range_ratio: float = 0.25,
    think_s: float = 1.0,
    rate: float = 1.0,
    seed: int = 0,
) -> Workload:
    """Tool-calling agents: every session starts from one of ``toolsets`` shared tool-schema
    blocks (``tools_len`` tokens each, shared by every session that uses it) and its own task
    (``task_len``); each turn the model answers with a tool call (``call_len`` output tokens)
    and the next turn's prompt is the whole history + that call + the tool's result (``result_len``
    x uniform [``range_ratio``, 1] tokens), sent ``think_s`` after the previous turn (the
    tool's latency) and never before it has finished. Histories grow turn by turn; sessions
    share the schemas, not their histories. Sessions start as a Poisson process at ``rate``.
    """
    params = _params(locals())
    rng = random.Random(seed)
    schemas = [random_text(random.Random(f"tools-{t}"), tools_len) for t in range(toolsets)]
    starts = poisson_arrivals(rng, sessions, rate)
    reqs: list[BenchRequest] = []
    for s in range(sessions):
        t = rng.randrange(toolsets)
        context = schemas[t] + random_text(rng, task_len)
        for k in range(turns):
            reqs.append(
                BenchRequest(
                    request_id=f"ta-{s}-{k}",
                    prompt=context,
                    max_tokens=call_len,
                    arrival_s=starts[s] + k * think_s,
                    session_id=f"a{s}",
                    turn=k,
                    group=t,
                )
            )
            # the model's tool call and the tool's result join the history
            context += random_text(rng, call_len) + random_text(
                rng, _length(rng, result_len, range_ratio)
            )
    return Workload("tool-agent", _sorted(reqs), params)


def mooncake(
    path: str = "",
    time_scale: float = 1.0,
    max_requests: int = 0,
    block_tokens: int = 512,
    max_output: int = 0,
    start_s: float = 0.0,
    seed: int = 0,
) -> Workload:
    """Mooncake-format JSONL trace: ``{"timestamp": ms, "input_length", "output_length",
    "hash_ids": [...]}``, each hash id a 512-token prefix-chained block.

    Each hash id becomes the deterministic text :func:`block_text` (``block_tokens`` long), so
    requests with the same leading hash ids have the same leading text. ``block_tokens`` < 512
    shrinks every prompt proportionally (for small live runs) and keeps the sharing structure.
    Arrival = (timestamp - first timestamp) / 1000 * ``time_scale``, limited to requests at or
    after ``start_s`` of the trace; ``max_requests`` > 0 keeps the first that many;
    ``max_output`` > 0 caps output lengths.
    """
    params = _params(locals())
    if not path:
        raise ValueError("mooncake workload needs path=<trace.jsonl>")
    if block_tokens <= 0:
        raise ValueError("block_tokens must be > 0")
    scale = block_tokens / 512
    blocks: dict[int, str] = {}
    reqs: list[BenchRequest] = []
    t0: float | None = None
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ts = float(row["timestamp"]) / 1000.0
                n_in = int(row["input_length"])
                n_out = int(row["output_length"])
                ids = [int(h) for h in row["hash_ids"]]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: bad mooncake record: {exc}") from exc
            if t0 is None:
                t0 = ts
            if ts - t0 < start_s:
                continue
            want = max(1, math.ceil(n_in * scale))
            parts, have = [], 0
            for h in ids:
                if have >= want:
                    break
                text = blocks.get(h)
                if text is None:
                    text = blocks[h] = block_text(h, block_tokens, seed)
                parts.append(text)
                have += block_tokens
            prompt = "".join(parts)[:want]
            if len(prompt) < want:  # a record with fewer hash ids than its length: pad uniquely
                prompt += block_text(-lineno, want - len(prompt), seed)
            out = max(1, min(n_out, max_output) if max_output > 0 else n_out)
            reqs.append(
                BenchRequest(
                    request_id=f"mc-{lineno}",
                    prompt=prompt,
                    max_tokens=out,
                    arrival_s=(ts - t0 - start_s) * time_scale,
                )
            )
            if 0 < max_requests <= len(reqs):
                break
    return Workload("mooncake", _sorted(reqs), params)


def azure(
    path: str = "",
    time_scale: float = 1.0,
    max_requests: int = 0,
    token_scale: float = 1.0,
    max_output: int = 0,
    start_s: float = 0.0,
    seed: int = 0,
) -> Workload:
    """Azure LLM inference CSV (``TIMESTAMP, ContextTokens, GeneratedTokens``): arrivals and
    lengths only; every prompt is unique text (the trace says nothing about sharing).
    ``token_scale`` scales both lengths (for small live runs); like ``mooncake``, only requests
    at or after ``start_s`` of the trace are kept (arrivals counted from there) and
    ``max_requests`` > 0 keeps the first that many."""
    params = _params(locals())
    if not path:
        raise ValueError("azure workload needs path=<trace.csv>")
    rng = random.Random(seed)
    reqs: list[BenchRequest] = []
    t0: datetime | None = None
    with open(path, encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing CSV columns {sorted(missing)}")
        for i, row in enumerate(reader):
            try:
                ts = _parse_ts(row["TIMESTAMP"])
                n_in = int(row["ContextTokens"])
                n_out = int(row["GeneratedTokens"])
            except ValueError as exc:
                raise ValueError(f"{path}:{i + 2}: bad azure record: {exc}") from exc
            if t0 is None:
                t0 = ts
            if (ts - t0).total_seconds() < start_s:
                continue
            n_in = max(1, round(n_in * token_scale))
            n_out = max(1, round(n_out * token_scale))
            if max_output > 0:
                n_out = min(n_out, max_output)
            reqs.append(
                BenchRequest(
                    request_id=f"az-{i}",
                    prompt=random_text(rng, n_in),
                    max_tokens=n_out,
                    arrival_s=((ts - t0).total_seconds() - start_s) * time_scale,
                )
            )
            if 0 < max_requests <= len(reqs):
                break
    return Workload("azure", _sorted(reqs), params)


def _parse_ts(text: str) -> datetime:
    text = text.strip()
    if "." in text:  # the trace has 7 fractional digits; datetime takes at most 6
        head, frac = text.split(".", 1)
        text = f"{head}.{frac[:6]}"
    return datetime.fromisoformat(text)


def _params(local: dict[str, Any], drop: Sequence[str] = ()) -> dict[str, Any]:
    keep = (int, float, str, bool, type(None))
    return {
        k: v
        for k, v in local.items()
        if k not in drop and isinstance(v, keep) and not k.startswith("_")
    }


# ---------------------------------------------------------------------------- registry
WORKLOADS: dict[str, Callable[..., Workload]] = {
    "shared-system-prompt": shared_system_prompt,
    "generated-shared-prefix": generated_shared_prefix,
    "multi-turn": multi_turn,
    "tool-agent": tool_agent,
    "mooncake": mooncake,
    "azure": azure,
}


def workload_params(name: str) -> dict[str, Any]:
    """The parameters of a workload and their defaults."""
    fn = _lookup(name)
    return {p.name: p.default for p in inspect.signature(fn).parameters.values()}


def build_workload(name: str, params: dict[str, Any] | None = None) -> Workload:
    """Build a workload by name; string values (from the command line) are converted to the
    parameter's type. Unknown parameters are an error naming the valid ones."""
    fn = _lookup(name)
    defaults = workload_params(name)
    kwargs: dict[str, Any] = {}
    for key, value in (params or {}).items():
        key = key.replace("-", "_")
        if key not in defaults:
            raise ValueError(
                f"workload {name!r} has no parameter {key!r}; valid: {', '.join(defaults)}"
            )
        kwargs[key] = _coerce(key, value, defaults[key])
    return fn(**kwargs)


def parse_params(items: Iterable[str]) -> dict[str, str]:
    """``["a=1", "b=x"]`` -> ``{"a": "1", "b": "x"}``."""
    out: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"workload parameter {item!r} is not KEY=VALUE")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _lookup(name: str) -> Callable[..., Workload]:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}") from None


def _coerce(key: str, value: Any, default: Any) -> Any:
    if not isinstance(value, str) or isinstance(default, str):
        return value
    try:
        if isinstance(default, bool):
            return value.lower() in {"1", "true", "yes", "on"}
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
    except ValueError:
        raise ValueError(f"parameter {key}={value!r}: expected {type(default).__name__}") from None
    return value


# ---------------------------------------------------------------------------- analysis
def infinite_cache_hit_rate(
    requests: Sequence[BenchRequest],
    block_size: int = 16,
    keys: Sequence[Sequence[int]] | None = None,
    hash_seed: int = 0,
) -> float:
    """Upper bound of the prefix-cache hit rate: one cache that never evicts and serves every
    request in arrival order. = (prompt tokens in leading full blocks seen before) / (prompt
    tokens). Like vLLM, the last prompt token is always computed, so only the first
    ``(len - 1) // block_size`` blocks of a prompt can hit. ``keys`` (each prompt's canonical
    block keys, as the router computes them) avoids hashing again."""
    seen: set[int] = set()
    hit = total = 0
    for i, r in enumerate(requests):
        n_tok = r.prompt_tokens
        total += n_tok
        usable = max(0, (n_tok - 1) // block_size)
        full = keys[i] if keys is not None else block_keys(r.token_ids(), block_size, hash_seed)
        n = 0
        for k in full[:usable]:
            if k not in seen:
                break
            n += 1
        hit += n * block_size
        seen.update(full)
    return hit / total if total else 0.0
