"""Prometheus exposition of one simulated worker, in vLLM's metric names, plus simulated GPU
gauges (``sim:gpu_*``). Each worker has its own CollectorRegistry, so N workers can live in one
process. Values are read from the engine at scrape time (a custom collector), except the TTFT
histograms, which are observed as requests produce their first token.

Names (labels ``model_name`` and ``worker`` on every sample):

==========================================  ===========  ======================================
vllm:num_requests_running                   gauge        requests in the running batch
vllm:num_requests_waiting                   gauge        requests queued (not admitted)
vllm:kv_cache_usage_perc                    gauge        used KV blocks / total (0..1)
vllm:gpu_cache_usage_perc                   gauge        same (older vLLM name)
vllm:prefix_cache_queries_total             counter      prompt tokens looked up
vllm:prefix_cache_hits_total                counter      prompt tokens found cached
vllm:cache_config_info                      gauge = 1    labels block_size, num_gpu_blocks, ...
vllm:num_preemptions_total                  counter      (admission "vllm" only)
vllm:prompt_tokens_total                    counter
vllm:generation_tokens_total                counter
vllm:request_success_total                  counter      label finished_reason
vllm:time_to_first_token_seconds            histogram    wall-clock TTFT seen by the server
sim:time_to_first_token_sim_seconds         histogram    TTFT in simulated (engine) seconds
sim:gpu_sm_util_percent                     gauge        busy fraction of the last second
sim:gpu_mem_util_percent                    gauge        memory used / total x 100
sim:gpu_mem_used_bytes / _total_bytes       gauge
sim:gpu_mem_bw_util_percent                 gauge        HBM bandwidth utilisation
sim:kv_blocks_total / sim:kv_blocks_free    gauge        (TRT-LLM-like max / free blocks)
sim:max_num_seqs                            gauge        batch size limit
sim:busy_seconds_total                      counter      simulated seconds spent stepping
sim:kv_batches_published_total              counter      KV event batches sent on NATS
sim:kv_batches_dropped_total                counter      label reason (fault, nats_down, ...)
==========================================  ===========  ======================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # pragma: no cover
    from services.worker_sim.worker import SimWorker

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)


class WorkerCollector(Collector):
    def __init__(self, worker_fn: Callable[[], SimWorker]) -> None:
        self._worker_fn = worker_fn

    def collect(self) -> Iterator[Metric]:
        w = self._worker_fn()
        e = w.engine
        c = w.engine_config
        names = ["model_name", "worker"]
        lv = [w.settings.model, w.worker_id]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            m = CounterMetricFamily(name, doc, labels=names)
            m.add_metric(lv, value)
            return m

        yield gauge("vllm:num_requests_running", "Requests in the running batch", e.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be admitted", e.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = 100%)", e.kv_usage)
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (older name)", e.kv_usage)
        yield counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up", e.prefix_cache_queries
        )
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found cached", e.prefix_cache_hits)
        info_labels = names + [
            "block_size",
            "num_gpu_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "enable_prefix_caching",
            "admission",
        ]
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "KV cache configuration", labels=info_labels
        )
        info.add_metric(
            lv
            + [
                str(c.block_size),
                str(c.num_gpu_blocks),
                str(c.max_num_seqs),
                str(c.max_num_batched_tokens),
                str(c.max_model_len),
                "True",
                c.admission,
            ],
            1.0,
        )
        yield info
        yield counter("vllm:num_preemptions", "Requests preempted", e.num_preemptions)
        yield counter("vllm:prompt_tokens", "Prompt tokens admitted", e.prompt_tokens_total)
        yield counter("vllm:generation_tokens", "Tokens generated", e.generation_tokens_total)
        succ = CounterMetricFamily(
            "vllm:request_success", "Finished requests", labels=names + ["finished_reason"]
        )
        succ.add_metric(lv + ["length"], e.num_finished)
        yield succ
        g = w.gpu_gauges()
        yield gauge("sim:gpu_sm_util_percent", "Simulated SM utilisation", g.sm_util_percent)
        yield gauge("sim:gpu_mem_util_percent", "Simulated memory used/total", g.mem_util_percent)
        yield gauge("sim:gpu_mem_used_bytes", "Simulated GPU memory used", g.mem_used_bytes)
        yield gauge("sim:gpu_mem_total_bytes", "Simulated GPU memory total", g.mem_total_bytes)
        yield gauge(
            "sim:gpu_mem_bw_util_percent", "Simulated HBM bandwidth use", g.mem_bw_util_percent
        )
        yield counter(
            "sim:busy_seconds", "Simulated seconds spent stepping (incl. slow-down)", w.busy_sim_s
        )
        yield gauge("sim:kv_blocks_total", "KV blocks in the pool", c.num_gpu_blocks)
        yield gauge("sim:kv_blocks_free", "KV blocks free (incl. evictable)", e.num_free_blocks)
        yield gauge("sim:max_num_seqs", "Batch size limit", c.max_num_seqs)
        yield counter(
            "sim:kv_batches_published", "KV event batches published on NATS", w.kv_published
        )
        dropped = CounterMetricFamily(
            "sim:kv_batches_dropped", "KV event batches not published", labels=names + ["reason"]
        )
        for reason, n in sorted(w.kv_dropped.items()):
            dropped.add_metric(lv + [reason], n)
        yield dropped


class WorkerMetrics:
    """The registry of one worker: the collector plus TTFT histograms."""

    def __init__(self, worker_fn: Callable[[], SimWorker], model: str, worker_id: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(WorkerCollector(worker_fn))
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token (wall clock, seen by the server)",
            ["model_name", "worker"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model, worker_id)
        self.ttft_sim = Histogram(
            "sim:time_to_first_token_sim_seconds",
            "Time to first token in simulated engine seconds",
            ["model_name", "worker"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model, worker_id)
