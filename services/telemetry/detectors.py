"""Detectors: pure rules over a window of one worker's telemetry samples (no I/O).

Each rule looks at the recent :class:`Observation` s of one worker and returns a
:class:`Finding` (the condition holds now, with summary, remedy and the numbers seen) or None.
:class:`AlertBook` turns findings into alert *transitions*: one ``firing`` Alert when a
condition starts, nothing while it holds (de-duplicated), one ``resolved`` Alert once it has
been clear for ``clear_s``. :class:`DetectorSet` runs every rule for a worker and returns the
transitions; the agent sends them with ``raise_alert``.

Invariants:
- Rules never see I/O and never read the clock; ``now`` is passed in, so tests replay windows.
- A rule decides only on fresh samples (``stale`` ones carry no values) except the staleness
  rule itself; missing values (None) never satisfy a threshold.
- A windowed rule needs history covering ``coverage`` of its window before it may fire, so
  an agent that just started does not alert on two samples.
- Fingerprints are ``<kind>:<worker>``; at most one firing alert per fingerprint.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import msgspec

from services.common.schemas import Alert, GpuSample

SOURCE = "telemetry"


class Observation(msgspec.Struct, frozen=True, gc=False):
    """One worker sample as detectors see it (WorkerLoad plus what the agent knows).

    A frozen msgspec struct, not a frozen dataclass: the agent builds 640 a second and keeps
    ~40 s of them per worker; this one is built in C (~1 us against ~2.8 us) and, holding
    nothing that could form a reference cycle, is left out of the cyclic garbage collector's
    scans of the ~24,000 kept observations."""

    ts: float
    stale: bool = False
    error: str | None = None
    source: str = "vllm"  # vllm | sglang | trtllm | sim
    running: int | None = None  # vLLM/SGLang running; TensorRT-LLM "active"
    waiting: int | None = None
    scheduled: int | None = None  # TensorRT-LLM "scheduled" (None elsewhere)
    max_batch: int | None = None  # max_num_seqs / max_running_requests / TRT "max"
    kv_usage: float | None = None  # 0..1
    kv_capacity_tokens: int | None = None
    tokens_per_block: int | None = None
    prefix_caching: bool | None = None
    prefix_cache_queries: float | None = None  # cumulative counter (prompt tokens looked up)
    prefix_cache_hits: float | None = None  # cumulative counter (prompt tokens found cached)
    kv_events: int = 0  # KV event batches seen from this worker since the agent started
    typical_prompt_tokens: float | None = None
    typical_new_tokens: float | None = None  # requested max new tokens (typical)
    gpus: tuple[GpuSample, ...] = ()
    url: str = ""

    @property
    def active(self) -> int | None:
        """Requests the engine holds: TensorRT-LLM 'active'; elsewhere running + waiting."""
        if self.running is None:
            return None
        if self.scheduled is not None:
            return self.running
        return self.running + (self.waiting or 0)

    @property
    def in_batch(self) -> int | None:
        """Requests in the running batch: TensorRT-LLM 'scheduled'; elsewhere running."""
        return self.scheduled if self.scheduled is not None else self.running


@dataclass(frozen=True)
class Finding:
    summary: str
    remedy: str
    details: dict[str, Any] = field(default_factory=dict)


def _fresh(window: Sequence[Observation]) -> list[Observation]:
    return [o for o in window if not o.stale]


def _last_fresh(window: Sequence[Observation]) -> Observation | None:
    """The newest sample that carries values (scanning back from the end, not the window)."""
    for o in reversed(window):
        if not o.stale:
            return o
    return None


def _covered(window: Sequence[Observation], now: float, span: float, coverage: float) -> bool:
    """The window reaches back at least ``coverage * span`` seconds."""
    return bool(window) and now - window[0].ts >= coverage * span


def _ts(o: Observation) -> float:
    return o.ts


def _in(window: Sequence[Observation], now: float, span: float) -> list[Observation]:
    """The samples of the last ``span`` seconds. ``window`` is in ``ts`` order (a worker has
    one scrape in flight at a time), so a binary search finds the start: the agent keeps
    ~40 s of history per worker and evaluates every rule every second."""
    start = now - span
    seq = window if isinstance(window, list) else list(window)
    return seq[bisect.bisect_left(seq, start, key=_ts) :]


def _gib(n: float | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def _knobs(source: str) -> str:
    if source == "trtllm":
        return "max_tokens_in_paged_kv_cache / kv_cache_free_gpu_mem_fraction"
    if source == "sglang":
        return "mem_fraction_static / max_total_tokens"
    return "gpu_memory_utilization / num_gpu_blocks_override"


def _batch_knob(source: str) -> str:
    return {"trtllm": "max_batch_size", "sglang": "max_running_requests"}.get(
        source, "max_num_seqs"
    )


# --------------------------------------------------------------------------- rules


@dataclass
class KvStarved:
    """Seed 001: requests pile up while only a few run, because the KV cache is full.

    Holds when, in at least ``min_fraction`` of the fresh samples of the last ``window_s``:
    active >= ``min_active``, active >= ``ratio`` x max(in_batch, 1), KV usage >= ``kv_full``,
    and the batch is well below its configured maximum (in_batch <= ``batch_fraction`` x max),
    i.e. it is the cache, not the batch limit, that holds requests back.
    """

    kind: str = "kv_starved"
    severity: str = "warning"
    window_s: float = 5.0
    coverage: float = 0.8
    min_fraction: float = 0.8
    kv_full: float = 0.9
    ratio: float = 2.0
    min_active: int = 4
    batch_fraction: float = 0.5

    def _holds(self, o: Observation) -> bool:
        active, batch = o.active, o.in_batch
        if active is None or batch is None or o.kv_usage is None:
            return False
        if active < self.min_active or active < self.ratio * max(batch, 1):
            return False
        if o.kv_usage < self.kv_full:
            return False
        return o.max_batch is None or batch <= self.batch_fraction * o.max_batch

    def check(self, worker: str, window: Sequence[Observation], now: float) -> Finding | None:
        if not _covered(window, now, self.window_s, self.coverage):
            return None
        obs = _fresh(_in(window, now, self.window_s))
        if not obs:
            return None
        # stop at the first sample too many that does not hold (a healthy worker: after ~20%)
        allowed = len(obs) - self.min_fraction * len(obs)
        misses = 0
        last = None
        for o in obs:
            if self._holds(o):
                last = o
            else:
                misses += 1
                if misses > allowed:
                    return None
        if last is None:
            return None
        o = last
        active, batch = o.active or 0, o.in_batch or 0
        cap = o.kv_capacity_tokens
        per_req = None
        if o.typical_prompt_tokens is not None and o.typical_new_tokens is not None:
            per_req = o.typical_prompt_tokens + o.typical_new_tokens
        elif cap and batch:
            per_req = cap / batch  # what each running request holds now
        need = math.ceil(active * per_req) if per_req else None
        fit = int(cap // per_req) if cap and per_req else None
        mb = o.max_batch
        seen = (
            f"{active} active but only {batch} scheduled"
            + (f" (max batch {mb})" if mb else "")
            + f", KV cache {o.kv_usage * 100:.0f}% used"
            + (f" ({cap} tokens)" if cap else "")
            + f", sustained over {self.window_s:g} s"
        )
        if o.source == "trtllm":
            remedy = (
                f"Raise max_tokens_in_paged_kv_cache (now {cap if cap else '?'} tokens"
                + (
                    f" = {o.kv_capacity_tokens // o.tokens_per_block} blocks x {o.tokens_per_block}"
                    if cap and o.tokens_per_block
                    else ""
                )
                + ") or kv_cache_free_gpu_mem_fraction so the KV cache holds the batch"
                + (
                    f": {active} requests of ~{per_req:.0f} tokens need about {need} tokens"
                    if need
                    else ""
                )
                + ". For very short requests also consider max_queue_delay_microseconds."
            )
        elif o.source == "sglang":
            remedy = (
                f"Raise mem_fraction_static (KV now {cap if cap else '?'} tokens) or lower "
                f"max_running_requests"
                + (f" to {fit}" if fit is not None else "")
                + (
                    f"; {active} requests of ~{per_req:.0f} tokens need about {need} tokens"
                    if need
                    else ""
                )
                + "."
            )
        else:
            remedy = (
                f"Raise gpu_memory_utilization so vLLM gets more KV blocks (now {cap if cap else '?'} tokens)"
                + (
                    f", or lower max_num_seqs to {max(1, fit)} so the batch fits the cache"
                    if fit is not None
                    else ", or lower max_num_seqs so the batch fits the cache"
                )
                + (
                    f"; {active} requests of ~{per_req:.0f} tokens need about {need} tokens"
                    if need
                    else ""
                )
                + "."
            )
        return Finding(
            summary=f"{worker}: batching starved by KV capacity: {seen}",
            remedy=remedy,
            details={
                "active": active,
                "scheduled": batch,
                "max_batch": mb,
                "kv_usage": round(o.kv_usage or 0.0, 4),
                "kv_capacity_tokens": cap,
                "tokens_per_request": None if per_req is None else round(per_req, 1),
                "needed_tokens": need,
                "engine": o.source,
                "window_s": self.window_s,
            },
        )


@dataclass
class KvCapacityConfig:
    """Seed 003: the KV cache cannot hold the engine's own full batch.

    Holds when capacity_tokens < max_batch x (typical prompt + max new tokens), with all four
    known (the typical lengths observed from the engine / router or configured).
    """

    kind: str = "kv_capacity_config"
    severity: str = "warning"
    margin: float = 1.0  # required capacity = margin x batch x (prompt + new)

    def check(self, worker: str, window: Sequence[Observation], now: float) -> Finding | None:
        o = _last_fresh(window)
        if o is None:
            return None
        cap, mb = o.kv_capacity_tokens, o.max_batch
        p, n = o.typical_prompt_tokens, o.typical_new_tokens
        if cap is None or not mb or p is None or n is None:
            return None
        per_req = p + n
        need = math.ceil(self.margin * mb * per_req)
        if cap >= need:
            return None
        bs = o.tokens_per_block or 1
        need_blocks = math.ceil(need / bs)
        minimum = need_blocks * bs
        fit = int(cap // per_req) if per_req else 0
        return Finding(
            summary=(
                f"{worker}: KV capacity {cap} tokens cannot hold its own batch: max batch {mb} x "
                f"(prompt {p:.0f} + max new {n:.0f}) = {need} tokens"
            ),
            remedy=(
                f"Give the KV cache at least {minimum} tokens"
                + (f" ({need_blocks} blocks of {bs})" if bs > 1 else "")
                + f" via {_knobs(o.source)}, or lower {_batch_knob(o.source)} to {max(1, fit)} "
                f"(cache_lens > max_batch_size x (prompt + max_new_tokens))."
            ),
            details={
                "kv_capacity_tokens": cap,
                "max_batch": mb,
                "typical_prompt_tokens": round(p, 1),
                "max_new_tokens": round(n, 1),
                "required_tokens": need,
                "minimum_tokens": minimum,
                "batch_that_fits": fit,
                "engine": o.source,
            },
        )


@dataclass
class Overload:
    """The waiting queue grows over the window while the KV cache (or batch) is full."""

    kind: str = "overload"
    severity: str = "critical"
    window_s: float = 10.0
    coverage: float = 0.8
    min_growth: int = 5
    kv_high: float = 0.95

    def check(self, worker: str, window: Sequence[Observation], now: float) -> Finding | None:
        if not _covered(window, now, self.window_s, self.coverage):
            return None
        obs = [o for o in _fresh(_in(window, now, self.window_s)) if o.waiting is not None]
        if len(obs) < 3:
            return None
        first, last = obs[0], obs[-1]
        growth = (last.waiting or 0) - (first.waiting or 0)
        if growth < self.min_growth:
            return None
        # growing, not one spike: the later half waits more than the earlier half
        half = len(obs) // 2
        early = sum(o.waiting or 0 for o in obs[:half]) / max(1, half)
        late = sum(o.waiting or 0 for o in obs[half:]) / max(1, len(obs) - half)
        if late <= early:
            return None
        kv_full = last.kv_usage is not None and last.kv_usage >= self.kv_high
        batch_full = bool(last.max_batch) and (last.in_batch or 0) >= (last.max_batch or 0)
        if not (kv_full or batch_full):
            return None
        return Finding(
            summary=(
                f"{worker}: overloaded: waiting queue grew {first.waiting} -> {last.waiting} in "
                f"{last.ts - first.ts:.0f} s with KV cache "
                + ("?" if last.kv_usage is None else f"{last.kv_usage * 100:.0f}%")
                + f" used and {last.in_batch} running"
            ),
            remedy=(
                "Send less traffic to this worker (the router's per-worker cap / circuit breaker), "
                "add workers, or raise its KV capacity; requests are queuing faster than it "
                "finishes them."
            ),
            details={
                "waiting_from": first.waiting,
                "waiting_to": last.waiting,
                "kv_usage": last.kv_usage,
                "running": last.in_batch,
                "max_batch": last.max_batch,
                "window_s": self.window_s,
            },
        )


@dataclass
class GpuMemory:
    """A GPU of this worker has its memory nearly full for most of the window."""

    kind: str = "gpu_memory"
    severity: str = "warning"
    window_s: float = 3.0
    coverage: float = 0.8
    min_fraction: float = 0.8
    threshold: float = 0.97

    def check(self, worker: str, window: Sequence[Observation], now: float) -> Finding | None:
        if not _covered(window, now, self.window_s, self.coverage):
            return None
        obs = _in(window, now, self.window_s)
        counts: dict[int, int] = {}
        seen: dict[int, int] = {}
        last: dict[int, GpuSample] = {}
        for o in obs:
            for g in o.gpus:
                if g.mem_used_bytes is None or not g.mem_total_bytes:
                    continue
                seen[g.index] = seen.get(g.index, 0) + 1
                last[g.index] = g
                if g.mem_used_bytes >= self.threshold * g.mem_total_bytes:
                    counts[g.index] = counts.get(g.index, 0) + 1
        full = sorted(i for i, c in counts.items() if c >= self.min_fraction * seen[i])
        if not full:
            return None
        parts = [
            f"GPU {i} {_gib(last[i].mem_used_bytes)} of {_gib(last[i].mem_total_bytes)}"
            for i in full
        ]
        return Finding(
            summary=f"{worker}: GPU memory near saturation: " + ", ".join(parts),
            remedy=(
                "Lower the engine's memory fraction (vLLM gpu_memory_utilization, TensorRT-LLM "
                "kv_cache_free_gpu_mem_fraction, SGLang mem_fraction_static) or move other "
                "processes off the GPU; allocations beyond this point fail with out-of-memory."
            ),
            details={
                "gpus": full,
                "threshold": self.threshold,
                "used_bytes": {str(i): last[i].mem_used_bytes for i in full},
                "total_bytes": {str(i): last[i].mem_total_bytes for i in full},
            },
        )


@dataclass
class StaleTelemetry:
    """No fresh sample from the worker for ``after_s`` (scrapes failing)."""

    kind: str = "stale_telemetry"
    severity: str = "warning"
    after_s: float = 2.0

    def check(self, worker: str, window: Sequence[Observation], now: float) -> Finding | None:
        if not window or not window[-1].stale:
            return None
        fresh = _last_fresh(window)
        since = fresh.ts if fresh else window[0].ts
        if now - since < self.after_s:
            return None
        last = window[-1]
        return Finding(
            summary=(
                f"{worker}: telemetry stale for {now - since:.1f} s"
                + (" (no fresh sample since the agent started)" if not fresh else "")
                + f": {last.error or 'scrape failed'}"
            ),
            remedy=(
                "Check that the worker is running and its metrics endpoint answers"
                + (f" ({last.url})" if last.url else "")
                + "; meanwhile its samples are published with stale=true and no values."
            ),
            details={"stale_for_s": round(now - since, 2), "error": last.error, "url": last.url},
        )


@dataclass
class XidErrors:
    """A GPU of this worker reported a critical XID error, or its volatile uncorrected ECC
    count grew, within the last ``hold_s``. (XID counts start at the agent's start, so any is
    new; the ECC count is a baseline at first sight and only increases count.)"""

    kind: str = "xid_error"
    severity: str = "critical"
    hold_s: float = 300.0
    _state: dict[tuple[str, int, str], tuple[int, float, int | None]] = field(
        default_factory=dict, repr=False
    )

    def _see(self, key: tuple[str, int, str], count: int, code: int | None, now: float) -> None:
        prev = self._state.get(key)
        if prev is None:
            new = key[2] == "xid" and count > 0
            self._state[key] = (count, now if new else -math.inf, code)
        elif count > prev[0]:
            self._state[key] = (count, now, code)
        elif count < prev[0]:  # counter reset (driver reload / agent restart): new baseline
            self._state[key] = (count, prev[1], prev[2])

    def check(self, worker: str, window: Sequence[Observation], now: float) -> Finding | None:
        for o in window[-1:]:
            for g in o.gpus:
                if g.xid_errors is not None:
                    self._see((worker, g.index, "xid"), g.xid_errors, g.last_xid, now)
                if g.ecc_errors is not None:
                    self._see((worker, g.index, "ecc"), g.ecc_errors, None, now)
        recent = sorted(
            (idx, what, count, code)
            for (w, idx, what), (count, at, code) in self._state.items()
            if w == worker and now - at < self.hold_s
        )
        if not recent:
            return None
        parts = [
            f"GPU {i}: {c} XID error(s), last XID {x}"
            if what == "xid"
            else f"GPU {i}: uncorrected ECC errors rose to {c}"
            for i, what, c, x in recent
        ]
        return Finding(
            summary=f"{worker}: critical GPU errors: " + "; ".join(parts),
            remedy=(
                "Drain the worker (kvgate cordon / drain) and check `nvidia-smi -q` and the "
                "kernel log (dmesg, NVRM: Xid) for this XID / ECC error; reset or replace the "
                "GPU if it recurs."
            ),
            details={
                "gpus": [
                    {"gpu": i, "error": what, "count": c, "last_xid": x} for i, what, c, x in recent
                ]
            },
        )


@dataclass
class NoKvEvents:
    """Prefix caching is on and the worker computed new KV blocks, but no KV events arrive.

    "Computed new blocks" comes from the worker's own counters: the prompt tokens it looked
    up in its prefix cache and did *not* find (queries - hits) over the window, in blocks. A
    worker whose requests all hit its cache stores no new blocks, so it rightly publishes no
    events and this rule stays quiet. Only an engine that exports no prefix-cache counters is
    judged on being busy (running requests on half the samples)."""

    kind: str = "no_kv_events"
    severity: str = "warning"
    window_s: float = 30.0
    coverage: float = 0.9
    min_new_blocks: float = 4.0  # new blocks the window must hold before silence is suspect

    def check(self, worker: str, window: Sequence[Observation], now: float) -> Finding | None:
        if not _covered(window, now, self.window_s, self.coverage):
            return None
        obs = _fresh(_in(window, now, self.window_s))
        if len(obs) < 2 or obs[-1].prefix_caching is not True:
            return None
        first, last = obs[0], obs[-1]
        if last.kv_events > first.kv_events:
            return None
        q0, q1 = first.prefix_cache_queries, last.prefix_cache_queries
        if q0 is not None and q1 is not None:
            h0, h1 = first.prefix_cache_hits, last.prefix_cache_hits
            hits = (h1 - h0) if h0 is not None and h1 is not None and h1 >= h0 else 0.0
            missed = max(0.0, (q1 - q0) - hits)
            new_blocks = missed / (last.tokens_per_block or 16)
            if new_blocks < self.min_new_blocks:
                return None
            evidence = f" ({missed:.0f} uncached prompt tokens, ~{new_blocks:.0f} new blocks)"
        elif sum(1 for o in obs if (o.running or 0) > 0) >= len(obs) / 2:
            evidence = ""  # no prefix-cache counters: busy is all we know
        else:
            return None
        return Finding(
            summary=(
                f"{worker}: computes new KV blocks with prefix caching on but published no KV "
                f"events in {last.ts - first.ts:.0f} s" + evidence
            ),
            remedy=(
                "Enable KV events on the engine (vLLM/SGLang: --kv-events-config "
                '\'{"enable_kv_cache_events":true,"publisher":"zmq",...}\' and run '
                "`kvgate bridge` for it; TensorRT-LLM: event buffer + /kv_cache_events poll), "
                "and check the worker id matches; without events the router cannot see its "
                "cache and prefix routing to it is blind."
            ),
            details={"window_s": self.window_s, "kv_events": last.kv_events},
        )


RULES: dict[str, type] = {
    cls().kind: cls
    for cls in (
        KvStarved,
        KvCapacityConfig,
        Overload,
        GpuMemory,
        StaleTelemetry,
        XidErrors,
        NoKvEvents,
    )
}


def build_rules(config: dict[str, dict[str, Any]] | None = None) -> list[Any]:
    """One instance of every rule, with thresholds overridden from ``config``
    (``{"kv_starved": {"window_s": 3}, "no_kv_events": {"enabled": false}}``).
    Unknown rule names or fields are a ValueError naming them."""
    config = dict(config or {})
    unknown = set(config) - set(RULES)
    if unknown:
        raise ValueError(f"unknown detector(s) {sorted(unknown)}; known: {sorted(RULES)}")
    rules = []
    for kind, cls in RULES.items():
        opts = dict(config.get(kind) or {})
        if opts.pop("enabled", True) is False:
            continue
        names = {f.name for f in fields(cls) if not f.name.startswith("_")} - {"kind"}
        bad = set(opts) - names
        if bad:
            raise ValueError(
                f"detector {kind}: unknown setting(s) {sorted(bad)}; known: {sorted(names)}"
            )
        rules.append(replace(cls(), **opts))
    return rules


def max_window_s(rules: Sequence[Any]) -> float:
    return max(
        [getattr(r, "window_s", 0.0) for r in rules]
        + [getattr(r, "after_s", 0.0) for r in rules]
        + [1.0]
    )


# --------------------------------------------------------------------------- alert state


@dataclass
class _Firing:
    since: float
    last_true: float
    severity: str


class AlertBook:
    """Findings -> alert transitions: firing once, resolved after ``clear_s`` clear."""

    def __init__(self, clear_s: float = 5.0) -> None:
        self.clear_s = clear_s
        self.firing: dict[str, _Firing] = {}

    def update(
        self, worker: str, kind: str, severity: str, finding: Finding | None, now: float
    ) -> Alert | None:
        fp = f"{kind}:{worker}"
        state = self.firing.get(fp)
        if finding is not None:
            if state is not None:
                state.last_true = now
                return None
            self.firing[fp] = _Firing(since=now, last_true=now, severity=severity)
            return Alert(
                fingerprint=fp,
                kind=kind,
                severity=severity,  # type: ignore[arg-type]
                state="firing",
                source=SOURCE,
                worker_id=worker,
                summary=finding.summary[:2000],
                remedy=finding.remedy[:4000],
                details=finding.details,
                ts=now,
            )
        if state is None or now - state.last_true < self.clear_s:
            return None
        return self._resolve(fp, worker, kind, state, now, "condition cleared")

    def _resolve(
        self, fp: str, worker: str, kind: str, state: _Firing, now: float, why: str
    ) -> Alert:
        del self.firing[fp]
        return Alert(
            fingerprint=fp,
            kind=kind,
            severity=state.severity,  # type: ignore[arg-type]
            state="resolved",
            source=SOURCE,
            worker_id=worker,
            summary=f"{worker}: {kind} resolved ({why})",
            details={"firing_s": round(now - state.since, 2)},
            ts=now,
        )

    def forget(self, worker: str, now: float, why: str = "worker gone") -> list[Alert]:
        """Resolve every alert of a worker that is no longer watched."""
        out = []
        for fp, state in list(self.firing.items()):
            kind, _, w = fp.partition(":")
            if w == worker:
                out.append(self._resolve(fp, worker, kind, state, now, why))
        return out


class DetectorSet:
    """All rules plus the alert book: ``evaluate`` returns the alert transitions."""

    def __init__(self, rules: Sequence[Any] | None = None, clear_s: float = 5.0) -> None:
        self.rules = list(rules if rules is not None else build_rules())
        self.book = AlertBook(clear_s)

    @property
    def history_s(self) -> float:
        return max_window_s(self.rules)

    def evaluate(self, worker: str, window: Sequence[Observation], now: float) -> list[Alert]:
        out = []
        for rule in self.rules:
            finding = rule.check(worker, window, now)
            alert = self.book.update(worker, rule.kind, rule.severity, finding, now)
            if alert is not None:
                out.append(alert)
        return out
