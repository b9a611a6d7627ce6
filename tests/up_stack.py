"""One `kvgate up` process for end-to-end tests, the way a user runs it.

:class:`UpStack` starts ``python -m services.cli up`` on free ports (every one, the operator
port too: the defaults may be another stack's on a shared machine), reads its output until the
banner, and stops it with a signal. On a start that fails it raises with the banner and the
tail of every service's log, so the failing service says why. Shared by the tests of
`kvgate up` itself, the operator page, the NATS cluster and the fault tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from services.common import stackfile
from services.common.embedded import env_without_proxy, free_port

PORT_FLAGS = ("router", "router-operator", "api", "indexer", "telemetry", "sim")


def up_env() -> dict[str, str]:
    """The test's environment without proxies and without what would point `kvgate up` (or
    the commands that find its stack) at another stack: admin token, NATS and database URLs."""
    env = env_without_proxy()
    for var in (
        "KVGATE_API_ADMIN_TOKEN",
        "KVGATE_NATS_URL",
        "KVGATE_DATABASE_URL",
        "KVGATE_ROUTER_API_KEYS",
    ):
        env.pop(var, None)
    return env


class UpStack:
    """One `kvgate up` process with free ports; :meth:`banner` waits until it is up."""

    def __init__(
        self,
        state: Path,
        *,
        workers: int = 1,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        indexers: int = 1,
    ) -> None:
        self.state = state
        self.ports = {k: free_port() for k in PORT_FLAGS}
        if indexers > 1:  # the group listens on --indexer-port, +1, ...: keep the next free
            while not all(_free(self.ports["indexer"] + i) for i in range(indexers)):
                self.ports["indexer"] = free_port()
        argv = [sys.executable, "-m", "services.cli", "up", "--workers", str(workers)]
        argv += ["--state-dir", str(state)]
        if indexers > 1:
            argv += ["--indexers", str(indexers)]
        for k, p in self.ports.items():
            argv += [f"--{k}-port", str(p)]
        self.proc = subprocess.Popen(
            [*argv, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**up_env(), **(env or {})},
        )
        self.lines: list[str] = []
        self.client_key = ""  # the router's client API key (kvgate up makes one): after banner()

    def url(self, name: str, path: str = "") -> str:
        return f"http://127.0.0.1:{self.ports[name]}{path}"

    def banner(self, timeout: float = 150) -> str:
        """The output up to "Press Ctrl-C to stop"; fails with the services' logs if the
        stack does not come up."""
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if "Press Ctrl-C to stop" in line:
                break
        out = "".join(self.lines)
        if "kvgate is up" not in out:
            logs = sorted((self.state / "logs").glob("*.log"))
            tails = "".join(f"\n--- {f.name}\n" + f.read_text()[-2000:] for f in logs)
            raise AssertionError(out + tails)
        self.client_key = stackfile.read_client_key(self.state) or ""
        return out

    def auth(self) -> dict[str, str]:
        """The header a client of the stack's OpenAI endpoint sends."""
        return {"Authorization": f"Bearer {self.client_key}"} if self.client_key else {}

    def stop(self, sig: signal.Signals = signal.SIGINT) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def rest_of_output(self) -> str:
        """Everything printed (after :meth:`stop`)."""
        rest = self.proc.stdout.read() if self.proc.stdout else ""
        return "".join(self.lines) + (rest or "")


def _free(port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def processes_mentioning(needle: str) -> list[str]:
    """Live processes (zombies left out) whose command line contains ``needle``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            continue
        cmd = raw.replace(b"\0", b" ").decode(errors="replace")
        if needle in cmd:
            found.append(f"{pid}: {cmd}")
    return found


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone: it has exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
