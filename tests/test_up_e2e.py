"""`kvgate up` as a user runs it: embedded NATS and Postgres, a chat completion through the
router with the official openai client, then Ctrl-C leaves no process behind. The stack runs
the highly available indexer pair (`--indexers 2`): exactly one of them is active.

NATS authorization is on by default (one generated user per role): the completion going
through proves every service works within its role's permissions, and no service's log shows a
permission it was refused or any of the generated passwords."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.up_stack import UpStack, processes_mentioning

pytestmark = pytest.mark.slow


def test_kvgate_up_serves_a_chat_completion_and_stops_cleanly(tmp_path: Path) -> None:
    import openai

    state = tmp_path / "state"
    up = UpStack(state, workers=2, indexers=2)
    router, operator, sim = (up.ports[k] for k in ("router", "router-operator", "sim"))
    try:
        output = up.banner(timeout=120)
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
    assert set(passwords) == {"worker", "telemetry", "indexer", "router", "api", "operator"}
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
    assert "indexer lease acquired" in outputs["indexer-1.log"] + outputs["indexer-2.log"]
    leftovers = processes_mentioning(str(state)) + processes_mentioning(f"--port {router}")
    leftovers += processes_mentioning(f"--port {sim}")
    assert leftovers == [], leftovers
