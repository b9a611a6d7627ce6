"""`kvgate up`'s state file: an admin token on first start, the other commands find the stack,
a second `kvgate up` refuses, SIGHUP stops everything, and a dead run's leftovers (nats-server,
Postgres) are stopped by the next start."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from services.common import stackfile
from services.common.embedded import env_without_proxy, free_port

pytestmark = pytest.mark.slow


async def _raise_alert(nats_url: str, prefix: str, state: Path) -> None:
    from services.common.bus import Bus, NatsAuth
    from services.common.schemas import Alert
    from services.common.streams import ensure_alert_streams, raise_alert
    from services.common.subjects import Subjects

    # as the telemetry agent would: with the telemetry user `kvgate up` generated
    passwords = json.loads((state / "nats" / "passwords.json").read_text())
    auth = NatsAuth(user="telemetry", password=passwords["telemetry"])
    bus = Bus(nats_url, "test-up-state", Subjects(prefix), auth=auth, role="telemetry")
    await bus.connect(max_wait_s=10)
    try:
        await ensure_alert_streams(bus)
        await raise_alert(
            bus,
            Alert(
                fingerprint="kv_starved:up-state-test",
                kind="kv_starved",
                severity="warning",
                source="telemetry",
                worker_id="up-state-test",
                summary="up-state-test alert",
            ),
        )
    finally:
        await bus.close()


def _processes_mentioning(needle: str) -> list[str]:
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


def _pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _env() -> dict[str, str]:
    env = env_without_proxy()
    env.pop("KVGATE_API_ADMIN_TOKEN", None)
    env.pop("KVGATE_NATS_URL", None)
    env.pop("KVGATE_DATABASE_URL", None)
    return env


class Up:
    """One `kvgate up` process with free ports, read until its banner."""

    def __init__(self, state: Path) -> None:
        self.state = state
        # every port a free one, the operator port too (8084 may be another stack's here)
        names = ("router", "router-operator", "api", "indexer", "telemetry", "sim")
        self.ports = {k: free_port() for k in names}
        argv = [sys.executable, "-m", "services.cli", "up", "--workers", "1"]
        argv += ["--state-dir", str(state)]
        for k, p in self.ports.items():
            argv += [f"--{k}-port", str(p)]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env()
        )
        self.lines: list[str] = []

    def banner(self, timeout: float = 150) -> str:
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
        assert "kvgate is up" in out, out
        return out

    def stop(self, sig: signal.Signals = signal.SIGINT) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def _cli(*args: str, state: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args, "--state-dir", str(state)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
        cwd=state.parent,  # not the repo: the default ./.kvgate must not be what is found
    )


def test_state_file_token_status_second_up_and_sighup(tmp_path: Path) -> None:
    state = tmp_path / "state"
    up = Up(state)
    try:
        out = up.banner()
        token_line = next(ln for ln in out.splitlines() if "admin token" in ln)
        token = token_line.split(":", 1)[1].split()[0]
        assert token.startswith("kvg_"), token_line
        assert f"http://127.0.0.1:{up.ports['indexer']}/metrics" in out
        assert f"http://127.0.0.1:{up.ports['telemetry']}/metrics" in out

        data = json.loads((state / "stack.json").read_text())
        assert data["pid"] == up.proc.pid
        assert data["ports"]["router"] == up.ports["router"]
        assert data["nats_url"].startswith("nats://127.0.0.1:")
        assert _pid_alive(data["pids"]["nats-server"]) and _pid_alive(data["pids"]["postgres"])
        assert (state / "admin-token").stat().st_mode & 0o077 == 0

        # the printed token is an admin on the admin API
        req = urllib.request.Request(
            f"http://127.0.0.1:{up.ports['api']}/api/v1/tokens",
            headers={"Authorization": f"Bearer {token}"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200

        status = _cli("status", state=state)
        assert status.returncode == 0, status.stdout + status.stderr
        assert f"http://127.0.0.1:{up.ports['router']}" in status.stdout

        # `kvgate api token create` finds the embedded database by itself
        created = _cli("api", "token", "create", "--role", "viewer", "--name", "t", state=state)
        assert created.returncode == 0, created.stderr
        assert created.stdout.strip().startswith("kvg_")

        # `kvgate alerts tail` finds the embedded NATS (a random port) by itself
        asyncio.run(_raise_alert(data["nats_url"], data["subject_prefix"], state))
        tail = _cli("alerts", "tail", "--since", "10m", "--count", "1", state=state)
        assert tail.returncode == 0, tail.stderr
        assert "FIRING" in tail.stdout and "up-state-test" in tail.stdout
        # `kvgate index verify` too, logging in with the stack's operator credential
        # (<state>/nats/passwords.json): NATS authorization is on under `kvgate up`
        verify = _cli("index", "verify", "--json", state=state)
        assert verify.returncode == 0, verify.stdout + verify.stderr
        workers = json.loads(verify.stdout)["workers"]
        assert [(w["worker_id"], w["status"]) for w in workers] == [("sim", "equal")], workers

        # a second `kvgate up` on the same state dir refuses
        second = subprocess.run(
            [sys.executable, "-m", "services.cli", "up", "--state-dir", str(state)],
            capture_output=True,
            text=True,
            timeout=60,
            env=_env(),
        )
        assert second.returncode == 1
        assert "another 'kvgate up'" in second.stderr and str(up.proc.pid) in second.stderr
        assert up.proc.poll() is None
    finally:
        rc = up.stop(signal.SIGHUP)  # the terminal was closed
    assert rc == 0, "".join(up.lines)
    assert _processes_mentioning(str(state)) == []
    assert not (state / "stack.json").exists()
    assert _cli("status", state=state).returncode == 3

    # the token is kept across restarts and not printed again
    again = Up(state)
    try:
        out = again.banner()
        assert token not in out and f"in {state / 'admin-token'}" in out
    finally:
        again.stop()


def test_next_up_stops_a_dead_runs_leftovers(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = Up(state)
    try:
        first.banner()
        pids = stackfile.read_state(state).pids
    finally:
        first.proc.kill()  # no chance to clean up
        first.proc.wait(30)
    nats_pid, pg_pid = pids["nats-server"], pids["postgres"]
    assert _pid_alive(nats_pid) and _pid_alive(pg_pid)  # what the old code left behind
    status = _cli("status", state=state)
    assert status.returncode == 3 and "died" in status.stdout

    second = Up(state)
    try:
        out = second.banner()
        assert "stopped leftovers of a previous run" in out
        assert not _pid_alive(nats_pid) and not _pid_alive(pg_pid)
    finally:
        rc = second.stop()
    assert rc == 0, "".join(second.lines)
    assert _processes_mentioning(str(state)) == []
