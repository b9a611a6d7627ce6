"""Helpers for the telemetry tests: engine /metrics endpoints (small aiohttp apps serving
exposition text the test changes) and exposition builders for each engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from aiohttp import web

from services.common.embedded import free_port
from services.common.service import start_http


@dataclass
class Endpoint:
    """An engine-like HTTP server: GET /metrics returns ``text`` (or ``status``)."""

    port: int
    text: str = ""
    status: int = 200
    hits: int = 0
    # "prometheus": honour ?name[]=... like prometheus-client's exposition apps (vLLM/SGLang);
    # "ignore": serve everything; "broken": answer a filtered request with unrelated metrics
    name_filter: str = "ignore"
    queries: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@asynccontextmanager
async def endpoint(text: str = "") -> AsyncIterator[Endpoint]:
    ep = Endpoint(port=free_port(), text=text)

    async def metrics(r: web.Request) -> web.Response:
        ep.hits += 1
        ep.queries.append(r.query_string)
        if ep.status != 200:
            return web.Response(status=ep.status, text="boom")
        names = set(r.query.getall("name[]", []))
        text = ep.text
        if names and ep.name_filter == "prometheus":
            text = (
                "\n".join(
                    line
                    for line in text.splitlines()
                    if not line.startswith("#") and line.split("{")[0].split(" ")[0] in names
                )
                + "\n"
            )
        elif names and ep.name_filter == "broken":
            text = "process_cpu_seconds_total 1.0\n"
        return web.Response(text=text, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = await start_http(app, "127.0.0.1", ep.port)
    try:
        yield ep
    finally:
        await runner.cleanup()


def vllm_text(
    running: int,
    waiting: int,
    kv: float,
    *,
    blocks: int = 160,
    block_size: int = 16,
    queries: float = 0.0,
    hits: float = 0.0,
    prefix_caching: bool = True,
    prompt: tuple[float, float] | None = None,
    max_tokens: tuple[float, float] | None = None,
    model: str = "m",
) -> str:
    """A vLLM-style exposition (with HELP/TYPE lines and a histogram, like the real one)."""
    lab = f'engine="0",model_name="{model}"'
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{lab}}} {running}.0",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{lab}}} {waiting}.0",
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{lab}}} {kv}",
        "# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.",
        "# TYPE vllm:prefix_cache_queries counter",
        f"vllm:prefix_cache_queries_total{{{lab}}} {queries}",
        f"vllm:prefix_cache_queries_created{{{lab}}} 1.7e+09",
        "# TYPE vllm:prefix_cache_hits counter",
        f"vllm:prefix_cache_hits_total{{{lab}}} {hits}",
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",'
        f'enable_prefix_caching="{prefix_caching}",engine="0",gpu_memory_utilization="0.9",'
        f'num_gpu_blocks="{blocks}"}} 1.0',
        "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
        "# TYPE vllm:time_to_first_token_seconds histogram",
    ]
    for le in ("0.01", "0.1", "1.0", "+Inf"):
        lines.append(f'vllm:time_to_first_token_seconds_bucket{{{lab},le="{le}"}} 3.0')
    lines += [
        f"vllm:time_to_first_token_seconds_count{{{lab}}} 3.0",
        f"vllm:time_to_first_token_seconds_sum{{{lab}}} 0.3",
    ]
    if prompt is not None:
        lines += [
            "# TYPE vllm:request_prompt_tokens histogram",
            f'vllm:request_prompt_tokens_bucket{{{lab},le="+Inf"}} {prompt[1]}',
            f"vllm:request_prompt_tokens_sum{{{lab}}} {prompt[0]}",
            f"vllm:request_prompt_tokens_count{{{lab}}} {prompt[1]}",
        ]
    if max_tokens is not None:
        lines += [
            "# TYPE vllm:request_params_max_tokens histogram",
            f"vllm:request_params_max_tokens_sum{{{lab}}} {max_tokens[0]}",
            f"vllm:request_params_max_tokens_count{{{lab}}} {max_tokens[1]}",
        ]
    return "\n".join(lines) + "\n"


def trtllm_text(
    active: int,
    scheduled: int,
    *,
    max_batch: int = 64,
    used: int,
    total: int,
    tpb: int = 64,
    waiting: int | None = None,
) -> str:
    m = 'model="tensorrt_llm",version="1"'
    lines = [
        "# HELP nv_trt_llm_request_metrics TRT LLM request metrics",
        "# TYPE nv_trt_llm_request_metrics gauge",
        'nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="context",version="1"} 1',
        f'nv_trt_llm_request_metrics{{model="tensorrt_llm",request_type="scheduled",version="1"}} {scheduled}',
        f'nv_trt_llm_request_metrics{{model="tensorrt_llm",request_type="max",version="1"}} {max_batch}',
        f'nv_trt_llm_request_metrics{{model="tensorrt_llm",request_type="active",version="1"}} {active}',
    ]
    if waiting is not None:
        lines.append(
            f'nv_trt_llm_request_metrics{{model="tensorrt_llm",request_type="waiting",version="1"}} {waiting}'
        )
    lines += [
        "# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics",
        "# TYPE nv_trt_llm_kv_cache_block_metrics gauge",
        f'nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="fraction",{m}}} 0.4875',
        f'nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="tokens_per",{m}}} {tpb}',
        f'nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="used",{m}}} {used}',
        f'nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="free",{m}}} {total - used}',
        f'nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="max",{m}}} {total}',
        "# HELP nv_inference_pending_request_count Instantaneous number of pending requests.",
        "# TYPE nv_inference_pending_request_count gauge",
        f"nv_inference_pending_request_count{{{m}}} 7",
    ]
    return "\n".join(lines) + "\n"


def sglang_text(running: int, queue: int, usage: float, hit: float, max_tokens: int) -> str:
    lab = 'model_name="meta-llama/Llama-3.1-8B-Instruct"'
    return (
        "\n".join(
            [
                "# HELP sglang:num_running_reqs The number of running requests.",
                "# TYPE sglang:num_running_reqs gauge",
                f"sglang:num_running_reqs{{{lab}}} {running}.0",
                "# TYPE sglang:num_queue_reqs gauge",
                f"sglang:num_queue_reqs{{{lab}}} {queue}.0",
                "# TYPE sglang:token_usage gauge",
                f"sglang:token_usage{{{lab}}} {usage}",
                "# TYPE sglang:cache_hit_rate gauge",
                f"sglang:cache_hit_rate{{{lab}}} {hit}",
                "# TYPE sglang:max_total_num_tokens gauge",
                f"sglang:max_total_num_tokens{{{lab}}} {max_tokens}.0",
                "# TYPE sglang:prompt_tokens_total counter",
                f"sglang:prompt_tokens_total{{{lab}}} 8.128902e+06",
            ]
        )
        + "\n"
    )


def sim_text(
    running: int,
    waiting: int,
    kv: float,
    *,
    sm: float,
    mem_used: int,
    mem_total: int,
    bw: float,
    blocks: int = 160,
    block_size: int = 16,
) -> str:
    base = vllm_text(running, waiting, kv, blocks=blocks, block_size=block_size)
    used_pct = 100.0 * mem_used / mem_total
    return (
        base
        + "\n".join(
            [
                "# TYPE sim:gpu_sm_util_percent gauge",
                f'sim:gpu_sm_util_percent{{gpu="0"}} {sm}',
                f'sim:gpu_mem_util_percent{{gpu="0"}} {used_pct}',
                f'sim:gpu_mem_used_bytes{{gpu="0"}} {mem_used}',
                f'sim:gpu_mem_total_bytes{{gpu="0"}} {mem_total}',
                f'sim:gpu_mem_bw_util_percent{{gpu="0"}} {bw}',
            ]
        )
        + "\n"
    )
