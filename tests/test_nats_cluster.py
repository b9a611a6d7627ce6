"""kvgate on a 3-node NATS JetStream cluster (three real nats-server processes from the wheel).

- the services' streams are created at 3 replicas when the seed URLs name 3 nodes;
- `kvgate up --nats-cluster 3` starts three nodes as one cluster.

Losing a node under load: tests/test_faults_under_load.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.bus import Bus, NatsAuth
from services.common.embedded import EmbeddedNatsCluster, env_without_proxy
from services.common.streams import cluster_size, require_kv_events_stream, stream_replicas
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
        name = await require_kv_events_stream(bus)
        info = await bus.js.stream_info(name)
        assert info.config.num_replicas == 3
        assert info.cluster is not None and len(info.cluster.replicas or []) == 2
    finally:
        await bus.close()


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
        # authorization is on in the cluster too: `kvgate up` provisions the streams with the
        # provisioner's credential, then the indexer finds KV_EVENTS at 3 replicas
        env = {"KVGATE_NATS_URL": nats_url, "KVGATE_SUBJECT_PREFIX": subject_prefix}
        await asyncio.to_thread(stack.provision_bus, {**env_without_proxy(), **env})
        creds = stack.role_env("indexer")
        auth = NatsAuth(user=creds["KVGATE_NATS_USER"], password=creds["KVGATE_NATS_PASSWORD"])
        bus = Bus(nats_url, "up-cluster-test", Subjects(subject_prefix), auth=auth, role="indexer")
        await bus.connect(max_wait_s=10)
        try:
            name = await require_kv_events_stream(bus)
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
