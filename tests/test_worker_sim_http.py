"""The simulated worker's OpenAI HTTP API (official openai client), /tokenize, /health and
/metrics (parsed with prometheus-client's parser), and the seed-001 reproduction."""

from __future__ import annotations

import asyncio

import openai
import pytest

from services.common.tokenizer import ByteTokenizer, prompt_from_request
from tests.test_worker_sim_support import get_text, metric_values, one, post, sim_worker, until

SYSTEM = "You are a helpful assistant. Answer briefly and precisely. " * 4


_clients: list[openai.AsyncOpenAI] = []


def client(url: str) -> openai.AsyncOpenAI:
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    _clients.append(c)
    return c


@pytest.fixture(autouse=True)
async def _close_clients():
    yield
    while _clients:
        await _clients.pop().close()


def expected_cached(prompt_len: int, block: int = 16) -> int:
    """Cached tokens on an exact repeat: all full blocks, but the last token is recomputed."""
    return (prompt_len - 1) // block * block


async def test_completions_with_openai_client_report_cached_tokens_on_repeat():
    async with sim_worker(worker_id="wa") as w:
        c = client(w.url)
        prompt = SYSTEM + "What is 2 + 2?"
        raw = await c.completions.with_raw_response.create(
            model="sim-llama-8b", prompt=prompt, max_tokens=12
        )
        assert raw.headers["x-kvgate-served-by"] == "wa"
        first = raw.parse()
        assert first.choices[0].finish_reason == "length"
        assert len(first.choices[0].text) == 12  # byte-level tokens, ASCII output
        assert first.usage.prompt_tokens == len(prompt.encode())
        assert first.usage.completion_tokens == 12
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        again = await c.completions.create(model="sim-llama-8b", prompt=prompt, max_tokens=12)
        assert again.usage.prompt_tokens_details.cached_tokens == expected_cached(len(prompt))
        assert again.choices[0].text == first.choices[0].text  # deterministic
        other = await c.completions.create(
            model="sim-llama-8b", prompt=SYSTEM + "And 3 + 3?", max_tokens=3
        )
        shared = len(SYSTEM.encode()) // 16 * 16
        assert other.usage.prompt_tokens_details.cached_tokens == shared


async def test_chat_streaming_one_chunk_per_step_with_usage():
    async with sim_worker(worker_id="wb") as w:
        c = client(w.url)
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Tell me a story."},
        ]
        body = {"messages": messages}
        prompt_len = len(prompt_from_request(ByteTokenizer(), body).encode())
        for attempt in range(2):
            stream = await c.chat.completions.create(
                model="sim-llama-8b",
                messages=messages,
                max_completion_tokens=9,
                stream=True,
                stream_options={"include_usage": True},
            )
            contents, finish, usage = [], None, None
            async for ch in stream:
                if ch.usage is not None:
                    usage = ch.usage
                for choice in ch.choices:
                    if choice.delta.content:
                        contents.append(choice.delta.content)
                    if choice.finish_reason:
                        finish = choice.finish_reason
            assert len(contents) == 9 and all(len(x) == 1 for x in contents)
            assert finish == "length"
            assert usage.prompt_tokens == prompt_len and usage.completion_tokens == 9
            cached = usage.prompt_tokens_details.cached_tokens
            assert cached == (0 if attempt == 0 else expected_cached(prompt_len))
        full = await c.chat.completions.create(
            model="sim-llama-8b", messages=messages, max_tokens=9
        )
        assert full.choices[0].message.content == "".join(contents)
        assert full.choices[0].message.role == "assistant"


async def test_bad_requests_get_openai_style_400s():
    async with sim_worker(worker_id="wc", engine={"max_model_len": 256}) as w:
        c = client(w.url)
        with pytest.raises(openai.BadRequestError) as err:
            await c.completions.create(model="m", prompt="x" * 250, max_tokens=10)
        assert "maximum context length is 256" in str(err.value)
        cases = [
            ({"max_tokens": 3}, "prompt"),
            ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
            ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
            ({"prompt": 5}, "prompt"),
        ]
        for body, param in cases:
            status, js, headers = await post(w.url + "/v1/completions", body)
            assert status == 400, body
            assert js["error"]["type"] == "invalid_request_error" and js["error"]["message"]
            assert js["error"]["param"] == param
            assert headers["x-kvgate-served-by"] == "wc"
        status, js, _ = await post(w.url + "/v1/chat/completions", {"messages": "hi"})
        assert status == 400 and "messages" in js["error"]["message"]
        status, js, _ = await post(w.url + "/v1/chat/completions", [1, 2])
        assert status == 400
        # still serving
        ok = await c.completions.create(model="m", prompt="fine", max_tokens=2)
        assert ok.usage.completion_tokens == 2


async def test_tokenize_models_and_health():
    async with sim_worker(worker_id="wd", loras=("ad-1",)) as w:
        status, js, _ = await post(w.url + "/tokenize", {"prompt": "héllo"})
        assert status == 200
        assert js == {
            "tokens": list("héllo".encode()),
            "count": 6,
            "max_model_len": 4096,
            "token_strs": None,
        }
        msgs = {"messages": [{"role": "user", "content": "hi"}]}
        status, js, _ = await post(w.url + "/tokenize", msgs)
        assert js["tokens"] == list(prompt_from_request(ByteTokenizer(), msgs).encode())
        models = await client(w.url).models.list()
        assert [m.id for m in models.data] == ["sim-llama-8b", "ad-1"]
        status, js, _ = await post(w.url + "/tokenize", {"nothing": 1})
        assert status == 400
        import json

        health = json.loads(await get_text(w.url + "/health"))
        assert health["status"] == "ok" and health["worker_id"] == "wd"
        info = json.loads(await get_text(w.url + "/get_server_info"))
        assert info["page_size"] == 16 and info["max_total_num_tokens"] == 512 * 16
        assert info["max_running_requests"] == 16 and info["context_length"] == 4096
        assert json.loads(await get_text(w.url + "/model_info"))["is_generation"] is True


async def test_lora_requests_use_their_own_cache_space():
    async with sim_worker(worker_id="we", loras=("ad-1",)) as w:
        c = client(w.url)
        p = SYSTEM + "lora?"
        await c.completions.create(model="sim-llama-8b", prompt=p, max_tokens=2)
        r = await c.completions.create(model="ad-1", prompt=p, max_tokens=2)
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        r = await c.completions.create(model="ad-1", prompt=p, max_tokens=2)
        assert r.usage.prompt_tokens_details.cached_tokens == expected_cached(len(p))


async def test_metrics_in_vllm_names_follow_load_and_are_per_worker():
    async with (
        sim_worker(worker_id="m0", speedup=5.0) as w0,
        sim_worker(worker_id="m1", speedup=20.0) as w1,
    ):
        c = client(w0.url)
        idle = metric_values(await get_text(w0.url + "/metrics"))
        assert one(idle, "sim:gpu_sm_util_percent") == 0.0
        reported_cached = 0
        prompt_tokens = 0
        for p in (SYSTEM + "a", SYSTEM + "b", SYSTEM + "a"):
            r = await c.completions.create(model="sim-llama-8b", prompt=p, max_tokens=4)
            reported_cached += r.usage.prompt_tokens_details.cached_tokens
            prompt_tokens += r.usage.prompt_tokens
        # a long request keeps the engine busy while we scrape
        busy = asyncio.create_task(
            c.completions.create(model="sim-llama-8b", prompt="x" * 1500, max_tokens=2000)
        )

        async def running() -> bool:
            v = metric_values(await get_text(w0.url + "/metrics"))
            return (
                one(v, "vllm:num_requests_running") == 1 and one(v, "sim:gpu_sm_util_percent") > 50
            )

        await until(running, what="worker m0 busy")
        v = metric_values(await get_text(w0.url + "/metrics"))
        labels = v["vllm:num_requests_running"][0][0]
        assert labels == {"model_name": "sim-llama-8b", "worker": "m0"}
        assert one(v, "vllm:num_requests_waiting") == 0
        assert 0 < one(v, "vllm:kv_cache_usage_perc") <= 1
        assert one(v, "vllm:prefix_cache_queries_total") == prompt_tokens + 1500
        assert one(v, "vllm:prefix_cache_hits_total") == reported_cached > 0
        ((info_labels, info_value),) = v["vllm:cache_config_info"]
        assert info_value == 1 and info_labels["block_size"] == "16"
        assert info_labels["num_gpu_blocks"] == "512"
        assert 0 < one(v, "sim:gpu_mem_bw_util_percent") <= 100
        assert one(v, "sim:gpu_mem_used_bytes") > one(idle, "sim:gpu_mem_used_bytes")
        assert one(v, "sim:gpu_mem_total_bytes") == w0.engine_config.gpu_mem_total_bytes
        assert 0 < one(v, "sim:gpu_mem_util_percent") < 100
        assert one(v, "vllm:time_to_first_token_seconds_count") == 4  # incl. the busy one
        # the other worker in the same process has its own, untouched registry
        v1 = metric_values(await get_text(w1.url + "/metrics"))
        assert v1["vllm:num_requests_running"][0][0]["worker"] == "m1"
        assert one(v1, "vllm:prefix_cache_queries_total") == 0
        assert one(v1, "vllm:time_to_first_token_seconds_count") == 0
        busy.cancel()
        with pytest.raises(asyncio.CancelledError):
            await busy

        async def aborted() -> bool:
            v = metric_values(await get_text(w0.url + "/metrics"))
            return (
                one(v, "vllm:num_requests_running") == 0 and one(v, "vllm:kv_cache_usage_perc") == 0
            )

        await until(aborted, what="client disconnect aborts the request")


@pytest.mark.slow
async def test_seed_001_reproduction_running_1_waiting_7():
    """2560 tokens of KV, max batch 64, eight requests of 1024 + 1024 tokens: one runs, seven
    wait (as visible in the worker's metrics)."""
    engine = {"num_gpu_blocks": 160, "max_num_seqs": 64, "max_model_len": 4096}
    async with sim_worker(worker_id="s001", speedup=2.0, engine=engine) as w:
        c = client(w.url)
        tasks = [
            asyncio.create_task(
                c.completions.create(
                    model="sim-llama-8b", prompt=f"{i} " + "y" * 1022, max_tokens=1024
                )
            )
            for i in range(8)
        ]

        async def queued() -> bool:
            v = metric_values(await get_text(w.url + "/metrics"))
            return one(v, "vllm:num_requests_running") + one(v, "vllm:num_requests_waiting") == 8

        await until(queued, what="eight requests in the engine")
        v = metric_values(await get_text(w.url + "/metrics"))
        assert one(v, "vllm:num_requests_running") == 1
        assert one(v, "vllm:num_requests_waiting") == 7
        assert one(v, "vllm:kv_cache_usage_perc") == pytest.approx(128 / 160)
        ((labels, _),) = v["vllm:cache_config_info"]
        assert int(labels["num_gpu_blocks"]) * int(labels["block_size"]) == 2560
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_local_huggingface_tokenizer(tmp_path):
    """--tokenizer: a local tokenizer.json (+ chat template) tokenizes prompts, counts usage
    and keys blocks; generated text decodes to words."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    from services.common.embedded import free_port
    from services.common.tokenizer import load_tokenizer
    from services.core.engine import EngineConfig
    from services.core.keys import block_keys
    from services.worker_sim.app import output_vocab
    from services.worker_sim.worker import SimWorker, WorkerSettings

    words = "[UNK] the of and to in is that for it as with was on be by at this are from or an"
    words += " hello world system user assistant say something about cats dogs"
    vocab = {w: i for i, w in enumerate(words.split())}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}assistant"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = load_tokenizer(str(tmp_path))
    cfg = EngineConfig(num_gpu_blocks=64, max_model_len=1024, output_vocab=output_vocab(tok))
    w = SimWorker(WorkerSettings(worker_id="hf", port=free_port(), speedup=200), cfg, tok)
    await w.start()
    try:
        prompt = "hello world " * 20 + "say something about cats"
        ids = tok.encode(prompt)
        assert len(ids) == 44 and vocab["[UNK]"] not in ids
        status, js, _ = await post(w.url + "/tokenize", {"prompt": prompt})
        assert js["tokens"] == ids and js["count"] == 44
        c = client(w.url)
        r1 = await c.completions.create(model="m", prompt=prompt, max_tokens=6)
        r2 = await c.completions.create(model="m", prompt=prompt, max_tokens=6)
        assert r1.usage.prompt_tokens == 44 and r2.usage.prompt_tokens_details.cached_tokens == 32
        assert set(r1.choices[0].text.split()) <= set(vocab) - {"[UNK]"}
        assert len(r1.choices[0].text.split()) == 6
        # the router computes the same keys from the same tokenizer
        assert w.engine.num_cached_blocks >= len(block_keys(ids, 16)) == 2
        chat = await c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hello cats"}], max_tokens=2
        )
        assert chat.usage.prompt_tokens == len(tok.encode("user hello cats assistant"))
    finally:
        await w.close()


async def test_seed_001_with_vllm_admission_runs_two_and_preempts():
    """The same load with --admission vllm: prompts are admitted while they fit, decode blocks
    come on demand, and the pool running out shows as preemptions in the metrics."""
    engine = {"num_gpu_blocks": 160, "max_num_seqs": 64, "max_model_len": 4096, "admission": "vllm"}
    async with sim_worker(worker_id="s001v", speedup=2.0, engine=engine) as w:
        c = client(w.url)
        tasks = [
            asyncio.create_task(
                c.completions.create(model="m", prompt=f"{i} " + "y" * 1022, max_tokens=1024)
            )
            for i in range(8)
        ]

        async def queued() -> bool:
            v = metric_values(await get_text(w.url + "/metrics"))
            return one(v, "vllm:num_requests_running") + one(v, "vllm:num_requests_waiting") == 8

        await until(queued, what="eight requests in the engine")
        v = metric_values(await get_text(w.url + "/metrics"))
        assert one(v, "vllm:num_requests_running") == 2
        assert one(v, "vllm:num_requests_waiting") == 6
        ((labels, _),) = v["vllm:cache_config_info"]
        assert labels["admission"] == "vllm"

        async def preempting() -> bool:
            v = metric_values(await get_text(w.url + "/metrics"))
            return one(v, "vllm:num_preemptions_total") > 0

        await until(preempting, what="a preemption")
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
