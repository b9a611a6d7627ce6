"""Engine ``/metrics`` text -> one normalised :class:`EngineReading` (pure, no I/O).

Engines and the names read (verified against each project's documentation / examples):

- vLLM: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (older: ``vllm:gpu_cache_usage_perc``),
  ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (older:
  ``vllm:gpu_prefix_cache_*``), ``vllm:cache_config_info`` labels (``block_size``,
  ``num_gpu_blocks``, ``enable_prefix_caching``), and the ``_sum`` / ``_count`` of the
  ``vllm:request_prompt_tokens`` and ``vllm:request_params_max_tokens`` histograms (typical
  prompt and requested max new tokens).
- SGLang: ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``,
  ``sglang:cache_hit_rate``, ``sglang:max_total_num_tokens``, ``sglang:max_running_requests``.
- Triton TensorRT-LLM backend: ``nv_trt_llm_request_metrics{request_type=active|scheduled|
  max|waiting|context}`` and ``nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=max|free|
  used|tokens_per|fraction}`` (pre-24.x: ``..._statistics``).
- kvgate's simulated worker: the vLLM names plus ``sim:gpu_sm_util_percent``,
  ``sim:gpu_mem_util_percent``, ``sim:gpu_mem_used_bytes``, ``sim:gpu_mem_total_bytes``,
  ``sim:gpu_mem_bw_util_percent`` (optional ``gpu`` label), and its batch limit
  (``sim:max_num_seqs``, or a ``max_num_seqs`` label on ``vllm:cache_config_info``).

Invariants:
- Only lines of the families above are parsed: one regex picks (series, value) pairs of them
  out of the (often 30-100 kB, histogram-heavy) exposition. prometheus-client's parser reads
  each distinct series (``name{labels}``) once; what the series means for the reading (which
  sum it adds to, or which labels it carries) is decided then and memoised, so per scrape only
  the values are converted and added up. A sample line without a value is skipped.
- A value the engine did not expose stays ``None``; nothing is defaulted to 0.
- Several label sets of one gauge (data-parallel ranks, models) are summed for counts and
  averaged for fractions.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from urllib.parse import quote

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from services.common.schemas import GpuSample

ENGINES = ("vllm", "sglang", "trtllm", "sim")

# Sample names per engine for the ``?name[]=...`` filter that prometheus-client's exposition
# apps (``make_asgi_app`` / ``make_wsgi_app``, which vLLM and SGLang mount at /metrics) honour:
# the server then renders only these series (~1 kB instead of 30-100 kB). A server that ignores
# the query (Triton, plain handlers) returns everything and the local selection below applies.
# (the series that change every scrape, then the slow ones: see _VLLM_FAST below)
_VLLM_NAMES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_hits_total",
    "vllm:cache_config_info",
    "vllm:request_prompt_tokens_sum",
    "vllm:request_prompt_tokens_count",
    "vllm:request_params_max_tokens_sum",
    "vllm:request_params_max_tokens_count",
)
# the sim worker's GPU gauges (fast-changing, so in both name sets below)
_SIM_GPU_NAMES = (
    "sim:gpu_sm_util_percent",
    "sim:gpu_mem_util_percent",
    "sim:gpu_mem_used_bytes",
    "sim:gpu_mem_total_bytes",
    "sim:gpu_mem_bw_util_percent",
)
FILTER_NAMES: dict[str, tuple[str, ...]] = {
    "vllm": _VLLM_NAMES,
    "sim": _VLLM_NAMES + _SIM_GPU_NAMES + ("sim:max_num_seqs",),
    "sglang": (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:cache_hit_rate",
        "sglang:max_total_num_tokens",
        "sglang:max_running_requests",
    ),
}


# Of those, the series that change from one scrape to the next. The others -- the engine's
# cache configuration (``cache_config_info``, ``sim:max_num_seqs``) and the request-length
# histograms that only the once-a-second capacity check reads -- are asked for on every
# ``engine_slow_every``-th scrape (1 s) and carried over in between (:func:`carry_slow`):
# the answer is half as long and parsed in about half the time.
_VLLM_FAST = _VLLM_NAMES[: _VLLM_NAMES.index("vllm:cache_config_info")]
FAST_NAMES: dict[str, tuple[str, ...]] = {
    "vllm": _VLLM_FAST,
    "sim": _VLLM_FAST + _SIM_GPU_NAMES,
}
# the reading's fields that come only from the slow series (carried between full answers)
SLOW_FIELDS = (
    "max_batch",
    "tokens_per_block",
    "kv_blocks_total",
    "kv_capacity_tokens",
    "prefix_caching",
    "prompt_tokens_sum",
    "prompt_tokens_count",
    "max_tokens_sum",
    "max_tokens_count",
)


@functools.cache
def filter_query(engine: str | None, fast: bool = False) -> str:
    """``name[]=a&name[]=b...`` for the engine ('' when it has no filterable exposition);
    ``fast``: only the fast-changing series ('' when the engine has no such split)."""
    names = (FAST_NAMES if fast else FILTER_NAMES).get(engine or "")
    return "&".join("name%5B%5D=" + quote(n, safe="") for n in names) if names else ""


def carry_slow(r: EngineReading, base: EngineReading) -> None:
    """Complete ``r`` -- a reading of the fast-changing series only, not yet shared -- with
    the slow fields it lacks from ``base``, the target's last full reading (what the engine
    does not expose stays None in both)."""
    for name in SLOW_FIELDS:
        if getattr(r, name) is None:
            setattr(r, name, getattr(base, name))
    if r.kv_blocks_free is None and r.kv_blocks_total is not None and r.kv_usage is not None:
        if r.source in ("vllm", "sim"):  # as _vllm derives it
            r.kv_blocks_free = max(0, int(round(r.kv_blocks_total * (1.0 - r.kv_usage))))
    if r.kv_capacity_tokens is None and r.kv_blocks_total and r.tokens_per_block:
        r.kv_capacity_tokens = r.kv_blocks_total * r.tokens_per_block


# A fast answer from vLLM is a handful of lines, one label set per series when the engine
# serves one model on one rank (the common case). Then one regex over the bytes and a dict
# give every value without the per-series plans below: parse_fast_vllm.
_FAST_VLLM_RE = re.compile(rb"\n(vllm:[a-z_]+)(?:\{[^\n]*\})?[ \t]+([^ \t\n]+)")
_FAST_VLLM_NAMES = frozenset(
    n.encode() for name in _VLLM_FAST for n in (name, name.removesuffix("_total"))
)


def _pick(get: Callable[[bytes], bytes | None], *names: bytes) -> float | None:
    """The first of ``names`` present; ``name`` and ``name_total`` count as one series and
    add up, as in :func:`parse_metrics`."""
    for n in names:
        v, t = get(n), get(n + b"_total")
        if v is not None or t is not None:
            return (0.0 if v is None else float(v)) + (0.0 if t is None else float(t))
    return None


def parse_fast_vllm(body: bytes, base: EngineReading) -> EngineReading | None:
    """A vLLM answer to the fast-series filter, completed with ``base``'s slow fields:
    exactly what ``parse_metrics`` + :func:`carry_slow` make of it, or None when the answer
    is not of that simple shape (several label sets of one series, other families, nothing
    known) and has to go the general way."""
    pairs = _FAST_VLLM_RE.findall(b"\n" + body)
    values = dict(pairs)
    if not values or len(values) != len(pairs) or not values.keys() <= _FAST_VLLM_NAMES:
        return None
    get = values.get
    kv = _frac(_pick(get, b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc"))
    total, tpb = base.kv_blocks_total, base.tokens_per_block
    return EngineReading(
        source="vllm",
        running=_int(_pick(get, b"vllm:num_requests_running")),
        waiting=_int(_pick(get, b"vllm:num_requests_waiting")),
        kv_usage=kv,
        prefix_cache_queries=_pick(
            get, b"vllm:prefix_cache_queries", b"vllm:gpu_prefix_cache_queries"
        ),
        prefix_cache_hits=_pick(get, b"vllm:prefix_cache_hits", b"vllm:gpu_prefix_cache_hits"),
        max_batch=base.max_batch,
        tokens_per_block=tpb,
        kv_blocks_total=total,
        kv_blocks_free=(
            max(0, int(round(total * (1.0 - kv)))) if total is not None and kv is not None else None
        ),
        kv_capacity_tokens=base.kv_capacity_tokens
        if base.kv_capacity_tokens is not None
        else (total * tpb if total and tpb else None),
        prefix_caching=base.prefix_caching,
        prompt_tokens_sum=base.prompt_tokens_sum,
        prompt_tokens_count=base.prompt_tokens_count,
        max_tokens_sum=base.max_tokens_sum,
        max_tokens_count=base.max_tokens_count,
    )


# The families read, factored by engine prefix (the regex engine then rejects most line starts
# after one or two characters: ~30 us for a 32 kB vLLM exposition instead of ~150 us).
_WANTED = (
    r"vllm:(?:num_requests_(?:running|waiting)|(?:kv|gpu)_cache_usage_perc"
    r"|(?:gpu_)?prefix_cache_(?:queries|hits)(?:_total)?|cache_config_info"
    r"|request_(?:prompt_tokens|params_max_tokens)_(?:sum|count))",
    r"sglang:(?:num_running_reqs|num_queue_reqs|token_usage|cache_hit_rate"
    r"|max_total_num_tokens|max_running_requests)",
    r"nv_trt_llm_(?:request|kv_cache_block)_(?:metrics|statistics)",
    r"sim:(?:gpu_[a-z_]+|max_num_seqs)",
)
# a sample line starts (after a newline) with one of the wanted names and then '{' or a blank;
# the leading literal newline lets the regex engine skip quickly between line starts
_LINE_RE = re.compile(r"\n((?:" + "|".join(_WANTED) + r")[ \t{][^\n]*)")
# the same lines as (series, value): the series ends at the line's last '}' that is followed
# by blanks and a value (labels may hold '}' and blanks inside quotes); a timestamp is ignored
_PAIR_RE = re.compile(r"\n((?:" + "|".join(_WANTED) + r")(?:\{[^\n]*\})?)[ \t]+([^ \t\n]+)")
_SERIES_MAX = 100_000
_series_cache: dict[str, tuple[str, dict[str, str]]] = {}
# what a series contributes to a reading: (_ACC, sum key, None) | (_INFO, "", labels)
# | (_MAX_SEQS, "", None) | (_GPU, name, gpu index)
_ACC, _INFO, _MAX_SEQS, _GPU = range(4)
_Plan = tuple[int, str, object]
_plans: dict[str, _Plan] = {}


class EngineReading(msgspec.Struct, kw_only=True):
    """What one scrape said, normalised across engines (None = not exposed). A msgspec
    struct: 640 are built a second, and one is built in C (~0.4 us, against ~2 us for the
    dataclass it was)."""

    source: str = "vllm"
    running: int | None = None
    waiting: int | None = None
    scheduled: int | None = None
    max_batch: int | None = None
    kv_usage: float | None = None
    kv_blocks_total: int | None = None
    kv_blocks_free: int | None = None
    tokens_per_block: int | None = None
    kv_capacity_tokens: int | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    cache_hit_rate: float | None = None  # only when the engine reports a rate itself (SGLang)
    prefix_caching: bool | None = None
    prompt_tokens_sum: float | None = None
    prompt_tokens_count: float | None = None
    max_tokens_sum: float | None = None
    max_tokens_count: float | None = None
    gpus: list[GpuSample] = []


def select_lines(text: str) -> list[str]:
    """The sample lines of the families we read (everything else is skipped unparsed)."""
    return _LINE_RE.findall("\n" + text)


def _series(key: str) -> tuple[str, dict[str, str]]:
    """``name{labels}`` -> (name, labels), parsed by prometheus-client's parser once per
    distinct series (series are stable between scrapes; only values change). The labels
    dict is shared: read it, never change it."""
    hit = _series_cache.get(key)
    if hit is None:
        if len(_series_cache) >= _SERIES_MAX:
            _series_cache.clear()
        sample = next(iter(text_string_to_metric_families(key + " 0\n"))).samples[0]
        hit = _series_cache[key] = (sample.name, sample.labels)
    return hit


def sample_pairs(text: str) -> list[tuple[str, str]]:
    """(series, value text) of each sample line of the families we read."""
    return _PAIR_RE.findall("\n" + text)


def _plan(key: str) -> _Plan:
    """What series ``key`` adds to a reading (decided once per distinct series)."""
    name, labels = _series(key)
    if name.startswith("nv_trt_llm_request_"):
        plan: _Plan = (_ACC, "trt:req:" + labels.get("request_type", ""), None)
    elif name.startswith("nv_trt_llm_kv_cache_block_"):
        plan = (_ACC, "trt:kv:" + labels.get("kv_cache_block_type", ""), None)
    elif name == "vllm:cache_config_info":
        plan = (_INFO, "", labels)
    elif name == "sim:max_num_seqs":
        plan = (_MAX_SEQS, "", None)
    elif name.startswith("sim:gpu_"):
        plan = (_GPU, name, _as_int(labels.get("gpu")) or 0)
    else:
        plan = (_ACC, name.removesuffix("_total"), None)
    if len(_plans) >= _SERIES_MAX:
        _plans.clear()
    _plans[key] = plan
    return plan


def _as_bool(text: str | None) -> bool | None:
    if text is None:
        return None
    low = text.strip().lower()
    if low in {"true", "1", "yes"}:
        return True
    if low in {"false", "0", "no"}:
        return False
    return None


def _as_int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(float(text))
    except ValueError:
        return None


class _Acc:
    """Sums and means of the samples seen per name (several label sets per gauge)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value
        self.counts[key] = self.counts.get(key, 0) + 1

    def total(self, *keys: str) -> float | None:
        for k in keys:
            if k in self.sums:
                return self.sums[k]
        return None

    def mean(self, *keys: str) -> float | None:
        for k in keys:
            if k in self.sums:
                return self.sums[k] / self.counts[k]
        return None


def _int(v: float | None) -> int | None:
    return None if v is None else max(0, int(round(v)))


def _frac(v: float | None) -> float | None:
    return None if v is None else min(1.0, max(0.0, v))


def parse_metrics(text: str, engine: str | None = None) -> EngineReading:
    """Normalise one exposition. ``engine`` (vllm|sglang|trtllm|sim) is detected if None.

    Raises ValueError when the text holds none of the known families (wrong URL, unknown
    engine) so the caller reports the scrape as failed rather than publishing empties.
    """
    acc = _Acc()
    sums, counts = acc.sums, acc.counts
    info: dict[str, str] = {}
    gpus: dict[int, dict[str, float]] = {}
    plans = _plans
    for key, text_value in sample_pairs(text):
        kind, target, arg = plans.get(key) or _plan(key)
        value = float(text_value)  # also NaN, +Inf, -Inf
        if kind == _ACC:
            sums[target] = sums.get(target, 0.0) + value
            counts[target] = counts.get(target, 0) + 1
        elif kind == _INFO:
            info.update(arg)  # type: ignore[call-overload]
        elif kind == _MAX_SEQS:
            info.setdefault("max_num_seqs", str(value))
        else:
            gpus.setdefault(arg, {})[target] = value  # type: ignore[call-overload]
    if not acc.sums and not info and not gpus:
        raise ValueError("no vLLM, SGLang, TensorRT-LLM or sim metrics in the response")
    if engine is None:
        if any(k.startswith("trt:") for k in acc.sums):
            engine = "trtllm"
        elif any(k.startswith("sglang:") for k in acc.sums):
            engine = "sglang"
        elif gpus:
            engine = "sim"
        else:
            engine = "vllm"
    r = EngineReading(source=engine)
    if engine == "trtllm":
        _trtllm(r, acc)
    elif engine == "sglang":
        _sglang(r, acc)
    else:
        _vllm(r, acc, info)
    r.gpus = [_sim_gpu(i, g) for i, g in sorted(gpus.items())]
    return r


def _vllm(r: EngineReading, acc: _Acc, info: dict[str, str]) -> None:
    r.running = _int(acc.total("vllm:num_requests_running"))
    r.waiting = _int(acc.total("vllm:num_requests_waiting"))
    r.kv_usage = _frac(acc.mean("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"))
    r.prefix_cache_queries = acc.total("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries")
    r.prefix_cache_hits = acc.total("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")
    r.prompt_tokens_sum = acc.total("vllm:request_prompt_tokens_sum")
    r.prompt_tokens_count = acc.total("vllm:request_prompt_tokens_count")
    r.max_tokens_sum = acc.total("vllm:request_params_max_tokens_sum")
    r.max_tokens_count = acc.total("vllm:request_params_max_tokens_count")
    r.tokens_per_block = _as_int(info.get("block_size"))
    r.kv_blocks_total = _as_int(info.get("num_gpu_blocks"))
    r.prefix_caching = _as_bool(info.get("enable_prefix_caching"))
    r.max_batch = _as_int(info.get("max_num_seqs"))  # the sim worker labels it; vLLM does not
    if r.kv_blocks_total is not None and r.tokens_per_block is not None:
        r.kv_capacity_tokens = r.kv_blocks_total * r.tokens_per_block
        if r.kv_usage is not None:
            r.kv_blocks_free = max(0, int(round(r.kv_blocks_total * (1.0 - r.kv_usage))))


def _sglang(r: EngineReading, acc: _Acc) -> None:
    r.running = _int(acc.total("sglang:num_running_reqs"))
    r.waiting = _int(acc.total("sglang:num_queue_reqs"))
    r.kv_usage = _frac(acc.mean("sglang:token_usage"))
    r.cache_hit_rate = _frac(acc.mean("sglang:cache_hit_rate"))
    r.kv_capacity_tokens = _int(acc.total("sglang:max_total_num_tokens"))
    r.max_batch = _int(acc.total("sglang:max_running_requests"))
    if r.cache_hit_rate is not None:
        r.prefix_caching = True  # the radix cache reports a hit rate only when it is on


def _trtllm(r: EngineReading, acc: _Acc) -> None:
    r.running = _int(acc.total("trt:req:active"))
    r.scheduled = _int(acc.total("trt:req:scheduled"))
    r.max_batch = _int(acc.total("trt:req:max"))
    r.waiting = _int(acc.total("trt:req:waiting"))
    total = _int(acc.total("trt:kv:max"))
    free = _int(acc.total("trt:kv:free"))
    used = _int(acc.total("trt:kv:used"))
    tpb = _int(acc.mean("trt:kv:tokens_per"))
    r.kv_blocks_total, r.kv_blocks_free, r.tokens_per_block = total, free, tpb
    if total:
        if used is None and free is not None:
            used = total - free
        if used is not None:
            r.kv_usage = _frac(used / total)
        if tpb:
            r.kv_capacity_tokens = total * tpb


def _sim_gpu(index: int, g: dict[str, float]) -> GpuSample:
    used = g.get("sim:gpu_mem_used_bytes")
    total = g.get("sim:gpu_mem_total_bytes")
    return GpuSample(
        index=index,
        name="simulated",
        sm_util_pct=g.get("sim:gpu_sm_util_percent"),
        mem_util_pct=g.get("sim:gpu_mem_util_percent"),
        mem_used_bytes=None if used is None else int(used),
        mem_total_bytes=None if total is None else int(total),
        mem_free_bytes=None if used is None or total is None else max(0, int(total - used)),
        mem_bw_util_pct=g.get("sim:gpu_mem_bw_util_percent"),
    )
