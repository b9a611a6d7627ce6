"""`kvgate up` as a user runs it: embedded NATS and Postgres, a chat completion through the
router with the official openai client, then Ctrl-C leaves no process behind. The stack runs
the highly available indexer pair (`--indexers 2`): exactly one of them is active, and the
endpoint picker beside the router (`--epp-port`): a gRPC client playing Envoy gets a simulated
worker's endpoint from it, and `kvgate status` shows it.

NATS authorization is on by default (one generated user per role): the completion going
through proves every service works within its role's permissions, and no service's log shows a
permission it was refused or any of the generated passwords."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from services.common.embedded import free_port
from tests.up_stack import UpStack, processes_mentioning, up_env

pytestmark = pytest.mark.slow


def test_kvgate_up_serves_a_chat_completion_and_stops_cleanly(tmp_path: Path) -> None:
    import openai

    state = tmp_path / "state"
    epp, epp_operator = free_port(), free_port()
    up = UpStack(
        state,
        workers=2,
        indexers=2,
        args=["--epp-port", str(epp), "--epp-operator-port", str(epp_operator)],
    )
    router, operator, sim = (up.ports[k] for k in ("router", "router-operator", "sim"))
    try:
        output = up.banner(timeout=120)
        assert f"http://127.0.0.1:{router}/v1" in output
        assert f"endpoint picker : 127.0.0.1:{epp} " in output
        _check_epp_picks_a_sim_worker(epp, {f"127.0.0.1:{sim + i}" for i in range(2)})
        status = subprocess.run(
            [sys.executable, "-m", "services.cli", "status", "--json", "--state-dir", str(state)],
            capture_output=True,
            text=True,
            timeout=60,
            env=up_env(),
        )
        health = json.loads(status.stdout)["health"]
        assert health["epp"] == "ok" and health["epp-operator"] == "ok", status.stdout

        # the OpenAI endpoint wants the client key the banner printed (and nothing else)
        assert f"client API key  : {up.client_key}" in output and up.client_key
        anonymous = openai.OpenAI(base_url=f"http://127.0.0.1:{router}/v1", api_key="unused")
        with pytest.raises(openai.AuthenticationError):
            anonymous.models.list()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{router}/v1", api_key=up.client_key)
        raw = client.chat.completions.with_raw_response.create(
            model="sim-llama-8b", messages=[{"role": "user", "content": "Say hello"}], max_tokens=8
        )
        completion = raw.parse()
        assert completion.choices[0].message.content
        assert raw.headers["x-kvgate-worker"].startswith("sim")
        _check_children_hold_only_their_secrets(state, up.client_key)
        # operator endpoints answer on the operator port only
        with urllib.request.urlopen(f"http://127.0.0.1:{operator}/metrics", timeout=5) as resp:
            assert b"kvgate_router" in resp.read()
        with pytest.raises(urllib.error.HTTPError) as public:
            urllib.request.urlopen(f"http://127.0.0.1:{router}/debug/state", timeout=5)
        assert public.value.code == 404
        # the indexer pair: both up on consecutive ports, one holds the lease and publishes
        # (the lease is taken within a poll or two of the start: wait for it)
        deadline = time.monotonic() + 15
        while True:
            healths = []
            for port in (up.ports["indexer"], up.ports["indexer"] + 1):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    healths.append(json.loads(r.read()))
            if sorted(h["active"] for h in healths) == [False, True]:
                break
            assert time.monotonic() < deadline, healths
            time.sleep(0.1)
    finally:
        rc = up.stop()
    assert rc == 0, up.rest_of_output()
    passwords = json.loads((state / "nats" / "passwords.json").read_text())
    assert set(passwords) == {
        "worker-sim-0",
        "worker-sim-1",
        "telemetry",
        "indexer",
        "router",
        "api",
        "operator",
        "provisioner",
    }
    assert (state / "nats" / "passwords.json").stat().st_mode & 0o077 == 0
    outputs = {"banner": "".join(up.lines)} | {
        p.name: p.read_text(errors="replace") for p in (state / "logs").glob("*.log")
    }
    outputs["nats-server.log"] = (state / "nats" / "nats-server.log").read_text(errors="replace")
    for name, text in outputs.items():
        for role, secret in passwords.items():
            assert secret not in text, f"{role}'s NATS password in {name}"
        assert "permissions violation" not in text.lower(), f"{name}: {text[-3000:]}"
        assert "authorization violation" not in text.lower(), f"{name}: {text[-3000:]}"
    assert "bus connected" in outputs["router.log"]
    assert "epp listening" in outputs["epp.log"]
    assert "indexer lease acquired" in outputs["indexer-1.log"] + outputs["indexer-2.log"]
    leftovers = processes_mentioning(str(state)) + processes_mentioning(f"--port {router}")
    leftovers += processes_mentioning(f"--port {sim}") + processes_mentioning(f"--port {epp}")
    assert leftovers == [], leftovers


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(
        item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item
    )


def _check_children_hold_only_their_secrets(state: Path, client_key: str) -> None:
    """Every child of `kvgate up` has in its environment exactly the secrets its role uses
    (read from /proc/<pid>/environ): the admin token and the database URL only the api's; each
    NATS password only its own user's; the provisioner's and the client key nobody's."""
    stack = json.loads((state / "stack.json").read_text())
    passwords = json.loads((state / "nats" / "passwords.json").read_text())
    admin_token = (state / "admin-token").read_text().strip()
    own = {  # child -> the NATS users whose passwords it may hold
        "sim-workers": {"worker-sim-0", "worker-sim-1"},
        "indexer-1": {"indexer"},
        "indexer-2": {"indexer"},
        "telemetry": {"telemetry"},
        "api": {"api"},
        "router": {"router"},
        "epp": {"router"},  # it decides as a router does, on the router's subjects
    }
    assert set(own) <= set(stack["pids"]), stack["pids"]
    for child, users in own.items():
        env = _environ(stack["pids"][child])
        text = "\0".join(f"{k}={v}" for k, v in env.items())
        held = {user for user, pw in passwords.items() if pw in text}
        assert held == users, f"{child} holds the NATS passwords of {held}"
        assert client_key not in text, f"{child} holds the client key"
        assert (admin_token in text) == (child == "api"), f"{child}: admin token"
        assert ("KVGATE_DATABASE_URL" in env) == (child == "api"), f"{child}: database URL"
        assert ("KVGATE_SIGNING_SEED" in env) == (child == "api"), f"{child}: signing seed"
    sim = _environ(stack["pids"]["sim-workers"])
    assert "KVGATE_NATS_PASSWORD" not in sim  # no shared worker credential: one per worker


def _check_epp_picks_a_sim_worker(port: int, endpoints: set[str]) -> None:
    """The EPP becomes ready (gRPC health ``readiness``) and answers a request's headers and
    body, as Envoy sends them, with one of the stack's workers."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.test_epp import body_chunk, picked, request_headers

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 30
        while True:
            got = health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
            if got.status == health_pb2.HealthCheckResponse.SERVING:
                break
            assert time.monotonic() < deadline, "the EPP never became ready"
            time.sleep(0.1)
        body = json.dumps(
            {"model": "sim-llama-8b", "messages": [{"role": "user", "content": "hi"}]}
        ).encode()
        answers = list(
            pb_grpc.ExternalProcessorStub(channel).Process(
                iter([request_headers("/v1/chat/completions"), body_chunk(body, True)]), timeout=10
            )
        )
    assert picked(answers[0], len(body)) in endpoints
