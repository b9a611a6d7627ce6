"""``kvgate sim-worker``'s process: N simulated workers sharing one event loop and one NATS
connection. Worker i listens on ``port + i`` (ZMQ on ``zmq_port + 2*i``, replay ``+ 1``) and is
called ``<worker_id>-<i>`` (just ``<worker_id>`` when N = 1).

Invariant: HTTP serving never waits for NATS. The bus connects in the background (a few
seconds are given at start so the first KV batches are not lost); until it does, KV batches are
dropped and counted, heartbeats are skipped, and kvdump requests cannot arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from typing import Any

from services.common.aio import cancel_and_wait
from services.common.bus import Bus, NatsAuth
from services.common.logging import get_logger
from services.common.streams import require_kv_events_stream
from services.common.subjects import Subjects, check_token
from services.common.tokenizer import load_tokenizer
from services.core.engine import DEFAULT_OUTPUT_VOCAB, EngineConfig
from services.worker_sim.faults import Faults
from services.worker_sim.pd import PdSettings
from services.worker_sim.worker import SimWorker, WorkerSettings

log = get_logger("sim-worker")

_ENGINE_FIELDS = (
    "block_size",
    "num_gpu_blocks",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "admission",
    "hash_seed",
    "seed",
    "step_overhead_s",
    "prefill_token_s",
    "prefill_attn_s",
    "decode_seq_s",
    "decode_kv_token_s",
    "gpu_mem_total_bytes",
)


def output_vocab(tokenizer: Any) -> tuple[int, ...]:
    """Token ids the engine generates: lowercase words for a HuggingFace tokenizer, letters and
    spaces for the byte-level one."""
    if getattr(tokenizer, "name", "bytes") == "bytes":
        return DEFAULT_OUTPUT_VOCAB
    words = "the of and to in is that for it as with was on be by at this are from or an".split()
    ids: list[int] = []
    for w in words:
        ids.extend(tokenizer.encode(" " + w))
    return tuple(ids) or DEFAULT_OUTPUT_VOCAB


def engine_config_from(st: Any, tokenizer: Any) -> EngineConfig:
    kwargs = {f: getattr(st, f) for f in _ENGINE_FIELDS if getattr(st, f, None) is not None}
    kwargs["scheduling"] = getattr(st, "scheduling_policy", None) or "fcfs"
    threshold = getattr(st, "priority_preemption_threshold", -1)
    kwargs["preempt_threshold"] = None if threshold is None or threshold < 0 else threshold
    return EngineConfig(**kwargs, output_vocab=output_vocab(tokenizer))


def fault_patch_from(st: Any) -> dict[str, Any]:
    """Faults given as flags (applied to the workers named by --fault-workers)."""
    patch: dict[str, Any] = {}
    if getattr(st, "faults", ""):
        patch.update(json.loads(st.faults))
    if getattr(st, "fault_hang", False):
        patch["hang"] = True
    if getattr(st, "fault_slow", 1.0) != 1.0:
        patch["slow_factor"] = st.fault_slow
    for name in ("drop_kv", "dup_kv", "reject"):
        v = getattr(st, f"fault_{name}", 0.0)
        if v:
            patch[name] = v
    Faults().update(patch)  # validate early: a bad flag is a clear startup error
    return patch


def advertise_host(host: str, advertise: str) -> str:
    """The host other machines should use: explicit, else the bind host unless it is a
    wildcard address (then this machine's hostname)."""
    if advertise:
        return advertise
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return host


def worker_ids(base: str, count: int, first: int = 0) -> list[str]:
    """``<base>-<first>`` .. (just ``<base>`` for one worker numbered from 0)."""
    check_token(base, "worker id")
    if count == 1 and first == 0:
        return [base]
    return [f"{base}-{first + i}" for i in range(count)]


def _selected(spec: str, i: int, wid: str) -> bool:
    if not spec or spec == "all":
        return True
    items = {s.strip() for s in spec.split(",") if s.strip()}
    return str(i) in items or wid in items


def _buses(st: Any, ids: list[str]) -> dict[str, Bus]:
    """The NATS connection of each worker: one shared (the process's credential), or with
    ``worker_passwords`` one per worker as its own user ``worker-<id>``, so a worker's
    credential speaks for that worker only (services.common.permissions)."""
    subjects = Subjects(st.subject_prefix)
    if not st.worker_passwords:
        auth = NatsAuth.from_settings(st)
        bus = Bus(st.nats_url, "sim-worker", subjects, auth=auth, role="worker")
        return dict.fromkeys(ids, bus)
    passwords = parse_worker_passwords(st.worker_passwords)
    out: dict[str, Bus] = {}
    for wid in ids:
        if wid not in passwords:
            raise SystemExit(f"KVGATE_SIM_WORKER_PASSWORDS has no password for worker {wid}")
        auth = NatsAuth(user=f"worker-{wid}", password=passwords[wid])
        out[wid] = Bus(st.nats_url, f"sim-worker-{wid}", subjects, auth=auth, role="worker")
    return out


def parse_worker_passwords(text: str) -> dict[str, str]:
    """``id=password,id=password`` -> {id: password}; an error names the entry, never a secret."""
    out: dict[str, str] = {}
    for n, item in enumerate(x.strip() for x in text.split(",")):
        wid, sep, password = item.partition("=")
        if not item:
            continue
        if not sep or not wid.strip() or not password:
            raise SystemExit(f"KVGATE_SIM_WORKER_PASSWORDS: entry {n + 1} is not id=password")
        out[check_token(wid.strip(), "worker id")] = password
    return out


def _by_bus(buses: dict[str, Bus], workers: list[SimWorker]) -> list[tuple[Bus, list[SimWorker]]]:
    groups: dict[int, tuple[Bus, list[SimWorker]]] = {}
    for w in workers:
        bus = buses[w.worker_id]
        groups.setdefault(id(bus), (bus, []))[1].append(w)
    return list(groups.values())


async def _connect_bus(bus: Bus, workers: list[SimWorker], first_wait_s: float) -> None:
    try:
        await bus.connect(max_wait_s=first_wait_s)
    except ConnectionError:
        log.warning("NATS not reachable; serving HTTP, dropping KV events until it is")
        await bus.connect()  # retries forever with backoff
    delay = 0.5
    while True:
        try:
            await require_kv_events_stream(bus)
            break
        except Exception as exc:  # JetStream not ready yet (or out of storage): back off
            log.warning(
                "cannot set up the KV events stream, retrying", error=repr(exc), retry_in_s=delay
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)
    for w in workers:
        await w.attach_bus()


async def _heartbeats(bus: Bus, workers: list[SimWorker], interval: float) -> None:
    while True:
        if bus.is_connected:
            for w in workers:
                if w.beating:
                    with contextlib.suppress(Exception):
                        await bus.publish(bus.subjects.heartbeat(w.worker_id), w.heartbeat())
                    await w.attach_bus()  # after a restart (crash fault) re-subscribe
        await asyncio.sleep(interval)


async def serve(st: Any, stop: asyncio.Event) -> None:
    tokenizer = load_tokenizer(st.tokenizer)
    config = engine_config_from(st, tokenizer)
    patch = fault_patch_from(st)
    loras = tuple(x.strip() for x in st.lora_modules.split(",") if x.strip())
    ids = worker_ids(st.worker_id, st.count, getattr(st, "first_index", 0))
    buses = _buses(st, ids)
    workers: list[SimWorker] = []
    pd = PdSettings(
        role=getattr(st, "role", "both"),
        link=getattr(st, "pd_link", "rdma"),
        lease_s=getattr(st, "pd_kv_lease_s", 30.0),
        bootstrap_timeout_s=getattr(st, "pd_bootstrap_timeout_s", 30.0),
    )
    for i, wid in enumerate(ids):
        ws = WorkerSettings(
            worker_id=wid,
            host=st.host,
            advertise_host=advertise_host(st.host, st.advertise_host),
            port=st.port + i,
            model=st.model,
            loras=loras,
            speedup=st.speedup,
            default_max_tokens=st.default_max_tokens,
            strict_model=st.strict_model,
            heartbeat_interval=st.heartbeat_interval,
            zmq_port=(st.zmq_port + 2 * i) if st.zmq_port else 0,
            zmq_replay_port=(st.zmq_port + 2 * i + 1) if st.zmq_port and st.zmq_replay else 0,
            zmq_host=st.zmq_host,
            zmq_topic=st.zmq_topic,
            zmq_event_form=st.zmq_event_form,
            zmq_batch_form=st.zmq_batch_form,
            zmq_hash=st.zmq_hash,
            zmq_replay_topic_frame=st.zmq_replay_topic_frame,
            faults=patch if patch and _selected(st.fault_workers, i, wid) else {},
            fault_seed=i,
            pd=pd,
        )
        workers.append(SimWorker(ws, config, tokenizer, buses[wid]))
    groups = _by_bus(buses, workers)
    connects = [
        asyncio.create_task(_connect_bus(bus, ws_, first_wait_s=3.0)) for bus, ws_ in groups
    ]
    tasks: list[asyncio.Task[None]] = list(connects)
    try:
        with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
            await asyncio.wait_for(asyncio.shield(asyncio.gather(*connects)), timeout=3.5)
        for w in workers:
            try:
                await w.start()
            except OSError as exc:
                raise RuntimeError(
                    f"sim worker {w.worker_id} cannot listen on {w.url}: {exc}"
                ) from exc
        if st.fault_crash_after > 0:
            for i, w in enumerate(workers):
                if _selected(st.fault_workers, i, w.worker_id):
                    tasks.append(asyncio.create_task(_crash_later(w, st.fault_crash_after, st)))
        tasks += [
            asyncio.create_task(_heartbeats(bus, ws_, st.heartbeat_interval)) for bus, ws_ in groups
        ]
        log.info(
            "sim workers up",
            count=len(workers),
            first=workers[0].url if workers else None,
            speedup=st.speedup,
            kv_blocks=config.num_gpu_blocks,
        )
        await stop.wait()
    finally:
        # also on a failed start: leave no task or connection behind, or the process would
        # hang in asyncio.run's final cancellation instead of exiting
        log.info("stopping sim workers", count=len(workers))
        await cancel_and_wait(tasks)
        await asyncio.gather(*(w.close() for w in workers), return_exceptions=True)
        for bus, _ in groups:
            await bus.close()
        log.info("sim workers stopped")


async def _crash_later(w: SimWorker, after_s: float, st: Any) -> None:
    await asyncio.sleep(after_s)  # the fault's schedule, not a synchronisation
    restart = st.fault_restart_after if st.fault_restart_after >= 0 else None
    await w.crash(restart)
