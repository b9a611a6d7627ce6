"""``kvgate sim-worker``: simulated vLLM-like inference worker(s) (see docs/worker-sim.md)."""

from __future__ import annotations

import argparse

from services.common import settings as S
from services.common.service import run_service
from services.common.tracing import OPTIONS as TRACING_OPTIONS
from services.core.engine import ADMISSION_MODES, SCHEDULING_POLICIES, EngineConfig
from services.core.pd.transfer import DEFAULT_LINK, LINK_PROFILES
from services.worker_sim.pd import ROLES
from services.worker_sim.zmq_wire import BATCH_FORMS, EVENT_FORMS, HASH_MODES

_D = EngineConfig()

OPTIONS = S.COMMON + (
    S.option("host", "127.0.0.1", "address to listen on", env="KVGATE_SIM_HOST"),
    S.option("port", 8100, "first HTTP port (worker i listens on port + i)", env="KVGATE_SIM_PORT"),
    S.option(
        "advertise_host",
        "",
        "host put in the URL announced in heartbeats (default: --host, or this machine's "
        "hostname when --host is 0.0.0.0 / ::)",
        env="KVGATE_SIM_ADVERTISE_HOST",
    ),
    S.option("count", 1, "number of workers in this process", env="KVGATE_SIM_COUNT"),
    S.option(
        "worker_passwords",
        "",
        "per-worker NATS credentials as id=password pairs (comma-separated; secret, prefer the"
        " env var): worker <id> connects as its own user worker-<id> (kvgate nats-config), which"
        " may speak for that worker only; empty: every worker uses the --nats-user credential",
        env="KVGATE_SIM_WORKER_PASSWORDS",
    ),
    S.option(
        "worker_id",
        "sim",
        "worker id (with --count > 1: prefix, '-<i>' appended)",
        env="KVGATE_SIM_WORKER_ID",
    ),
    S.option(
        "first_index",
        0,
        "index of the first worker: ids <worker-id>-<first-index> .. (several processes of "
        "one id space: compose's P/D profile runs sim-4, sim-5 as prefill, sim-6, sim-7 as "
        "decode workers)",
        env="KVGATE_SIM_FIRST_INDEX",
    ),
    S.option("model", "sim-llama-8b", "model name served", env="KVGATE_SIM_MODEL"),
    S.option(
        "lora_modules",
        "",
        "comma-separated LoRA adapter names also served (each keys its own cache space)",
        env="KVGATE_SIM_LORA_MODULES",
    ),
    S.option(
        "heartbeat_interval", 1.0, "seconds between heartbeats", env="KVGATE_SIM_HEARTBEAT_INTERVAL"
    ),
    S.option(
        "tokenizer",
        "",
        "local HuggingFace tokenizer (directory or tokenizer.json); empty = byte-level",
        env="KVGATE_SIM_TOKENIZER",
    ),
    S.option(
        "speedup",
        1.0,
        "run the simulated clock this many times faster than real time",
        env="KVGATE_SIM_SPEEDUP",
    ),
    S.option(
        "default_max_tokens",
        0,
        "max_tokens when a request gives none (capped by the context left); "
        "0 = vLLM's defaults: completions 16, chat the rest of the context",
        env="KVGATE_SIM_DEFAULT_MAX_TOKENS",
    ),
    S.option(
        "strict_model",
        False,
        "answer 404 for unknown model names (default: serve them as the base model)",
        env="KVGATE_SIM_STRICT_MODEL",
    ),
    # disaggregated serving (P/D)
    S.option(
        "role",
        "both",
        "what this engine does: both (colocated), prefill or decode (vLLM kv_role / SGLang "
        "--disaggregation-mode); P/D requests speak vLLM's kv_transfer_params (NIXL) or "
        "SGLang's bootstrap fields",
        choices=list(ROLES),
        env="KVGATE_SIM_ROLE",
    ),
    S.option(
        "pd_link",
        DEFAULT_LINK,
        "the KV transfer link between prefill and decode workers (transfer time = setup "
        "latency + prompt KV bytes / bandwidth)",
        choices=list(LINK_PROFILES),
        env="KVGATE_SIM_PD_LINK",
    ),
    S.option(
        "pd_kv_lease_s",
        30.0,
        "a prefill worker frees the KV it holds for a decoder after this many seconds "
        "(vLLM's kv_lease_duration)",
        env="KVGATE_SIM_PD_KV_LEASE_S",
    ),
    S.option(
        "pd_bootstrap_timeout_s",
        30.0,
        "how long a decoder waits for its bootstrap room's prefill (SGLang's "
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)",
        env="KVGATE_SIM_PD_BOOTSTRAP_TIMEOUT_S",
    ),
    # capacity
    S.option("block_size", _D.block_size, "KV block size (tokens)", env="KVGATE_SIM_BLOCK_SIZE"),
    S.option(
        "num_gpu_blocks",
        _D.num_gpu_blocks,
        "KV cache capacity in blocks (x block_size = tokens)",
        env="KVGATE_SIM_NUM_GPU_BLOCKS",
    ),
    S.option("max_num_seqs", _D.max_num_seqs, "max batch size", env="KVGATE_SIM_MAX_NUM_SEQS"),
    S.option(
        "max_num_batched_tokens",
        _D.max_num_batched_tokens,
        "token budget of one step (chunked prefill)",
        env="KVGATE_SIM_MAX_NUM_BATCHED_TOKENS",
    ),
    S.option(
        "max_model_len",
        _D.max_model_len,
        "max prompt + completion tokens",
        env="KVGATE_SIM_MAX_MODEL_LEN",
    ),
    S.option(
        "admission",
        _D.admission,
        "reserve: admit only when all blocks a request can need fit (TensorRT-LLM "
        "guaranteed-no-evict; reproduces seed 001); vllm: allocate on demand and preempt",
        choices=list(ADMISSION_MODES),
        env="KVGATE_SIM_ADMISSION",
    ),
    S.option(
        "scheduling_policy",
        _D.scheduling,
        "vLLM's --scheduling-policy: fcfs (arrival order; a non-zero request priority is a "
        "400) or priority (the queue by the request's priority, lower first, then arrival; "
        "the lowest priority is preempted when KV runs out)",
        choices=list(SCHEDULING_POLICIES),
        env="KVGATE_SIM_SCHEDULING_POLICY",
    ),
    S.option(
        "priority_preemption_threshold",
        -1,
        "with --scheduling-policy priority: a waiting request preempts running requests whose "
        "priority is more than this above its own when no slot or KV is free (SGLang's "
        "--priority-scheduling-preemption-threshold); -1: never (vLLM)",
        env="KVGATE_SIM_PRIORITY_PREEMPTION_THRESHOLD",
    ),
    S.HASH_SEED,
    S.option("seed", 0, "seed of the generated tokens and fault dice", env="KVGATE_SIM_SEED"),
    # step-time model
    S.option(
        "step_overhead_s",
        _D.step_overhead_s,
        "fixed cost of a step",
        env="KVGATE_SIM_STEP_OVERHEAD_S",
    ),
    S.option(
        "prefill_token_s",
        _D.prefill_token_s,
        "cost per uncached prompt token",
        env="KVGATE_SIM_PREFILL_TOKEN_S",
    ),
    S.option(
        "prefill_attn_s",
        _D.prefill_attn_s,
        "cost per (prompt token x context token) of prefill attention",
        env="KVGATE_SIM_PREFILL_ATTN_S",
    ),
    S.option(
        "decode_seq_s", _D.decode_seq_s, "cost per decoding sequence", env="KVGATE_SIM_DECODE_SEQ_S"
    ),
    S.option(
        "decode_kv_token_s",
        _D.decode_kv_token_s,
        "cost per KV token read in decode",
        env="KVGATE_SIM_DECODE_KV_TOKEN_S",
    ),
    S.option(
        "gpu_mem_total_bytes",
        _D.gpu_mem_total_bytes,
        "simulated GPU memory",
        env="KVGATE_SIM_GPU_MEM_TOTAL_BYTES",
    ),
    # ZMQ (vLLM wire format)
    S.option(
        "zmq_port",
        0,
        "publish KV events over ZMQ in vLLM's format: worker i PUB on port + 2i, replay "
        "ROUTER on port + 2i + 1 (0 = off)",
        env="KVGATE_SIM_ZMQ_PORT",
    ),
    S.option("zmq_host", "127.0.0.1", "ZMQ bind address", env="KVGATE_SIM_ZMQ_HOST"),
    S.option("zmq_replay", True, "open the replay ROUTER socket", env="KVGATE_SIM_ZMQ_REPLAY"),
    S.option(
        "zmq_topic",
        "kv@{worker}@{model}",
        "ZMQ topic ({worker}, {model} substituted)",
        env="KVGATE_SIM_ZMQ_TOPIC",
    ),
    S.option(
        "zmq_event_form",
        "map",
        "event encoding: map (vLLM >= 0.24) or array (older, tag first)",
        choices=list(EVENT_FORMS),
        env="KVGATE_SIM_ZMQ_EVENT_FORM",
    ),
    S.option(
        "zmq_batch_form",
        "array",
        "batch encoding: array [ts, events, dp_rank] (released vLLM) or map (vLLM main)",
        choices=list(BATCH_FORMS),
        env="KVGATE_SIM_ZMQ_BATCH_FORM",
    ),
    S.option(
        "zmq_hash",
        "uint64",
        "block hash type: uint64 (vLLM), int64 (SGLang) or bytes32",
        choices=list(HASH_MODES),
        env="KVGATE_SIM_ZMQ_HASH",
    ),
    S.option(
        "zmq_replay_topic_frame",
        False,
        "replay replies carry a topic frame (vLLM >= 0.26 framing)",
        env="KVGATE_SIM_ZMQ_REPLAY_TOPIC_FRAME",
    ),
    # faults
    S.option(
        "fault_workers",
        "all",
        "workers the fault flags apply to: 'all' or comma-separated indices / ids",
        env="KVGATE_SIM_FAULT_WORKERS",
    ),
    S.option(
        "faults", "", "faults as JSON (same fields as POST /admin/faults)", env="KVGATE_SIM_FAULTS"
    ),
    S.option("fault_hang", False, "start hung", env="KVGATE_SIM_FAULT_HANG"),
    S.option("fault_slow", 1.0, "slow every step down by this factor", env="KVGATE_SIM_FAULT_SLOW"),
    S.option(
        "fault_drop_kv", 0.0, "fraction of KV batches dropped", env="KVGATE_SIM_FAULT_DROP_KV"
    ),
    S.option(
        "fault_dup_kv", 0.0, "fraction of KV batches duplicated", env="KVGATE_SIM_FAULT_DUP_KV"
    ),
    S.option(
        "fault_reject", 0.0, "fraction of requests answered 503", env="KVGATE_SIM_FAULT_REJECT"
    ),
    S.option(
        "fault_crash_after",
        0.0,
        "crash after this many seconds (0 = never)",
        env="KVGATE_SIM_FAULT_CRASH_AFTER",
    ),
    S.option(
        "fault_restart_after",
        -1.0,
        "after a crash, come back as a new instance after this many seconds (-1 = stay down)",
        env="KVGATE_SIM_FAULT_RESTART_AFTER",
    ),
)
OPTIONS += TRACING_OPTIONS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    S.add_options(parser, OPTIONS)


def main(args: argparse.Namespace) -> int:
    from services.worker_sim.app import serve

    return run_service("sim-worker", serve, S.resolve(args, OPTIONS))
