"""``kvgate bridge vllm|sglang|trtllm``: run next to an engine, publish its KV events as
canonical kvgate events on NATS and heartbeat on its behalf.

Examples::

    # vLLM started with --kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq",
    #   "endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","topic":"kv@pod-a@llama"}'
    kvgate bridge vllm --worker-id pod-a --endpoint tcp://127.0.0.1:5557 \\
        --replay-endpoint tcp://127.0.0.1:5558 --engine-url http://127.0.0.1:8000 --model llama
    kvgate bridge sglang --worker-id pod-b --endpoint tcp://127.0.0.1:5557 ...
    kvgate bridge trtllm --worker-id pod-c --engine-url http://127.0.0.1:8000 --model llama
    # an engine whose PUB connects out (its endpoint has no '*'): the bridge binds
    kvgate bridge vllm --bind true --endpoint 'tcp://*:5557' --replay-endpoint tcp://pod-d:5558

The block size is read from the engine (or --block-size) before anything is published; the
bridge replays the engine's buffer from seq 0 before it says ready. GET /health and
GET /metrics (kvgate_bridge_*) are served on --host:--port.
"""

from __future__ import annotations

import argparse
import asyncio

from services.common import settings as S
from services.common.service import run_service
from services.kv_indexer.bridges.pd_role import ROLE_CHOICES, role_from_flags

ENGINES = ("vllm", "sglang", "trtllm")

OPTIONS = S.COMMON + (
    S.HASH_SEED,
    S.option(
        "worker_id",
        "",
        "worker id to publish as (default: the pod of the topic, or the engine)",
        env="KVGATE_BRIDGE_WORKER_ID",
    ),
    S.option(
        "endpoint",
        "tcp://127.0.0.1:5557",
        "engine's ZMQ PUB endpoint (vllm, sglang)",
        env="KVGATE_BRIDGE_ENDPOINT",
    ),
    S.option(
        "replay_endpoint",
        "",
        "engine's ZMQ ROUTER replay endpoint ('' = none)",
        env="KVGATE_BRIDGE_REPLAY_ENDPOINT",
    ),
    S.option(
        "topic",
        "",
        "ZMQ topic prefix to subscribe to, e.g. kv@pod-a@llama ('' = all)",
        env="KVGATE_BRIDGE_TOPIC",
    ),
    S.option(
        "engine_url",
        "",
        "engine's HTTP base URL (health, /metrics capacity; trtllm: /kv_cache_events)",
        env="KVGATE_BRIDGE_ENGINE_URL",
    ),
    S.option(
        "worker_url",
        "",
        "URL the heartbeats announce: where routers and the gateway send requests ('' = "
        "--engine-url); set it when a proxy fronts the engine, e.g. llm-d's routing sidecar "
        "on a P/D decode pod (the engine is still probed at --engine-url)",
        env="KVGATE_BRIDGE_WORKER_URL",
    ),
    S.option("model", "", "model name the engine serves", env="KVGATE_BRIDGE_MODEL"),
    S.option(
        "block_size",
        0,
        "the engine's KV block size; 0 = read it from the engine (/metrics "
        "vllm:cache_config_info, SGLang /get_server_info page_size) and wait until it answers",
        env="KVGATE_BRIDGE_BLOCK_SIZE",
    ),
    S.option(
        "bind",
        False,
        "bind the SUB socket on --endpoint (for engines whose PUB connects out: an endpoint "
        "without '*', e.g. tcp://*:5557 here and tcp://<bridge-host>:5557 in the engine)",
        env="KVGATE_BRIDGE_BIND",
    ),
    S.option(
        "host",
        "127.0.0.1",
        "address of the bridge's HTTP endpoint (GET /health, GET /metrics); 0.0.0.0 to let "
        "a Prometheus on another host scrape it",
        env="KVGATE_BRIDGE_HOST",
    ),
    S.option(
        "port",
        8090,
        "port of the bridge's HTTP endpoint (GET /health, GET /metrics; 0 = none)",
        env="KVGATE_BRIDGE_PORT",
    ),
    S.option(
        "num_gpu_blocks",
        4096,
        "capacity if the engine does not report it",
        env="KVGATE_BRIDGE_NUM_GPU_BLOCKS",
    ),
    S.option(
        "max_num_seqs",
        256,
        "max batch size if the engine does not report it",
        env="KVGATE_BRIDGE_MAX_NUM_SEQS",
    ),
    S.option(
        "max_model_len",
        8192,
        "max model length if the engine does not report it",
        env="KVGATE_BRIDGE_MAX_MODEL_LEN",
    ),
    S.option(
        "heartbeat_interval",
        1.0,
        "seconds between heartbeats",
        env="KVGATE_BRIDGE_HEARTBEAT_INTERVAL",
    ),
    S.option(
        "poll_interval",
        0.05,
        "trtllm: seconds between /kv_cache_events polls",
        env="KVGATE_BRIDGE_POLL_INTERVAL",
    ),
    S.option(
        "role",
        "auto",
        "disaggregated serving: what the engine does, announced in heartbeats: both, prefill "
        "or decode (or the engines' words: vLLM kv_role kv_producer / kv_consumer / kv_both, "
        "SGLang --disaggregation-mode null / prefill / decode); auto: from "
        "--kv-transfer-config, else SGLang's /server_info, else both",
        choices=list(ROLE_CHOICES),
        env="KVGATE_BRIDGE_ROLE",
    ),
    S.option(
        "kv_transfer_config",
        "",
        "vllm: the --kv-transfer-config JSON the engine was started with (its kv_role gives "
        "the role)",
        env="KVGATE_BRIDGE_KV_TRANSFER_CONFIG",
    ),
    S.option(
        "bootstrap_port",
        0,
        "sglang prefill: the engine's --disaggregation-bootstrap-port (0: read it from "
        "/server_info; the router assumes 8998 when none is announced)",
        env="KVGATE_BRIDGE_BOOTSTRAP_PORT",
    ),
    S.option(
        "history_recheck_interval",
        30.0,
        "vllm/sglang: seconds after a failed replay (timeout, socket error) lost engine "
        "history before the bridge asks the engine's replay from seq 0 again, doubling after "
        "each failure; if the engine still holds every batch from 0 the view is rebuilt and "
        "index verify can say equal again (0 = never)",
        env="KVGATE_BRIDGE_HISTORY_RECHECK_INTERVAL",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("engine", choices=ENGINES, help="engine kind next to which this runs")
    S.add_options(parser, OPTIONS)


def default_worker_id(engine: str, topic: str) -> str:
    """``kv@<pod>@<model>`` -> ``<pod>`` (made a valid subject token)."""
    import re

    parts = topic.split("@")
    base = parts[1] if len(parts) >= 2 and parts[1] else engine
    return re.sub(r"[^A-Za-z0-9_\-]", "-", base)


async def serve(st, stop: asyncio.Event) -> None:
    from services.common.bus import Bus, NatsAuth
    from services.common.subjects import Subjects
    from services.kv_indexer.bridges.runtime import BridgeRuntime, CapacityDefaults

    try:  # before connecting: a bad flag is a clear start-up error
        role = role_from_flags(st.role, st.kv_transfer_config)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    bus = Bus(
        st.nats_url,
        f"bridge-{st.engine}",
        Subjects(st.subject_prefix),
        auth=NatsAuth.from_settings(st),
        role="worker",
    )
    await bus.connect()
    worker = st.worker_id or default_worker_id(st.engine, st.topic)
    rt = BridgeRuntime(
        bus,
        worker,
        engine=st.engine,
        model=st.model,
        engine_url=st.engine_url,
        worker_url=st.worker_url,
        hash_seed=st.hash_seed,
        block_size=st.block_size or None,
        capacity=CapacityDefaults(
            num_gpu_blocks=st.num_gpu_blocks,
            max_num_seqs=st.max_num_seqs,
            max_model_len=st.max_model_len,
        ),
        heartbeat_s=st.heartbeat_interval,
        role=role,
        bootstrap_port=st.bootstrap_port,
    )
    await rt.start()
    runner = None
    if st.port:
        from services.common.service import start_http

        runner = await start_http(rt.make_app(), st.host, st.port)
    try:
        if st.engine == "trtllm":
            from services.kv_indexer.bridges.trtllm import TrtllmBridge

            if not st.engine_url:
                raise SystemExit("kvgate bridge trtllm needs --engine-url")
            await TrtllmBridge(rt, st.engine_url, st.poll_interval).run(stop)
        else:
            from services.kv_indexer.bridges.zmq_bridge import ZmqBridge

            await ZmqBridge(
                rt,
                st.endpoint,
                st.replay_endpoint or None,
                st.topic,
                bind=st.bind,
                history_recheck_s=st.history_recheck_interval,
            ).run(stop)
    finally:
        if runner is not None:
            await runner.cleanup()
        await rt.stop()
        await bus.close()


def main(args: argparse.Namespace) -> int:
    st = S.resolve(args, OPTIONS)
    st.engine = args.engine
    return run_service(f"bridge-{args.engine}", serve, st)
