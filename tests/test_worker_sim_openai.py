"""The simulated worker speaks vLLM's dialect, driven by the official openai client: stop
strings, synthetic logprobs, echo (and the echo + max_tokens 0 log-likelihood pattern), seeds,
n > 1, token-id and batched prompts, continuous usage stats, vLLM's defaults and its
validation errors, embeddings, /v1/models/{id}, /detokenize, /ping."""

from __future__ import annotations

import math

import openai
import pytest

from tests.test_worker_sim_support import post, sim_worker

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3

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


async def test_stop_strings_cut_the_output_and_free_the_request():
    async with sim_worker(worker_id="st") as w:
        c = client(w.url)
        free = await c.completions.create(model="m", prompt=PROMPT, max_tokens=60)
        text = free.choices[0].text
        stop = text[20:22]  # a string the synthetic output does contain
        at = text.find(stop)
        r = await c.completions.create(model="m", prompt=PROMPT, max_tokens=60, stop=[stop, "QQ"])
        ch = r.choices[0]
        assert ch.text == text[:at] and ch.finish_reason == "stop"
        assert ch.model_extra["stop_reason"] == stop
        # byte tokens: the tokens up to and including the stop string were generated
        assert r.usage.completion_tokens == at + len(stop)
        kept = await c.completions.create(
            model="m",
            prompt=PROMPT,
            max_tokens=60,
            stop=stop,
            extra_body={"include_stop_str_in_output": True},
        )
        assert kept.choices[0].text == text[: at + len(stop)]
        # streaming: the held-back tail never leaks the stop string
        stream = await c.completions.create(
            model="m", prompt=PROMPT, max_tokens=60, stop=[stop], stream=True
        )
        parts, finish = [], None
        async for chunk in stream:
            for chc in chunk.choices:
                parts.append(chc.text)
                finish = chc.finish_reason or finish
        assert "".join(parts) == text[:at] and finish == "stop"
        # a stop string that never occurs: generation runs to max_tokens
        r = await c.completions.create(model="m", prompt=PROMPT, max_tokens=30, stop="ZZZ")
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 30
        # stop_token_ids: the first generated token's id stops at once
        first = free.choices[0].text.encode()[0]
        r = await c.completions.create(
            model="m", prompt=PROMPT, max_tokens=30, extra_body={"stop_token_ids": [first]}
        )
        assert r.choices[0].finish_reason == "stop" and r.choices[0].text == ""
        assert r.choices[0].model_extra["stop_reason"] == first
        assert w.engine.num_running == 0


async def test_logprobs_have_openai_shapes_and_match_the_text():
    async with sim_worker(worker_id="lp") as w:
        c = client(w.url)
        r = await c.completions.create(model="m", prompt=PROMPT, max_tokens=12, logprobs=3)
        lp = r.choices[0].logprobs
        assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == 12
        assert all(v is not None and v <= 0 for v in lp.token_logprobs)
        assert all(len(t) == 3 for t in lp.top_logprobs)
        for tok, top, v in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs, strict=True):
            assert top[tok] == v == max(top.values())
        assert lp.text_offset == sorted(lp.text_offset)
        # streamed (with echo): the same tokens, offsets running on across chunks
        full = await c.completions.create(
            model="m", prompt=PROMPT, max_tokens=12, logprobs=1, echo=True
        )
        stream = await c.completions.create(
            model="m", prompt=PROMPT, max_tokens=12, logprobs=1, echo=True, stream=True
        )
        tokens, offsets = [], []
        async for ch in stream:
            for choice in ch.choices:
                if choice.logprobs:
                    tokens += choice.logprobs.tokens
                    offsets += choice.logprobs.text_offset
        assert tokens == full.choices[0].logprobs.tokens
        assert offsets == full.choices[0].logprobs.text_offset
        chat = await c.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=8,
            logprobs=True,
            top_logprobs=2,
        )
        content = chat.choices[0].logprobs.content
        assert "".join(t.token for t in content) == chat.choices[0].message.content
        assert all(len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode()) for t in content)
        plain = await c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=8
        )
        assert plain.choices[0].logprobs is None
        # streamed logprobs add up to the same tokens
        stream = await c.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=8,
            logprobs=True,
            stream=True,
        )
        toks = []
        async for ch in stream:
            for choice in ch.choices:
                if choice.logprobs and choice.logprobs.content:
                    toks += [t.token for t in choice.logprobs.content]
        assert "".join(toks) == chat.choices[0].message.content


async def test_echo_and_the_log_likelihood_pattern():
    async with sim_worker(worker_id="ec") as w:
        c = client(w.url)
        r = await c.completions.create(model="m", prompt=PROMPT, max_tokens=5, echo=True)
        assert r.choices[0].text.startswith(PROMPT) and len(r.choices[0].text) == len(PROMPT) + 5
        ll = await c.completions.create(
            model="m", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1
        )
        ch = ll.choices[0]
        assert ch.text == PROMPT
        assert ch.logprobs.tokens == [bytes([b]).decode() for b in PROMPT.encode()]
        assert ch.logprobs.token_logprobs[0] is None and ch.logprobs.top_logprobs[0] is None
        assert all(v is not None for v in ch.logprobs.token_logprobs[1:])
        # vLLM runs one decode step for it and counts it
        assert ll.usage.prompt_tokens == len(PROMPT) and ll.usage.completion_tokens == 1
        with pytest.raises(openai.BadRequestError) as err:
            await c.completions.create(model="m", prompt=PROMPT, max_tokens=0)
        assert err.value.body["param"] == "max_tokens"


async def test_seed_temperature_and_n():
    async with sim_worker(worker_id="sd") as w:
        c = client(w.url)

        async def text(**kw) -> str:
            r = await c.completions.create(model="m", prompt=PROMPT, max_tokens=16, **kw)
            return r.choices[0].text

        a = await text(seed=1, temperature=0.8)
        assert a == await text(seed=1, temperature=0.8)
        assert a != await text(seed=2, temperature=0.8)
        assert await text(seed=1, temperature=0) == await text(seed=2, temperature=0)
        assert await text(seed=1, temperature=0.8, top_p=0.5) != a
        r = await c.completions.create(model="m", prompt=PROMPT, max_tokens=16, n=3, seed=7)
        assert [ch.index for ch in r.choices] == [0, 1, 2]
        assert len({ch.text for ch in r.choices}) == 3
        assert r.usage.prompt_tokens == len(PROMPT) and r.usage.completion_tokens == 48
        # the same request streamed gives the same three texts, by index
        stream = await c.completions.create(
            model="m", prompt=PROMPT, max_tokens=16, n=3, seed=7, stream=True
        )
        by_index: dict[int, str] = {}
        async for ch in stream:
            for choice in ch.choices:
                by_index[choice.index] = by_index.get(choice.index, "") + choice.text
        assert by_index == {ch.index: ch.text for ch in r.choices}
        chat = await c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2
        )
        assert [ch.index for ch in chat.choices] == [0, 1]


async def test_token_id_and_batched_prompts():
    async with sim_worker(worker_id="tp") as w:
        c = client(w.url)
        ids = list(PROMPT.encode())
        r = await c.completions.create(model="m", prompt=ids, max_tokens=4)
        by_text = await c.completions.create(model="m", prompt=PROMPT, max_tokens=4)
        assert r.usage.prompt_tokens == len(ids)
        assert r.choices[0].text == by_text.choices[0].text  # same tokens, same output
        assert by_text.usage.prompt_tokens_details.cached_tokens > 0  # and the same cache
        batch = await c.completions.create(
            model="m", prompt=["first prompt", "second"], max_tokens=3
        )
        assert [ch.index for ch in batch.choices] == [0, 1]
        assert batch.usage.prompt_tokens == len("first prompt") + len("second")
        assert batch.usage.completion_tokens == 6
        ids_batch = await c.completions.create(
            model="m", prompt=[[104, 105], [104, 105, 33]], max_tokens=2, n=2
        )
        assert [ch.index for ch in ids_batch.choices] == [0, 1, 2, 3]
        assert ids_batch.usage.prompt_tokens == 5
        for bad in ([], [[]], [1, "a"], [-1], [[1], "x", 3]):
            status, js, _ = await post(w.url + "/v1/completions", {"prompt": bad})
            assert status == 400 and js["error"]["param"] == "prompt", bad


async def test_continuous_usage_stats_and_vllm_default_max_tokens():
    async with sim_worker(worker_id="cu", engine={"max_model_len": 256}) as w:
        c = client(w.url)
        stream = await c.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "count"}],
            max_completion_tokens=6,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
        seen = []
        final = None
        async for ch in stream:
            if ch.choices and ch.choices[0].delta.content:
                seen.append(ch.usage.completion_tokens)
            if not ch.choices:
                final = ch.usage
        assert seen == list(range(1, 7))
        assert final.completion_tokens == 6
        # max_tokens omitted: chat generates to the end of the context, completions 16
        msgs = [{"role": "user", "content": "go on"}]
        r = await c.chat.completions.create(model="m", messages=msgs)
        assert r.usage.prompt_tokens + r.usage.completion_tokens == 256
        assert r.choices[0].finish_reason == "length"
        r = await c.completions.create(model="m", prompt="x")
        assert r.usage.completion_tokens == 16
        # max_completion_tokens: null does not override max_tokens
        status, js, _ = await post(
            w.url + "/v1/chat/completions",
            {"messages": msgs, "max_tokens": 5, "max_completion_tokens": None},
        )
        assert status == 200 and js["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "temperature": 2.5}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "x", "top_k": -2}, "top_k"),
        ("/v1/completions", {"prompt": "x", "min_p": 1.5}, "min_p"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
        ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
        ("/v1/completions", {"prompt": "x", "stop": 5}, "stop"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": -2}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        (
            "/v1/completions",
            {"prompt": "x", "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "prompt_logprobs": 1, "stream": True},
            "prompt_logprobs",
        ),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("/v1/completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
        ("/v1/completions", {"prompt": "x", "seed": 2**64}, "seed"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "cache_salt": ""}, "cache_salt"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
        ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
        ("/v1/chat/completions", {"tools": []}, "tools"),
        (
            "/v1/chat/completions",
            {
                "tools": [{"type": "function", "function": {"name": "a"}}],
                "tool_choice": {"type": "function", "function": {"name": "b"}},
            },
            "tool_choice",
        ),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [7]}]}, "messages"),
    ],
)
async def test_vllm_validation_errors(path, body, param):
    async with sim_worker(worker_id="va") as w:
        full = {"model": "m", **body}
        if path.endswith("chat/completions") and "messages" not in full:
            full["messages"] = [{"role": "user", "content": "hi"}]
        status, js, _ = await post(w.url + path, full)
        assert status == 400, js
        err = js["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error"
        assert err["message"] and err["code"] == 400
        ok = await client(w.url).completions.create(model="m", prompt="ok", max_tokens=1)
        assert ok.usage.completion_tokens == 1  # still serving


async def test_embeddings_models_detokenize_ping():
    async with sim_worker(worker_id="em", loras=("ad-1", "org/adapter-2")) as w:
        c = client(w.url)
        e = await c.embeddings.create(model="m", input=["alpha", "beta", "alpha"])
        vecs = [d.embedding for d in e.data]
        assert vecs[0] == vecs[2] != vecs[1] and len(vecs[0]) == 64
        assert abs(math.sqrt(sum(x * x for x in vecs[1])) - 1) < 1e-4
        assert e.usage.prompt_tokens == 14
        small = await c.embeddings.create(model="m", input=[1, 2, 3], dimensions=8)
        assert len(small.data) == 1 and len(small.data[0].embedding) == 8
        card = await c.models.retrieve("ad-1")
        assert card.id == "ad-1" and card.model_extra["parent"] == "sim-llama-8b"
        assert (await c.models.retrieve("org/adapter-2")).id == "org/adapter-2"  # a "/" in ids
        with pytest.raises(openai.NotFoundError) as err:
            await c.models.retrieve("nope")
        assert err.value.body["param"] == "model"
        status, js, _ = await post(w.url + "/detokenize", {"tokens": list(b"hello")})
        assert status == 200 and js == {"prompt": "hello"}
        status, js, _ = await post(w.url + "/detokenize", {"tokens": ["x"]})
        assert status == 400 and js["error"]["param"] == "tokens"
        status, _js, _ = await post(w.url + "/ping", {})
        assert status == 200
