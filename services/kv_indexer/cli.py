"""``kvgate indexer``: KV events -> global prefix index; deltas, snapshots, queries, debug HTTP."""

from __future__ import annotations

import argparse
import asyncio

from services.common import settings as S
from services.common.service import run_service, start_http
from services.common.streams import LEASE_TTL
from services.common.tracing import OPTIONS as TRACING_OPTIONS

OPTIONS = S.COMMON + (
    S.HASH_SEED,
    S.option(
        "host",
        "127.0.0.1",
        "address of the HTTP (health, metrics, debug) endpoint",
        env="KVGATE_INDEXER_HOST",
    ),
    S.option(
        "port",
        8082,
        "port of the HTTP (health, metrics, debug) endpoint",
        env="KVGATE_INDEXER_PORT",
    ),
    S.option(
        "max_blocks",
        2_000_000,
        "memory cap: most (worker, block) pairs kept; least-recently-stored are pruned "
        "(0 = no cap; ~100 bytes per pair)",
        env="KVGATE_INDEXER_MAX_BLOCKS",
    ),
    S.option(
        "heartbeat_timeout",
        3.0,
        "seconds without a heartbeat before a worker and all its blocks are dropped",
        env="KVGATE_INDEXER_HEARTBEAT_TIMEOUT",
    ),
    S.option(
        "tail_grace",
        2.0,
        "seconds a heartbeat's kv_seq may run ahead of the applied events before a resync",
        env="KVGATE_INDEXER_TAIL_GRACE",
    ),
    S.option(
        "block_size",
        16,
        "block size for kv.query / debug queries given as token ids without one",
        env="KVGATE_INDEXER_BLOCK_SIZE",
    ),
    S.option(
        "ha_id",
        "",
        "high availability: this indexer's id in its namespace's group (unique per indexer);"
        " one member, elected by a JetStream KV lease, publishes deltas, the others stand by"
        " with a warm index (empty: a single indexer, always active)",
        env="KVGATE_INDEXER_HA_ID",
    ),
    LEASE_TTL,  # also the provisioned lease bucket's age (services.common.streams)
    S.option(
        "dump_timeout",
        5.0,
        "seconds to wait for each chunk of a worker's full dump when resyncing it",
        env="KVGATE_INDEXER_DUMP_TIMEOUT",
    ),
    S.option(
        "verify_cpu_share",
        0.01,
        "share of one core the background index-vs-worker check may use (0 = off; it checks "
        "one worker at a time and repairs what diverges)",
        env="KVGATE_INDEXER_VERIFY_CPU_SHARE",
    ),
    S.option(
        "verify_alert_quiet",
        300.0,
        "seconds without a repair (and an equal check) before a worker's index_repaired "
        "alert resolves; repairs meanwhile raise no new alert",
        env="KVGATE_INDEXER_VERIFY_ALERT_QUIET",
    ),
)
OPTIONS += TRACING_OPTIONS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    S.add_options(parser, OPTIONS)


async def serve(st, stop: asyncio.Event) -> None:
    from services.common.bus import Bus, NatsAuth
    from services.common.subjects import Subjects
    from services.kv_indexer.app import IndexerService

    bus = Bus(
        st.nats_url,
        f"indexer-{st.ha_id}" if st.ha_id else "indexer",  # the connection's name in /connz
        Subjects(st.subject_prefix),
        auth=NatsAuth.from_settings(st),
        role="indexer",
    )
    await bus.connect()
    svc = IndexerService(
        bus,
        max_blocks=st.max_blocks or None,
        heartbeat_timeout_s=st.heartbeat_timeout,
        tail_grace_s=st.tail_grace,
        hash_seed=st.hash_seed,
        default_block_size=st.block_size,
        dump_timeout_s=st.dump_timeout,
        verify_cpu_share=st.verify_cpu_share,
        verify_alert_quiet_s=st.verify_alert_quiet,
        ha_id=st.ha_id or None,
        lease_ttl_s=st.lease_ttl,
    )
    await svc.start()
    runner = await start_http(svc.make_app(), st.host, st.port)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await svc.stop()
        await bus.close()


def check_settings(st) -> None:
    """Stop before starting, naming the flag, on a value the indexer cannot run with."""
    if not st.verify_alert_quiet > 0:
        raise SystemExit(f"invalid --verify-alert-quiet {st.verify_alert_quiet}: must be > 0 s")


def main(args: argparse.Namespace) -> int:
    st = S.resolve(args, OPTIONS)
    check_settings(st)
    return run_service("indexer", serve, st)
