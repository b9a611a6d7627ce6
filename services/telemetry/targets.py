"""Which workers the agent scrapes and which GPUs serve them (pure parsing and bookkeeping).

Sources of targets:
- ``WorkerHeartbeat`` on ``workers.heartbeat.*`` (url, engine, capacity): added on the first
  heartbeat, forgotten ``forget_after_s`` after the last one (while it is silent it is still
  scraped, so its telemetry turns stale and the staleness detector fires).
- ``--targets`` for engines that send no kvgate heartbeat:
  ``"vllm-a=http://10.0.0.5:8000@vllm; trt-b=http://10.0.0.6:8002/metrics@trtllm"``
  (``@engine`` optional: detected from the metric names; ``/metrics`` appended when the URL
  has no path).

GPU -> worker mapping, in order of precedence:
1. ``--gpu-map "worker-a=0,1; worker-b=2"`` (GPU indices as NVML numbers them);
2. ``--pid-map "worker-a=4242"``: GPUs whose NVML running-process list holds that pid or one of
   its descendants (vLLM's engine core is a child of the API server);
3. for a worker on this host, the pid listening on its URL's port (found via /proc), then as 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from services.common.schemas import WorkerCapacity
from services.common.subjects import check_token

from .engines import ENGINES


@dataclass
class Target:
    worker_id: str
    url: str  # full metrics URL
    engine: str | None = None  # None: detect from the metrics
    static: bool = False
    capacity: WorkerCapacity | None = None
    kv_events_declared: bool | None = None
    last_heartbeat: float = 0.0
    pid: int | None = None


def metrics_url(url: str) -> str:
    """``http://h:p`` -> ``http://h:p/metrics``; a URL with a path is kept as given."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"not an http(s) URL: {url!r}")
    path = parts.path if parts.path not in ("", "/") else "/metrics"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def _entries(text: str) -> list[tuple[str, str]]:
    out = []
    for raw in text.replace("\n", ";").split(";"):
        item = raw.strip()
        if not item:
            continue
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise ValueError(f"expected name=value, got {item!r}")
        out.append((check_token(name.strip(), "worker id"), value.strip()))
    return out


def parse_targets(text: str) -> dict[str, Target]:
    """``"id=url[@engine]; ..."`` -> static targets (clear ValueError on bad input)."""
    out: dict[str, Target] = {}
    for wid, value in _entries(text):
        engine = None
        url = value
        if "@" in value:
            head, _, tail = value.rpartition("@")
            if tail in ENGINES:
                url, engine = head, tail
            elif "/" not in tail:
                raise ValueError(f"target {wid}: unknown engine {tail!r}; use one of {ENGINES}")
        out[wid] = Target(worker_id=wid, url=metrics_url(url), engine=engine, static=True)
    return out


def parse_gpu_map(text: str) -> dict[str, tuple[int, ...]]:
    """``"worker-a=0,1; worker-b=2"`` -> {worker: gpu indices}."""
    out: dict[str, tuple[int, ...]] = {}
    for wid, value in _entries(text):
        try:
            out[wid] = tuple(int(x) for x in value.replace(" ", "").split(",") if x)
        except ValueError:
            raise ValueError(
                f"gpu map for {wid}: expected GPU indices like 0,1, got {value!r}"
            ) from None
        if any(i < 0 for i in out[wid]):
            raise ValueError(f"gpu map for {wid}: negative GPU index")
    return out


def parse_pid_map(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for wid, value in _entries(text):
        try:
            out[wid] = int(value)
        except ValueError:
            raise ValueError(f"pid map for {wid}: expected a process id, got {value!r}") from None
    return out


@dataclass
class GpuAssignment:
    """GPU index -> workers it serves (a GPU may serve several small workers)."""

    by_gpu: dict[int, list[str]] = field(default_factory=dict)
    # worker -> its GPU indices, sorted (built on first use; by_gpu is not changed after)
    _by_worker: dict[str, list[int]] | None = field(default=None, repr=False, compare=False)

    def workers_of(self, gpu: int) -> list[str]:
        return self.by_gpu.get(gpu, [])

    def gpus_of(self, worker: str) -> list[int]:
        if self._by_worker is None:
            by: dict[str, list[int]] = {}
            for g in sorted(self.by_gpu):
                for w in self.by_gpu[g]:
                    by.setdefault(w, []).append(g)
            self._by_worker = by
        return self._by_worker.get(worker, [])


def assign_gpus(
    workers: list[str],
    gpu_map: dict[str, tuple[int, ...]],
    worker_pids: dict[str, set[int]],
    gpu_pids: dict[int, set[int]],
) -> GpuAssignment:
    """Configured map first; for other workers, GPUs where one of their pids runs."""
    a = GpuAssignment()
    for w in workers:
        if w in gpu_map:
            for g in gpu_map[w]:
                a.by_gpu.setdefault(g, []).append(w)
            continue
        pids = worker_pids.get(w)
        if not pids:
            continue
        for g, running in gpu_pids.items():
            if pids & running:
                a.by_gpu.setdefault(g, []).append(w)
    return a
