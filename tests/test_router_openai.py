"""The router's OpenAI / vLLM surface with real simulated workers, the real indexer and bus:

- chat requests keyed by the exact prompt the engine builds (a HuggingFace tokenizer and a chat
  template that writes the tools right after the system prompt): two requests sharing system
  prompt + tools share their keys, and the router's predicted cached tokens equal what the
  worker's engine reports;
- completions with token-id prompts (keyed without the tokenizer), batched prompts, n > 1 and
  echo + max_tokens 0, each routed once;
- /tokenize, /detokenize, /version, /ping, /v1/models/{id}, /v1/embeddings and a listed
  pass-through path; errors in OpenAI's shape with ``param``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import aiohttp
import openai
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from services.common.bus import Bus
from services.common.tokenizer import ByteTokenizer, HFTokenizer, render_chat
from services.core.keys import block_keys
from services.router.tokenize import BadRequest, RequestParser
from tests.test_router_e2e_sim import SimCluster
from tests.test_router_support import Indexer, RouterProc, shutdown, wait_until

# tools right after the system prompt, as most model templates place them; tool_choice and a
# chat_template_kwargs flag change the prompt too
TOOLS_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for m in messages %}"
    "{%- if loop.first and m['role'] == 'system' %}<|system|>{{ m['content'] }}\n"
    "{%- if tools %}<|tools|>{% for t in tools %}{{ t['function'] | tojson }}\n{% endfor %}"
    "{%- if tool_choice == 'required' %}<|must-call|>{% endif %}{% endif %}"
    "{%- else %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endif %}"
    "{%- endfor %}"
    "{%- if enable_thinking %}<|think|>{% endif %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)

SYSTEM = "You are an agent that plans, calls tools and reports. Be brief. " * 4


def tool(name: str, desc: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "what to look up"}},
                "required": ["query"],
            },
        },
    }


TOOLS = [tool(f"tool_{i}", f"looks things up in source number {i}, carefully") for i in range(5)]


def byte_level_tokenizer(root: Path) -> Path:
    """A real HuggingFace tokenizer.json (byte-level BPE without merges: one token per byte)
    plus the template above, built here (no download)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": TOOLS_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"})
    )
    return root


def chat(user: str, tools=TOOLS, **extra) -> dict:
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": 3,
        **extra,
    }
    if tools is not None:
        body["tools"] = tools
    return body


async def test_template_inputs_change_the_prompt_and_tools_share_keys(tmp_path) -> None:
    hf = HFTokenizer(byte_level_tokenizer(tmp_path / "tok"))
    with_tools = render_chat(hf, chat("what is new?"))
    assert with_tools.index("<|tools|>") > with_tools.index("<|system|>")
    assert with_tools.index("<|tools|>") < with_tools.index("<|user|>")
    assert '"name": "tool_0"' in with_tools  # HuggingFace's tojson, not jinja2's HTML-safe one
    without = render_chat(hf, chat("what is new?", tools=None))
    required = render_chat(hf, chat("what is new?", tool_choice="required"))
    thinking = render_chat(hf, chat("what is new?", chat_template_kwargs={"enable_thinking": True}))
    no_gen = render_chat(hf, chat("what is new?", add_generation_prompt=False))
    assert len({with_tools, without, required, thinking, no_gen}) == 5
    parser = RequestParser(hf)
    a = await parser.parse(chat("first question"), chat=True)
    b = await parser.parse(chat("a different second question"), chat=True)
    assert len(a.token_ids) > len(
        (await parser.parse(chat("first question", None), True)).token_ids
    )
    ka, kb = RequestParser.keys(a, 16), RequestParser.keys(b, 16)
    common = os.path.commonprefix(
        [
            render_chat(hf, chat("first question")),
            render_chat(hf, chat("a different second question")),
        ]
    )
    assert common.endswith("<|user|>")  # system prompt + tools + the user tag
    shared = len(common.encode()) // 16
    assert ka[:shared] == kb[:shared] and ka[shared] != kb[shared]
    # malformed content parts are a 400 naming the field, not a TypeError
    bad = chat("x")
    bad["messages"][1]["content"] = [{"type": "text", "text": 5}]
    with pytest.raises(BadRequest) as err:
        await parser.parse(bad, chat=True)
    assert err.value.param == "messages"


async def test_token_id_prompts_are_keyed_without_the_tokenizer() -> None:
    class NoEncode(ByteTokenizer):
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            raise AssertionError("token-id prompts must not be tokenized")

    parser = RequestParser(NoEncode())
    ids = list(range(1, 70))
    p = await parser.parse({"model": "m", "prompt": ids, "max_tokens": 4}, chat=False)
    assert p.token_ids == ids and RequestParser.keys(p, 16) == block_keys(ids, 16)
    batch = await parser.parse({"prompt": [ids, ids[:20]], "max_tokens": 4, "n": 3}, chat=False)
    # one routed request: all prompt tokens and all outputs' tokens count for admission
    assert len(batch.token_ids) == 89 and batch.max_tokens == 4 * 3 * 2
    assert RequestParser.keys(batch, 16)[:4] == block_keys(ids, 16)[:4]
    assert not batch.migratable
    echo0 = await parser.parse({"prompt": ids, "max_tokens": 0, "echo": True}, chat=False)
    assert echo0.max_tokens == 1
    for body, param in (
        ({"prompt": ids, "max_tokens": 0}, "max_tokens"),
        ({"prompt": ids, "n": 0}, "n"),
        ({"prompt": [ids, "x", 5]}, "prompt"),
        ({"prompt": []}, "prompt"),
    ):
        with pytest.raises(BadRequest) as err:
            await parser.parse(body, chat=False)
        assert err.value.param == param, body
    # max_completion_tokens: null does not override max_tokens
    p = await RequestParser(ByteTokenizer()).parse(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 7,
            "max_completion_tokens": None,
        },
        chat=True,
    )
    assert p.max_tokens == 7


@pytest.mark.slow
async def test_predicted_cached_tokens_equal_the_engines_with_tools(
    nats_url, subjects, bus: Bus, tmp_path
) -> None:
    path = str(byte_level_tokenizer(tmp_path / "tok"))
    sims = await SimCluster(nats_url, subjects, 2, tokenizer=path, speedup=50.0).start()
    indexer = await Indexer(nats_url, subjects).start()
    router = await RouterProc(nats_url, subjects, policy="kv_aware", tokenizer=path).start()
    try:
        await router.wait_workers(2, timeout=20)
        r = router.router
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            # the router's /tokenize and the worker's agree token for token
            first = chat("first question")
            async with s.post(router.url + "/tokenize", json=first) as resp:
                mine = await resp.json()
            async with s.post(sims.url(0) + "/tokenize", json=first) as resp:
                theirs = await resp.json()
            assert mine["tokens"] == theirs["tokens"] and mine["count"] > 600
            async with s.post(router.url + "/v1/chat/completions", json=first) as resp:
                assert resp.status == 200, await resp.text()
                holder = resp.headers["x-kvgate-worker"]
                await resp.read()
            await wait_until(
                lambda: r.index_source.index.blocks_of(holder) >= mine["count"] // 16,
                what="prefix indexed",
            )
            second = chat("and now a second, different question")
            async with s.post(router.url + "/debug/route", json=second) as resp:
                d = await resp.json()
            hf = HFTokenizer(path)
            common = os.path.commonprefix([render_chat(hf, first), render_chat(hf, second)])
            shared = len(common.encode()) // 16 * 16
            assert d["worker"] == holder and d["predicted_cached_tokens"] == shared > 600
            async with s.post(router.url + "/v1/chat/completions", json=second) as resp:
                body = await resp.json()
                assert resp.headers["x-kvgate-worker"] == holder
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == shared
            # the same request without tools shares only the system prompt
            async with s.post(router.url + "/debug/route", json=chat("third", tools=None)) as resp:
                d = await resp.json()
            assert (
                d["predicted_cached_tokens"] == len(("<s><|system|>" + SYSTEM).encode()) // 16 * 16
            )
    finally:
        await shutdown(
            ("router", router.stop()), ("indexer", indexer.stop()), ("sims", sims.stop()), each_s=10
        )


@pytest.mark.slow
async def test_router_endpoints_and_routed_requests(nats_url, subjects, bus: Bus) -> None:
    sims = await SimCluster(nats_url, subjects, 2, speedup=50.0).start()
    router = await RouterProc(
        nats_url, subjects, policy="least_request", passthrough_paths="/admin/faults"
    ).start()
    c = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    try:
        await router.wait_workers(2, timeout=20)
        # completions in every prompt form vLLM accepts, each routed once
        ids = list(b"count the tokens of this prompt please")
        r = await c.completions.create(model="m", prompt=ids, max_tokens=3)
        assert r.usage.prompt_tokens == len(ids)
        r = await c.completions.create(model="m", prompt=["alpha beta", "gamma"], max_tokens=2)
        assert [ch.index for ch in r.choices] == [0, 1] and r.usage.prompt_tokens == 15
        raw = await c.completions.with_raw_response.create(
            model="m", prompt="fan out", max_tokens=4, n=3, seed=3
        )
        r = raw.parse()
        assert len({ch.text for ch in r.choices}) == 3 and raw.headers["x-kvgate-worker"]
        r = await c.completions.create(model="m", prompt="score me", max_tokens=0, echo=True)
        assert r.choices[0].text == "score me"
        # streaming n=2 through the router: both choices arrive, usage at the end
        stream = await c.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "two"}],
            max_tokens=5,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        got: dict[int, str] = {}
        usage = None
        async for ch in stream:
            for choice in ch.choices:
                got[choice.index] = got.get(choice.index, "") + (choice.delta.content or "")
            usage = ch.usage or usage
        assert sorted(got) == [0, 1] and usage.completion_tokens == 10
        # errors: the router's own (param named) and the worker's passed through
        for kwargs, param in (
            (
                {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
                "messages",
            ),
            ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
            ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
            (
                {
                    "messages": [{"role": "user", "content": "x"}],
                    "stream_options": {"include_usage": True},
                },
                "stream_options",
            ),
        ):
            with pytest.raises(openai.BadRequestError) as err:
                await c.chat.completions.create(model="m", max_tokens=2, **kwargs)
            assert err.value.body["param"] == param, kwargs
        # embeddings routed to a worker, deterministic
        e1 = await c.embeddings.create(model="m", input=["same text", "other"])
        e2 = await c.embeddings.create(model="m", input="same text")
        assert e1.data[0].embedding == e2.data[0].embedding != e1.data[1].embedding
        # models
        card = await c.models.retrieve("m")
        assert card.id == "m" and card.model_extra["max_model_len"] > 0
        # an unknown model's card is a 404 once the router knows the cluster (503 before)
        assert router.router is not None
        await wait_until(router.router.readiness.cluster_known, 10, "cluster known")
        with pytest.raises(openai.NotFoundError) as err:
            await c.models.retrieve("nope")
        assert err.value.body["param"] == "model" and err.value.body["code"] == 404
        async with aiohttp.ClientSession() as s:
            async with s.post(router.url + "/tokenize", json={"prompt": "héllo"}) as resp:
                tok = await resp.json()
            assert tok["tokens"] == list("héllo".encode()) and tok["count"] == 6
            assert tok["max_model_len"] > 0
            async with s.post(router.url + "/detokenize", json={"tokens": tok["tokens"]}) as resp:
                assert await resp.json() == {"prompt": "héllo"}
            async with s.post(router.url + "/detokenize", json={"tokens": [-1]}) as resp:
                assert resp.status == 400 and (await resp.json())["error"]["param"] == "tokens"
            async with s.get(router.url + "/version") as resp:
                assert (await resp.json())["version"]
            async with s.get(router.url + "/ping") as resp:
                assert resp.status == 200
            # a listed pass-through path is routed to a worker as is
            async with s.post(router.url + "/admin/faults", json={}) as resp:
                assert resp.status == 200
                assert (await resp.json())["worker_id"] == resp.headers["x-kvgate-worker"]
    finally:
        await c.close()
        await shutdown(("router", router.stop()), ("sims", sims.stop()), each_s=10)


async def test_max_tokens_defaults_follow_vllm() -> None:
    """Omitted max_tokens is counted as the engine will run it: 16 for completions, the rest
    of the workers' context for chat (the simulated worker does the same)."""
    parser = RequestParser(ByteTokenizer(), default_max_tokens=0, context_len=lambda m: 1000)
    chat_body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    p = await parser.parse(chat_body, chat=True)
    assert p.max_tokens == 1000 - len(p.token_ids)
    assert (await parser.parse({"model": "m", "prompt": "hi"}, chat=False)).max_tokens == 16
    p = await parser.parse({**chat_body, "n": 2}, chat=True)
    assert p.max_tokens == 2 * (1000 - len(p.token_ids))
    capped = RequestParser(ByteTokenizer(), default_max_tokens=64, context_len=lambda m: 1000)
    assert (await capped.parse(chat_body, chat=True)).max_tokens == 64
    unknown = RequestParser(ByteTokenizer(), default_max_tokens=0)
    assert (await unknown.parse(chat_body, chat=True)).max_tokens == 16
