"""kvgate on a 3-node NATS JetStream cluster (three real nats-server processes from the wheel).

- the services' streams are created at 3 replicas when the seed URLs name 3 nodes;
- a stack (`kvgate up --nats-url <seeds>`) under light load loses one NATS node (SIGKILL) for
  a while: no client request fails, and once the node is back a new prompt's KV blocks reach
  the router's index (the whole event path: worker -> NATS -> indexer -> delta -> router).
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.bus import Bus, NatsAuth
from services.common.embedded import EmbeddedNatsCluster, free_port
from services.common.streams import cluster_size, ensure_kv_events_stream, stream_replicas
from services.common.subjects import Subjects


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[EmbeddedNatsCluster]:
    cluster = EmbeddedNatsCluster(tmp_path / "nats", size=3)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


async def test_streams_get_three_replicas_on_a_three_node_cluster(
    nats_cluster: EmbeddedNatsCluster, subject_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVGATE_STREAM_REPLICAS", raising=False)
    bus = Bus(nats_cluster.url, "cluster-test", Subjects(subject_prefix))
    await bus.connect(max_wait_s=10)
    try:
        assert cluster_size(bus) == 3
        assert stream_replicas(bus) == 3
        name = await ensure_kv_events_stream(bus)
        info = await bus.js.stream_info(name)
        assert info.config.num_replicas == 3
        assert info.cluster is not None and len(info.cluster.replicas or []) == 2
    finally:
        await bus.close()


def _post(url: str, body: dict, timeout: float = 10.0) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - loopback
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode(errors="replace")[:300]}


def _chat(router: int, content: str) -> tuple[int, dict]:
    return _post(
        f"http://127.0.0.1:{router}/v1/chat/completions",
        {
            "model": "sim-llama-8b",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 4,
        },
    )


@pytest.mark.slow
def test_stack_survives_losing_one_nats_node(
    nats_cluster: EmbeddedNatsCluster, database_url: str, tmp_path: Path
) -> None:
    router, operator, api, indexer, telemetry, sim = (free_port() for _ in range(6))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "up",
            "--nats-url",
            nats_cluster.url,
            "--database-url",
            database_url,
            "--workers",
            "2",
            "--state-dir",
            str(tmp_path / "state"),
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
            "--subject-prefix",
            f"clu{free_port()}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    stop = threading.Event()
    results: list[tuple[float, int, str]] = []

    def load() -> None:  # light load: one request at a time, ~10/s
        n = 0
        while not stop.is_set():
            n += 1
            status, body = _chat(router, f"light load request {n} " + "word " * 40)
            results.append((time.monotonic(), status, "" if status == 200 else str(body)))
            time.sleep(0.1)

    try:
        deadline = time.monotonic() + 150
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Press Ctrl-C to stop" in line:
                break
        if "kvgate is up" not in "".join(lines):  # say why: the failing service's log
            logs = sorted((tmp_path / "state" / "logs").glob("*.log"))
            tails = "".join(f"\n--- {f.name}\n" + f.read_text()[-2000:] for f in logs)
            raise AssertionError("".join(lines) + tails)
        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        time.sleep(3)
        nats_cluster.nodes[0].kill()  # a crash: no lame-duck goodbye to the clients
        killed_at = time.monotonic()
        time.sleep(10)
        nats_cluster.nodes[0].start()
        nats_cluster.wait_healthy(60)
        recovered_at = time.monotonic()
        time.sleep(3)
        stop.set()
        loader.join(30)
        during = [r for r in results if r[0] >= killed_at]
        failed = [r for r in results if r[1] != 200]
        assert len(during) >= 20, f"too little load while the node was down: {len(during)}"
        assert failed == [], failed[:5]

        # fresh after recovery: a new prompt's blocks reach the router's index
        prompt = "fresh after recovery " + " ".join(f"tok{i}" for i in range(400))
        status, body = _chat(router, prompt)
        assert status == 200, body
        sent_at = time.monotonic()
        overlap: dict = {}
        while time.monotonic() < sent_at + 10:
            status, explain = _post(
                f"http://127.0.0.1:{operator}/debug/route",  # the operator port
                {"model": "sim-llama-8b", "messages": [{"role": "user", "content": prompt}]},
            )
            overlap = explain.get("overlap_blocks") or {}
            if status == 200 and any(v > 0 for v in overlap.values()):
                break
            time.sleep(0.1)
        fresh_s = time.monotonic() - sent_at
        print(
            f"index fresh {fresh_s:.2f}s after the request, {sent_at - recovered_at:.1f}s after recovery"
        )
        assert any(v > 0 for v in overlap.values()), overlap
        assert fresh_s < 5.0
    finally:
        stop.set()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


async def test_kvgate_up_nats_cluster_starts_three_nodes(
    tmp_path: Path, database_url: str, subject_prefix: str
) -> None:
    """`kvgate up --nats-cluster 3`'s infrastructure step: three embedded nodes, one cluster,
    the seed URLs handed to the services; streams land at 3 replicas."""
    import argparse

    from services import up
    from services.common import settings as S

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    args = parser.parse_args(
        [
            "--nats-cluster",
            "3",
            "--state-dir",
            str(tmp_path),
            "--database-url",
            database_url,
            "--subject-prefix",
            subject_prefix,
        ]
    )
    stack = up.Stack(S.resolve(args, up.OPTIONS, environ={}))
    nats_url, _ = await asyncio.to_thread(stack.start_infra)
    try:
        assert len(nats_url.split(",")) == 3
        # authorization is on in the cluster too: log in as the indexer, which owns KV_EVENTS
        creds = stack.role_env("indexer")
        auth = NatsAuth(user=creds["KVGATE_NATS_USER"], password=creds["KVGATE_NATS_PASSWORD"])
        bus = Bus(nats_url, "up-cluster-test", Subjects(subject_prefix), auth=auth, role="indexer")
        await bus.connect(max_wait_s=10)
        try:
            name = await ensure_kv_events_stream(bus)
            assert (await bus.js.stream_info(name)).config.num_replicas == 3
        finally:
            await bus.close()
        # the state file names every node, so a later `kvgate up` can clean them up
        from services.common import stackfile

        stack.write_state(nats_url, database_url, str(tmp_path / "token"))
        state = stackfile.read_state(tmp_path)
        assert state is not None
        assert sorted(k for k in state.pids if k.startswith("nats-server")) == [
            "nats-server-1",
            "nats-server-2",
            "nats-server-3",
        ]
    finally:
        await asyncio.to_thread(stack.stop)
