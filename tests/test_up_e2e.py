"""`kvgate up` as a user runs it: embedded NATS and Postgres, a chat completion through the
router with the official openai client, then Ctrl-C leaves no process behind.

NATS authorization is on by default (one generated user per role): the completion going
through proves every service works within its role's permissions, and no service's log shows a
permission it was refused or any of the generated passwords."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from services.common.embedded import free_port

pytestmark = pytest.mark.slow


def _processes_mentioning(needle: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = (
                Path(f"/proc/{pid}/cmdline")
                .read_bytes()
                .replace(b"\0", b" ")
                .decode(errors="replace")
            )
        except OSError:
            continue
        if needle in cmd:
            found.append(f"{pid}: {cmd}")
    return found


def test_kvgate_up_serves_a_chat_completion_and_stops_cleanly(tmp_path: Path) -> None:
    import openai

    router, api, indexer, telemetry, sim, operator = (free_port() for _ in range(6))
    state = tmp_path / "state"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "up",
            "--workers",
            "2",
            "--state-dir",
            str(state),
            "--router-port",
            str(router),
            "--router-operator-port",
            str(operator),
            "--api-port",
            str(api),
            "--indexer-port",
            str(indexer),
            "--telemetry-port",
            str(telemetry),
            "--sim-port",
            str(sim),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Press Ctrl-C to stop" in line:
                break
        output = "".join(lines)
        assert "kvgate is up" in output, output
        assert f"http://127.0.0.1:{router}/v1" in output

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{router}/v1", api_key="unused")
        raw = client.chat.completions.with_raw_response.create(
            model="sim-llama-8b", messages=[{"role": "user", "content": "Say hello"}], max_tokens=8
        )
        completion = raw.parse()
        assert completion.choices[0].message.content
        assert raw.headers["x-kvgate-worker"].startswith("sim")
        # operator endpoints answer on the operator port only
        with urllib.request.urlopen(f"http://127.0.0.1:{operator}/metrics", timeout=5) as resp:
            assert b"kvgate_router" in resp.read()
        with pytest.raises(urllib.error.HTTPError) as public:
            urllib.request.urlopen(f"http://127.0.0.1:{router}/debug/state", timeout=5)
        assert public.value.code == 404
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, "".join(lines) + (proc.stdout.read() if proc.stdout else "")
    passwords = json.loads((state / "nats" / "passwords.json").read_text())
    assert set(passwords) == {"worker", "telemetry", "indexer", "router", "api", "operator"}
    assert (state / "nats" / "passwords.json").stat().st_mode & 0o077 == 0
    outputs = {"banner": "".join(lines)} | {
        p.name: p.read_text(errors="replace") for p in (state / "logs").glob("*.log")
    }
    outputs["nats-server.log"] = (state / "nats" / "nats-server.log").read_text(errors="replace")
    for name, text in outputs.items():
        for role, secret in passwords.items():
            assert secret not in text, f"{role}'s NATS password in {name}"
        assert "permissions violation" not in text.lower(), f"{name}: {text[-3000:]}"
        assert "authorization violation" not in text.lower(), f"{name}: {text[-3000:]}"
    assert "bus connected" in outputs["router.log"]
    leftovers = _processes_mentioning(str(state)) + _processes_mentioning(f"--port {router}")
    leftovers += _processes_mentioning(f"--port {sim}")
    assert leftovers == [], leftovers
