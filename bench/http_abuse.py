"""Abusive HTTP clients against a real ``kvgate router`` process (issue 35): what they cost it
in memory and how long they hold its connections.

A router (private embedded NATS, no workers, loopback only) gets, one phase after another:

- ``header-bomb``: ``--bomb-conns`` connections each sending one header of ``--bomb-mib`` MiB;
- ``many-headers``: ``--bomb-conns`` connections each sending 200 headers of 8 KiB;
- ``slowloris``: ``--slow-conns`` connections each sending a request line, then one header
  byte a second, never ending the head.

Printed per phase: the answers the clients got, how many bytes each managed to send before
the router answered or closed, the router's resident memory (VmRSS) before the phase, its
peak during it (VmHWM, reset before each phase) and after it (``--settle-s`` later), and for
slowloris how many connections were still open ``--slow-s`` seconds in (the router's header
timeout is 10 s by default). The router's ``kvgate_router_http_rejected_total`` at the end.

    python -m bench.http_abuse                          # ~40 s
    python -m bench.http_abuse --router-cwd /tmp/old    # the same against another checkout
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.bench_body_limit import _rss_kib
from services.common.embedded import EmbeddedNats, env_without_proxy, free_port

MIB = 1 << 20
HOST = "127.0.0.1"  # loopback only: nothing here leaves the machine


def _reset_peak(pid: int) -> None:
    """Reset the process's VmHWM to its current RSS (Linux >= 4.0; the router is our child)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def _mib(kib: int) -> float:
    return kib / 1024


@dataclass
class Outcome:
    status: int | None = None  # the HTTP status answered, None: closed without an answer
    sent: int = 0  # bytes the client wrote before the answer or the close
    closed_after_s: float | None = None  # when the router closed the connection
    error: str = ""


@dataclass
class Phase:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    rss_before_mib: float = 0.0
    rss_peak_mib: float = 0.0
    rss_after_mib: float = 0.0
    seconds: float = 0.0
    open_at_check: int | None = None  # slowloris: connections still open at --slow-s

    def summary(self) -> dict[str, Any]:
        statuses: dict[str, int] = {}
        for o in self.outcomes:
            key = str(o.status) if o.status is not None else "closed, no answer"
            statuses[key] = statuses.get(key, 0) + 1
        closed = sorted(o.closed_after_s for o in self.outcomes if o.closed_after_s is not None)
        return {
            "phase": self.name,
            "connections": len(self.outcomes),
            "answers": statuses,
            "max_sent_bytes": max((o.sent for o in self.outcomes), default=0),
            "closed_by_router": len(closed),
            "closed_after_s_max": round(closed[-1], 2) if closed else None,
            "open_at_check": self.open_at_check,
            "rss_before_mib": round(self.rss_before_mib, 1),
            "rss_peak_mib": round(self.rss_peak_mib, 1),
            "rss_after_mib": round(self.rss_after_mib, 1),
            "seconds": round(self.seconds, 1),
        }


async def _read_answer(reader: asyncio.StreamReader, out: Outcome, t0: float) -> None:
    """The status line of the router's answer (if any), then read until it closes."""
    try:
        line = await reader.readline()
        if line.startswith(b"HTTP/1.1 "):
            out.status = int(line.split()[1])
        while await reader.read(65536):
            pass
    except (ConnectionError, ValueError):
        pass
    out.closed_after_s = time.monotonic() - t0


async def _bomb_one(port: int, head: bytes, body: bytes, budget_s: float) -> Outcome:
    """Send ``head`` then ``body`` (64 KiB writes) while reading; stop at the router's answer."""
    out = Outcome()
    t0 = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection(HOST, port)
    except OSError as exc:
        out.error = repr(exc)
        return out
    answered = asyncio.create_task(_read_answer(reader, out, t0))
    try:
        writer.write(head)
        out.sent = len(head)
        view = memoryview(body)
        for i in range(0, len(body), 65536):
            if answered.done() or out.status is not None:
                break
            writer.write(view[i : i + 65536])
            await writer.drain()
            out.sent += min(65536, len(body) - i)
        await asyncio.wait_for(asyncio.shield(answered), budget_s)
    except (ConnectionError, TimeoutError) as exc:
        out.error = type(exc).__name__
    finally:
        answered.cancel()
        writer.close()
    return out


async def _slow_one(port: int, hold_s: float, t0: float) -> Outcome:
    """A request line, then one header byte a second until the router closes or ``hold_s``."""
    out = Outcome()
    try:
        reader, writer = await asyncio.open_connection(HOST, port)
    except OSError as exc:
        out.error = repr(exc)
        return out
    answered = asyncio.create_task(_read_answer(reader, out, t0))
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: r\r\nX-Slow: ")
        out.sent = 40
        while not answered.done() and time.monotonic() - t0 < hold_s:
            await asyncio.wait({answered}, timeout=1.0)
            if not answered.done():
                writer.write(b"z")
                out.sent += 1
    except ConnectionError as exc:
        out.error = type(exc).__name__
    finally:
        if not answered.done():
            answered.cancel()
        writer.close()
    return out


def _answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:  # noqa: S310 - loopback
            return r.status == 200
    except OSError:
        return False


class RouterUnderTest:
    def __init__(self, nats_url: str, cwd: str, extra: list[str]) -> None:
        self.port = free_port()
        self.operator_port = free_port()
        argv = [
            sys.executable, "-m", "services.cli", "router", "--host", HOST,
            "--port", str(self.port), "--operator-port", str(self.operator_port),
            "--nats-url", nats_url, "--subject-prefix", f"benchabuse{os.getpid()}",
            "--log-level", "error", *extra,
        ]  # fmt: skip
        env = env_without_proxy()
        env["PYTHONPATH"] = cwd
        self.proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )

    async def ready(self, timeout: float) -> None:
        url = f"http://{HOST}:{self.port}/health"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"the router exited: {err[-2000:]}")
            if await asyncio.to_thread(_answers_200, url):
                return
            await asyncio.sleep(0.1)
        raise TimeoutError("the router did not answer /health")

    def rss_kib(self) -> int:
        return _rss_kib(self.proc.pid, "VmRSS")

    def rejected(self) -> dict[str, float]:
        url = f"http://{HOST}:{self.operator_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - loopback
                text = r.read().decode()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            if line.startswith("kvgate_router_http_rejected_total{"):
                reason = line.split('reason="', 1)[1].split('"', 1)[0]
                out[reason] = float(line.rsplit(" ", 1)[1])
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


async def _phase(router: RouterUnderTest, name: str, run: Any, settle_s: float, log: Any) -> Phase:
    phase = Phase(name)
    phase.rss_before_mib = _mib(router.rss_kib())
    _reset_peak(router.proc.pid)
    log(f"{name}: starting (router RSS {phase.rss_before_mib:.1f} MiB)")
    t0 = time.monotonic()
    phase.outcomes = await run(phase)
    phase.seconds = time.monotonic() - t0
    phase.rss_peak_mib = _mib(_rss_kib(router.proc.pid, "VmHWM"))
    await asyncio.sleep(settle_s)  # what the router keeps once the clients are gone
    phase.rss_after_mib = _mib(router.rss_kib())
    s = phase.summary()
    log(
        f"{name}: {s['connections']} connections, answers {s['answers']}, at most "
        f"{s['max_sent_bytes']:,} bytes sent each, closed by the router {s['closed_by_router']} "
        f"(last after {s['closed_after_s_max']} s)"
        + (f", still open at the check {s['open_at_check']}" if name == "slowloris" else "")
        + f"; RSS before {s['rss_before_mib']} / peak {s['rss_peak_mib']} / after "
        f"{s['rss_after_mib']} MiB ({s['seconds']} s)"
    )
    return phase


async def run(a: argparse.Namespace) -> dict[str, Any]:
    def log(msg: str) -> None:
        print(f"[{time.monotonic() - started:5.1f}s] {msg}", flush=True)

    started = time.monotonic()
    state = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvgate-bench-abuse-{os.getpid()}"
    nats = EmbeddedNats(state / "nats")
    nats.start()
    router: RouterUnderTest | None = None
    results: dict[str, Any] = {"args": vars(a), "phases": []}
    try:
        await _provision(nats.url, f"benchabuse{os.getpid()}")
        router = RouterUnderTest(nats.url, a.router_cwd, a.router_arg or [])
        await router.ready(60)
        await asyncio.sleep(1.0)  # start-up allocations settle before the idle reading
        results["rss_idle_mib"] = round(_mib(router.rss_kib()), 1)
        log(f"router up on {HOST}:{router.port}, RSS {results['rss_idle_mib']} MiB")
        port = router.port
        budget = a.phase_budget_s

        async def bomb(phase: Phase) -> list[Outcome]:
            head = b"GET /health HTTP/1.1\r\nHost: r\r\nX-Bomb: "
            body = b"a" * (a.bomb_mib * MIB) + b"\r\n\r\n"
            return list(
                await asyncio.gather(
                    *(_bomb_one(port, head, body, budget) for _ in range(a.bomb_conns))
                )
            )

        async def many(phase: Phase) -> list[Outcome]:
            head = b"GET /health HTTP/1.1\r\nHost: r\r\n"
            body = b"".join(b"X-H%d: %s\r\n" % (i, b"m" * 8192) for i in range(200)) + b"\r\n"
            return list(
                await asyncio.gather(
                    *(_bomb_one(port, head, body, budget) for _ in range(a.bomb_conns))
                )
            )

        async def slow(phase: Phase) -> list[Outcome]:
            t0 = time.monotonic()
            tasks = [
                asyncio.create_task(_slow_one(port, a.slow_s + 1.0, t0))
                for _ in range(a.slow_conns)
            ]
            await asyncio.wait(tasks, timeout=a.slow_s)
            phase.open_at_check = sum(not t.done() for t in tasks)
            return list(await asyncio.gather(*tasks))

        for name, fn in (("header-bomb", bomb), ("many-headers", many), ("slowloris", slow)):
            phase = await _phase(router, name, fn, a.settle_s, log)
            results["phases"].append(phase.summary())
        results["rss_end_mib"] = round(_mib(router.rss_kib()), 1)
        results["rejected"] = router.rejected()
        log(f"router RSS at the end {results['rss_end_mib']} MiB; rejected {results['rejected']}")
    finally:
        if router is not None:
            router.stop()
        nats.stop()
    log("done")
    return results


async def _provision(nats_url: str, prefix: str) -> None:
    """The streams a router expects (as ``kvgate bus provision`` makes them), so it starts
    without waiting for them."""
    try:
        from services.common.bus import Bus
        from services.common.streams import provision
        from services.common.subjects import Subjects
    except ImportError:  # a checkout without provisioning: its router creates them itself
        return
    bus = Bus(nats_url, "bench-abuse", Subjects(prefix))
    await bus.connect(max_wait_s=10)
    try:
        await provision(bus)
    finally:
        await bus.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.http_abuse",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--bomb-conns", type=int, default=4, help="connections per bomb phase")
    ap.add_argument("--bomb-mib", type=int, default=64, help="size of the one huge header")
    ap.add_argument("--slow-conns", type=int, default=200, help="slowloris connections")
    ap.add_argument(
        "--slow-s", type=float, default=15.0, help="when to count the open slowloris ones"
    )
    ap.add_argument("--settle-s", type=float, default=3.0, help="wait before the after-RSS")
    ap.add_argument("--phase-budget-s", type=float, default=20.0, help="bound of a bomb phase")
    ap.add_argument("--router-cwd", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument(
        "--router-arg", action="append", help="extra router flag (repeat), e.g. --router-arg=-v"
    )
    ap.add_argument("--json", default="", help="also write the results here")
    a = ap.parse_args(argv)
    results = asyncio.run(run(a))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
