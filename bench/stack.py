"""Real processes for ``kvgate bench``: an embedded NATS, then per run a fresh set of simulated
workers (fresh KV caches), the kv_indexer and the kvgate router with one policy, or an external
router (sglang-router / vllm-router) started against the same workers.

Each run gets its own NATS subject prefix, so nothing of an earlier run (KV events, index,
heartbeats) leaks into the next. Children log to ``<results>/logs/<run>-<child>.log``, die
with this process (PR_SET_PDEATHSIG) and are stopped with SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.embedded import EmbeddedNats, env_without_proxy, free_port, port_open

EXTERNAL_ROUTERS = ("sglang-router", "vllm-router")


def cache_aware_router_argv(
    launcher: list[str], port: int, worker_urls: list[str], metrics_port: int
) -> list[str]:
    """Command line of sglang-router or vllm-router (a fork: the same flags) with policy
    cache_aware on 127.0.0.1:``port``, Prometheus metrics on ``metrics_port``."""
    return [
        *launcher,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        "cache_aware",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
    ]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def http_json(url: str, timeout: float = 1.0) -> Any | None:
    """GET ``url``: parsed JSON ({} for a non-JSON 200), or None when not answering 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - local URL
            if resp.status != 200:
                return None
            body = resp.read()
    except (urllib.error.URLError, OSError, ValueError):
        return None
    try:
        return json.loads(body)
    except ValueError:
        return {}


def wait_until(
    what: str, cond: Callable[[], bool], timeout: float, procs: list[Proc] | None = None
) -> None:
    """Poll ``cond`` (no event exists for "a child process is ready") until true or timeout;
    fail early, naming the log, when one of ``procs`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        for p in procs or ():
            if p.popen is not None and p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode}; see {p.log_path}")
        time.sleep(0.1)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def consecutive_free_ports(n: int, host: str = "127.0.0.1", tries: int = 50) -> int:
    """A base port with ``n`` free ports after it (checked, not reserved)."""
    for _ in range(tries):
        base = free_port(host)
        if base + n >= 65535:
            continue
        if all(not port_open(host, base + i, 0.05) for i in range(n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports found")


@dataclass
class Proc:
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen | None = None

    def start(self, env: dict[str, str]) -> Proc:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.popen = subprocess.Popen(
                self.argv,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
                start_new_session=True,
            )
        return self

    def stop(self, grace: float = 8.0) -> None:
        p = self.popen
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@dataclass
class Workers:
    """A sim-worker process serving ``count`` workers on consecutive ports."""

    ids: list[str]
    urls: list[str]

    @property
    def by_id(self) -> dict[str, str]:
        return dict(zip(self.ids, self.urls, strict=True))


@dataclass
class BenchStack:
    """Owns the embedded NATS and the children of the current run."""

    workdir: Path
    num_workers: int
    sim_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    nats_url: str = ""
    ready_timeout: float = 90.0
    log_level: str = "warning"
    telemetry_interval: float = 0.1  # <= 0: no telemetry agent (router sees no engine load)
    _nats: EmbeddedNats | None = None
    _procs: list[Proc] = field(default_factory=list)
    _runs: int = 0

    @property
    def py(self) -> list[str]:
        return [sys.executable, "-m", "services.cli"]

    def start(self) -> None:
        if not self.nats_url:
            self._nats = EmbeddedNats(self.workdir / "nats")
            self.nats_url = self._nats.start()

    def close(self) -> None:
        self.stop_run()
        if self._nats is not None:
            self._nats.stop()
            self._nats = None
            shutil.rmtree(self.workdir / "nats", ignore_errors=True)

    def stop_run(self) -> None:
        for p in reversed(self._procs):
            p.stop()
        self._procs.clear()

    def _env(self, prefix: str) -> dict[str, str]:
        env = env_without_proxy()
        env.update(
            {
                "KVGATE_NATS_URL": self.nats_url,
                "KVGATE_SUBJECT_PREFIX": prefix,
                "KVGATE_LOG_LEVEL": self.log_level,
                "KVGATE_LOG_FORMAT": "json",
                "PYTHONUNBUFFERED": "1",
            }
        )
        return env

    def _spawn(self, run: str, name: str, argv: list[str], env: dict[str, str]) -> Proc:
        p = Proc(f"{run}-{name}", argv, self.workdir / "logs" / f"{run}-{name}.log").start(env)
        self._procs.append(p)
        return p

    # ------------------------------------------------------------------ one run
    def start_workers(self, run: str, attempts: int = 2) -> tuple[str, Workers]:
        """Fresh workers (empty caches) in their own subject namespace (one retry on new ports
        when they fail to come up)."""
        for i in range(attempts):
            try:
                return self._start_workers(run)
            except RuntimeError:
                self.stop_run()
                if i + 1 == attempts:
                    raise
        raise AssertionError("unreachable")

    def _start_workers(self, run: str) -> tuple[str, Workers]:
        self._runs += 1
        prefix = f"bench{self._runs}x{uuid.uuid4().hex[:8]}"
        env = self._env(prefix)
        base = consecutive_free_ports(self.num_workers)
        argv = self.py + [
            "sim-worker",
            "--count",
            str(self.num_workers),
            "--port",
            str(base),
            "--worker-id",
            "w",
            *self.sim_args,
        ]
        p = self._spawn(run, "workers", argv, env)
        urls = [f"http://127.0.0.1:{base + i}" for i in range(self.num_workers)]
        wait_until(
            "simulated workers",
            lambda: all(http_json(u + "/health") is not None for u in urls),
            self.ready_timeout,
            [p],
        )
        ids = []
        for u in urls:
            h = http_json(u + "/health") or {}
            ids.append(str(h.get("worker_id") or u))
        return prefix, Workers(ids, urls)

    def start_kvgate(self, run: str, prefix: str, policy: dict[str, Any]) -> str:
        """kv_indexer + kvgate router with ``policy``; returns the router's base URL."""
        env = self._env(prefix)
        iport, rport = free_port(), free_port()
        pi = self._spawn(run, "indexer", self.py + ["indexer", "--port", str(iport)], env)
        waits = [(f"http://127.0.0.1:{iport}/health", "kv_indexer", pi)]
        if self.telemetry_interval > 0:
            tport = free_port()
            argv = self.py + ["telemetry", "--port", str(tport)]
            argv += ["--interval", str(self.telemetry_interval)]
            pt = self._spawn(run, "telemetry", argv, env)
            waits.append((f"http://127.0.0.1:{tport}/health", "telemetry", pt))
        pol = json.dumps(policy) if policy.get("params") else policy["name"]
        argv = self.py + ["router", "--port", str(rport), "--policy", pol]
        pr = self._spawn(run, "router", argv + self.router_args, env)
        base = f"http://127.0.0.1:{rport}"
        for url, what, proc in waits:
            wait_until(what, lambda url=url: http_json(url) is not None, self.ready_timeout, [proc])

        def router_ready() -> bool:
            h = http_json(base + "/health")
            return isinstance(h, dict) and int(h.get("workers", 0)) >= self.num_workers

        wait_until(
            f"router with {self.num_workers} workers", router_ready, self.ready_timeout, [pr]
        )
        return base

    def start_external(self, run: str, prefix: str, kind: str, workers: Workers) -> str:
        """sglang-router or vllm-router (policy cache_aware) against ``workers``."""
        env = self._env(prefix)
        port, mport = free_port(), free_port()
        if kind == "sglang-router":
            launcher = [sys.executable, "-m", "sglang_router.launch_router"]
        elif kind == "vllm-router":
            launcher = [
                shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
            ]
        else:
            raise ValueError(f"unknown external router {kind!r}; choose from {EXTERNAL_ROUTERS}")
        argv = cache_aware_router_argv(launcher, port, workers.urls, mport)
        p = self._spawn(run, kind, argv, env)
        base = f"http://127.0.0.1:{port}"
        wait_until(
            kind, lambda: http_json(base + "/health", 2.0) is not None, self.ready_timeout, [p]
        )
        return base


def external_available(kind: str) -> bool:
    """Whether an external router can be started from this environment."""
    if kind == "sglang-router":
        import importlib.util

        return importlib.util.find_spec("sglang_router") is not None
    if kind == "vllm-router":
        return (
            bool(shutil.which("vllm-router"))
            or (Path(sys.executable).parent / "vllm-router").is_file()
        )
    return False
