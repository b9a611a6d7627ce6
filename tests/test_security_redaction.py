"""Secrets never reach an output: URLs are redacted in logs, errors and debug views.

The services run as a user starts them (subprocesses, debug logging) against a real nats-server
that requires a token or a password, with the secret given in the NATS URL and as options; their
whole output, their /debug and /metrics pages, and the errors of a wrong credential are searched
for the secret.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.embedded import EmbeddedNats, env_without_proxy, free_port, wait_port
from services.common.redact import redact_text, redact_url

TOKEN = "T0kenS3cretXyz"
PASSWORD = "Pa55S3cretXyz"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("nats://u:pw@127.0.0.1:4222", "nats://u:***@127.0.0.1:4222"),
        ("nats://tok@h:4222,nats://u:p@h2:4222", "nats://***@h:4222,nats://u:***@h2:4222"),
        ("tls://h:4222", "tls://h:4222"),
        (
            "postgresql+asyncpg://kvgate:pw@db:5432/kvgate?host=/s&password=x",
            "postgresql+asyncpg://kvgate:***@db:5432/kvgate?host=/s&password=***",
        ),
        ("", ""),
    ],
)
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected


def test_redact_text_masks_every_url_in_a_message() -> None:
    text = "cannot reach nats://u:pw1@h:1 (then postgresql://a:pw2@db/x?password=pw3): refused"
    masked = redact_text(text)
    assert all(s not in masked for s in ("pw1", "pw2", "pw3")), masked
    assert "nats://u:***@h:1" in masked


class Service:
    """A kvgate service subprocess whose combined output is collected line by line."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for(self, needle: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.output.append(line)
            if needle in line:
                return
        raise AssertionError(f"{needle!r} not seen:\n{''.join(self.output)[-3000:]}")

    def stop(self) -> str:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        while not self.lines.empty():
            self.output.append(self.lines.get())
        return "".join(self.output)


@pytest.fixture
def token_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    srv = EmbeddedNats(tmp_path / "nats", authorization=f'authorization {{ token: "{TOKEN}" }}')
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def password_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    conf = f'authorization {{ user: "svc", password: "{PASSWORD}" }}'
    srv = EmbeddedNats(tmp_path / "nats2", authorization=conf)
    srv.start()
    yield srv
    srv.stop()


def _env(**extra: str) -> dict[str, str]:
    env = env_without_proxy()
    env.update(
        KVGATE_LOG_LEVEL="debug",
        KVGATE_LOG_FORMAT="json",
        KVGATE_SUBJECT_PREFIX=f"red{os.getpid()}",
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - local URL
        return resp.read().decode(errors="replace")


def test_services_never_print_the_nats_secret(
    token_server: EmbeddedNats, password_server: EmbeddedNats
) -> None:
    indexer_port, router_port = free_port(), free_port()
    token_url = token_server.url.replace("nats://", f"nats://{TOKEN}@")
    password_url = password_server.url.replace("nats://", f"nats://svc:{PASSWORD}@")
    indexer = Service(["indexer", "--port", str(indexer_port)], _env(KVGATE_NATS_URL=token_url))
    router = Service(
        ["router", "--port", str(router_port)],
        _env(
            KVGATE_NATS_URL=password_server.url,
            KVGATE_NATS_USER="svc",
            KVGATE_NATS_PASSWORD=PASSWORD,
        ),
    )
    # a wrong secret: the errors name the server and the refusal, never the secret
    wrong = Service(
        ["indexer", "--port", str(free_port())],
        _env(KVGATE_NATS_URL=password_url.replace(PASSWORD, PASSWORD + "Wrong")),
    )
    outputs: dict[str, str] = {}
    try:
        indexer.wait_for("bus connected")
        router.wait_for("bus connected")
        wrong.wait_for("Authorization Violation")
        wait_port("127.0.0.1", indexer_port, 30)
        wait_port("127.0.0.1", router_port, 30)
        outputs["indexer /debug/workers"] = _get(f"http://127.0.0.1:{indexer_port}/debug/workers")
        outputs["indexer /metrics"] = _get(f"http://127.0.0.1:{indexer_port}/metrics")
        outputs["router /debug/state"] = _get(f"http://127.0.0.1:{router_port}/debug/state")
        outputs["router /metrics"] = _get(f"http://127.0.0.1:{router_port}/metrics")
    finally:
        outputs["indexer"] = indexer.stop()
        outputs["router"] = router.stop()
        outputs["wrong"] = wrong.stop()
    assert "nats://***@127.0.0.1" in outputs["indexer"]  # the URL is shown, redacted
    for name, text in outputs.items():
        assert TOKEN not in text, f"token in {name}"
        assert PASSWORD not in text, f"password in {name}"
