"""Compatibility suite: every request option of vLLM's OpenAI-compatible server, sent with the
official ``openai`` client through the router to a simulated worker (HuggingFace tokenizer
with a BOS post-processor and a tools template, the real indexer, the real bus).

Each option is in exactly one class, and the test checks it:
- APPLIED: the option changes the answer the way vLLM's does (asserted per option);
- REJECTED: an invalid value, or an option the simulator cannot honour, is a 4xx with vLLM's
  status and an OpenAI-shaped error naming the field (``param``);
- NO_EFFECT: accepted, and provably without effect on the synthetic output, for the reason
  given (the test asserts the output equals the baseline's).

OPTION_NAMES lists the request fields of vLLM 0.33.0's ``CompletionRequest`` and
``ChatCompletionRequest`` (vllm/entrypoints/openai/{completion,chat_completion}/protocol.py);
the test fails when an option has no class.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from services.common.bus import Bus
from tests.test_router_e2e_sim import SimCluster
from tests.test_router_openai import TOOLS, TOOLS_TEMPLATE
from tests.test_router_support import Indexer, RouterProc, shutdown, wait_until

COMPLETION_OPTIONS = (
    "model prompt echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty "
    "seed stop stream stream_options suffix temperature top_p user use_beam_search top_k "
    "min_p repetition_penalty watermarking length_penalty stop_token_ids "
    "include_stop_str_in_output ignore_eos min_tokens skip_special_tokens "
    "spaces_between_special_tokens truncate_prompt_tokens truncation_side allowed_token_ids "
    "prompt_logprobs logprob_token_ids bad_words prompt_embeds add_special_tokens "
    "response_format structured_outputs priority request_id session_id "
    "return_tokens_as_token_ids return_token_ids return_weight_versions "
    "routed_experts_prompt_start return_token_offsets mm_payload return_mm_kwargs cache_salt "
    "kv_transfer_params ec_transfer_params vllm_xargs repetition_detection "
    "thinking_token_budget stream_interval"
).split()
CHAT_OPTIONS = (
    "messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens "
    "max_completion_tokens n presence_penalty response_format seed stop stream stream_options "
    "temperature top_p tools tool_choice reasoning_effort thinking_token_budget "
    "include_reasoning parallel_tool_calls user use_beam_search top_k min_p repetition_penalty "
    "watermarking length_penalty stop_token_ids include_stop_str_in_output ignore_eos "
    "min_tokens skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens "
    "truncation_side prompt_logprobs logprob_token_ids allowed_token_ids bad_words echo "
    "add_generation_prompt continue_final_message add_special_tokens documents chat_template "
    "chat_template_kwargs media_io_kwargs mm_processor_kwargs structured_outputs priority "
    "request_id session_id return_tokens_as_token_ids return_token_ids return_weight_versions "
    "routed_experts_prompt_start return_token_offsets return_prompt_text mm_payload "
    "return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params vllm_xargs "
    "repetition_detection stream_interval"
).split()
OPTION_NAMES = set(COMPLETION_OPTIONS) | set(CHAT_OPTIONS)

# accepted; no effect on the synthetic output, and why
NO_EFFECT: dict[str, tuple[dict[str, Any], str]] = {
    "user": ({"user": "u-1"}, "end-user id for abuse monitoring; vLLM does not use it either"),
    "ignore_eos": ({"ignore_eos": True}, "the simulated engine has no EOS token"),
    "length_penalty": ({"length_penalty": 2.0}, "used by beam search only (rejected here)"),
    "skip_special_tokens": ({"skip_special_tokens": False}, "no special tokens are generated"),
    "spaces_between_special_tokens": (
        {"spaces_between_special_tokens": False},
        "no special tokens are generated",
    ),
    "session_id": ({"session_id": "s-1"}, "a client-side grouping id"),
    "kv_transfer_params": (
        {"kv_transfer_params": {"x": 1}},
        "no KV connector (vLLM ignores it too)",
    ),
    "ec_transfer_params": ({"ec_transfer_params": {"x": 1}}, "no encoder-cache connector"),
    "vllm_xargs": ({"vllm_xargs": {"k": 1}}, "no custom logits processor is loaded"),
    "thinking_token_budget": ({"thinking_token_budget": 10}, "the output has no thinking part"),
    "include_reasoning": ({"include_reasoning": False}, "the output has no reasoning part"),
    "parallel_tool_calls": ({"parallel_tool_calls": False}, "the output has no tool calls"),
    "media_io_kwargs": ({"media_io_kwargs": {"image": {}}}, "text-only inputs"),
    "mm_processor_kwargs": ({"mm_processor_kwargs": {"x": 1}}, "text-only inputs"),
    "priority": ({"priority": 0}, "0 is the only priority without --scheduling-policy priority"),
}

# value -> (status, param); the first group are invalid values, the second options the
# simulator cannot honour
REJECTED: dict[str, list[tuple[dict[str, Any], int, str]]] = {
    "temperature": [
        ({"temperature": -1}, 400, "temperature"),
        ({"temperature": 3}, 400, "temperature"),
    ],
    "top_p": [({"top_p": 0}, 400, "top_p")],
    "top_k": [({"top_k": -5}, 400, "top_k")],
    "min_p": [({"min_p": 2}, 400, "min_p")],
    "frequency_penalty": [({"frequency_penalty": 9}, 400, "frequency_penalty")],
    "presence_penalty": [({"presence_penalty": -9}, 400, "presence_penalty")],
    "repetition_penalty": [({"repetition_penalty": 0}, 400, "repetition_penalty")],
    "n": [({"n": 0}, 400, "n")],
    "max_tokens": [({"max_tokens": -1}, 400, "max_tokens")],
    "max_completion_tokens": [({"max_completion_tokens": 0}, 400, "max_completion_tokens")],
    "stop": [({"stop": [""]}, 400, "stop")],
    "stop_token_ids": [({"stop_token_ids": ["a"]}, 400, "stop_token_ids")],
    "min_tokens": [({"min_tokens": -1}, 400, "min_tokens")],
    "seed": [({"seed": 2**64}, 400, "seed")],
    "logprobs": [({"logprobs": 99}, 400, "logprobs")],
    "top_logprobs": [({"top_logprobs": 3}, 400, "top_logprobs")],
    "prompt_logprobs": [({"prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs")],
    "stream_options": [({"stream_options": {"include_usage": True}}, 400, "stream_options")],
    "stream_interval": [({"stream_interval": 0}, 400, "stream_interval")],
    "logit_bias": [({"logit_bias": {"x": 1}}, 400, "logit_bias")],
    "allowed_token_ids": [({"allowed_token_ids": []}, 400, "allowed_token_ids")],
    "bad_words": [({"bad_words": [""]}, 400, "bad_words")],
    "truncate_prompt_tokens": [({"truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens")],
    "truncation_side": [
        ({"truncate_prompt_tokens": 4, "truncation_side": "up"}, 400, "truncate_prompt_tokens")
    ],
    "add_special_tokens": [({"add_special_tokens": "yes"}, 400, "add_special_tokens")],
    "cache_salt": [({"cache_salt": ""}, 400, "cache_salt")],
    "tools": [({"tools": []}, 400, "tools")],
    "tool_choice": [({"tool_choice": "auto", "tools": None}, 400, "tool_choice")],
    "priority_nonzero": [({"priority": 5}, 400, "priority")],
    "messages": [
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            400,
            "messages",
        )
    ],
    "prompt": [({"prompt": [[1], "x", 3]}, 400, "prompt")],
    "model": [({"model": "no-such-model"}, 404, None)],
    "request_id": [({"request_id": 5}, 400, "request_id")],
    "documents": [({"documents": "nope"}, 400, "messages")],
    "chat_template_kwargs": [({"chat_template_kwargs": "nope"}, 400, "messages")],
    "add_generation_prompt": [({"add_generation_prompt": "nope"}, 400, "messages")],
    "continue_final_message": [
        ({"continue_final_message": True, "add_generation_prompt": True}, 400, "messages")
    ],
    "reasoning_effort": [({"reasoning_effort": 5}, 400, "messages")],
    "echo": [({"echo": "yes"}, 400, "echo")],
    "return_token_ids": [({"return_token_ids": "yes"}, 400, "return_token_ids")],
    "return_tokens_as_token_ids": [
        ({"return_tokens_as_token_ids": 3}, 400, "return_tokens_as_token_ids")
    ],
    "include_stop_str_in_output": [
        ({"include_stop_str_in_output": 3}, 400, "include_stop_str_in_output")
    ],
    # honoured by vLLM, not by the simulator: refused, never silently dropped
    "suffix": [({"suffix": "x"}, 400, "suffix")],
    "use_beam_search": [({"use_beam_search": True}, 400, "use_beam_search")],
    "watermarking": [({"watermarking": True}, 400, "watermarking")],
    "prompt_embeds": [({"prompt_embeds": "AAAA"}, 400, "prompt_embeds")],
    "response_format": [({"response_format": {"type": "json_object"}}, 400, "response_format")],
    "structured_outputs": [({"structured_outputs": {"regex": "a+"}}, 400, "structured_outputs")],
    "logprob_token_ids": [({"logprob_token_ids": [1], "logprobs": 1}, 400, "logprob_token_ids")],
    "repetition_detection": [({"repetition_detection": {"x": 1}}, 400, "repetition_detection")],
    "return_weight_versions": [({"return_weight_versions": True}, 400, "return_weight_versions")],
    "return_token_offsets": [({"return_token_offsets": True}, 400, "return_token_offsets")],
    "return_prompt_text": [({"return_prompt_text": True}, 400, "return_prompt_text")],
    "return_mm_kwargs": [({"return_mm_kwargs": True}, 400, "return_mm_kwargs")],
    "mm_payload": [({"mm_payload": {"x": 1}}, 400, "mm_payload")],
    "routed_experts_prompt_start": [
        ({"routed_experts_prompt_start": 3}, 400, "routed_experts_prompt_start")
    ],
    "chat_template": [({"chat_template": "{{ messages }}"}, 400, "chat_template")],
}

# checked one by one in test_applied_options below
APPLIED = {
    "model", "prompt", "messages", "echo", "frequency_penalty", "presence_penalty",
    "repetition_penalty", "temperature", "top_p", "top_k", "min_p", "logit_bias", "logprobs",
    "top_logprobs", "prompt_logprobs", "max_tokens", "max_completion_tokens", "n", "seed",
    "stop", "stream", "stream_options", "stop_token_ids", "include_stop_str_in_output",
    "min_tokens", "truncate_prompt_tokens", "truncation_side", "allowed_token_ids",
    "bad_words", "add_special_tokens", "request_id", "return_tokens_as_token_ids",
    "return_token_ids", "cache_salt", "stream_interval", "tools", "tool_choice", "documents",
    "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "reasoning_effort",
}  # fmt: skip

BOS_TEMPLATE = TOOLS_TEMPLATE + (
    "{%- if documents %}<|docs|>{{ documents | tojson }}{% endif %}"
    "{%- if reasoning_effort %}<|effort:{{ reasoning_effort }}|>{% endif %}"
)


def bos_tokenizer(root: Path) -> Path:
    """Byte-level HuggingFace tokenizer whose post-processor adds ``<s>`` (like Llama's)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["<s>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(["<s>"])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": BOS_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"})
    )
    return root


def test_every_vllm_option_has_a_class() -> None:
    classified = APPLIED | set(NO_EFFECT) | {k for k in REJECTED if k in OPTION_NAMES}
    assert OPTION_NAMES - classified == set()
    assert set(NO_EFFECT) & APPLIED == set()


PROMPT = "Summarise the following report in one line: the quarter went well. " * 3
MSGS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Report: the quarter went well, costs fell."},
]


@pytest.mark.slow
async def test_openai_client_through_the_router(nats_url, subjects, bus: Bus, tmp_path) -> None:
    path = str(bos_tokenizer(tmp_path / "tok"))
    sims = await SimCluster(nats_url, subjects, 1, tokenizer=path, speedup=100.0).start()
    indexer = await Indexer(nats_url, subjects).start()
    router = await RouterProc(nats_url, subjects, policy="kv_aware", tokenizer=path).start()
    c = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    try:
        await router.wait_workers(1, timeout=20)
        # rejections are checked once the router knows the cluster: before, an unknown model
        # is a 503 + Retry-After (a starting router), not the 404 asserted below
        assert router.router is not None
        await wait_until(router.router.readiness.cluster_known, 10, "cluster known")

        async def comp(**kw: Any) -> Any:
            kw.setdefault("max_tokens", 8)
            model, prompt = kw.pop("model", "m"), kw.pop("prompt", PROMPT)
            extra = {k: kw.pop(k) for k in list(kw) if k not in _CLIENT_COMPLETION_ARGS}
            return await c.completions.create(model=model, prompt=prompt, extra_body=extra, **kw)

        async def chat(**kw: Any) -> Any:
            kw.setdefault("max_tokens", 8)
            model, messages = kw.pop("model", "m"), kw.pop("messages", MSGS)
            extra = {k: kw.pop(k) for k in list(kw) if k not in _CLIENT_CHAT_ARGS}
            return await c.chat.completions.create(
                model=model, messages=messages, extra_body=extra, **kw
            )

        async def raw(endpoint: str, body: dict[str, Any]) -> tuple[int, dict]:
            full = {"model": "m", "max_tokens": 4, **body}
            if endpoint == "chat":
                full.setdefault("messages", MSGS)
            else:
                full.setdefault("prompt", PROMPT)
            full = {k: v for k, v in full.items() if v is not None}
            url = router.url + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
            async with http.post(url, json=full) as resp:
                return resp.status, await resp.json(content_type=None)

        # ---------------------------------------------------------------- NO_EFFECT
        base_c = (await comp()).choices[0].text
        base_chat = (await chat()).choices[0].message.content
        for name, (kw, why) in NO_EFFECT.items():
            if name in COMPLETION_OPTIONS:
                assert (await comp(**kw)).choices[0].text == base_c, (name, why)
            if name in CHAT_OPTIONS:
                assert (await chat(**kw)).choices[0].message.content == base_chat, (name, why)

        # ---------------------------------------------------------------- REJECTED
        for name, cases in REJECTED.items():
            for kw, status, param in cases:
                for endpoint in ("completions", "chat"):
                    opts = COMPLETION_OPTIONS if endpoint == "completions" else CHAT_OPTIONS
                    key = name.removesuffix("_nonzero")
                    if key not in opts or (endpoint == "completions" and key == "top_logprobs"):
                        continue
                    got, body = await raw(endpoint, kw)
                    assert got == status, (endpoint, name, body)
                    err = body["error"]
                    assert err["message"] and err["type"] and err["code"] == status, body
                    assert err["param"] == param, (endpoint, name, err)

        # ---------------------------------------------------------------- APPLIED
        await _applied(c, comp, chat, raw, router, base_c, base_chat)
    finally:
        await http.close()
        await c.close()
        await shutdown(
            ("router", router.stop()), ("indexer", indexer.stop()), ("sims", sims.stop()), each_s=10
        )


_CLIENT_COMPLETION_ARGS = {
    "max_tokens", "echo", "logprobs", "n", "seed", "stop", "stream", "stream_options",
    "temperature", "top_p", "frequency_penalty", "presence_penalty", "logit_bias", "user",
    "suffix", "best_of",
}  # fmt: skip
_CLIENT_CHAT_ARGS = {
    "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "n", "seed", "stop",
    "stream", "stream_options", "temperature", "top_p", "frequency_penalty",
    "presence_penalty", "logit_bias", "user", "tools", "tool_choice", "parallel_tool_calls",
    "reasoning_effort", "response_format",
}  # fmt: skip


async def _applied(
    c: openai.AsyncOpenAI,
    comp: Callable[..., Awaitable[Any]],
    chat: Callable[..., Awaitable[Any]],
    raw: Callable[..., Awaitable[tuple[int, dict]]],
    router: RouterProc,
    base_c: str,
    base_chat: str,
) -> None:
    n_prompt = len(PROMPT.encode()) + 1  # + the BOS the post-processor adds
    seen: set[str] = {"model", "prompt", "messages"}

    # model: an unknown model is a 404 (REJECTED); the served one answers
    r = await comp()
    assert r.model == "m" and r.usage.prompt_tokens == n_prompt
    # add_special_tokens: completions get the BOS by default (as vLLM), chat does not
    r = await comp(add_special_tokens=False)
    assert r.usage.prompt_tokens == n_prompt - 1
    r = await chat(add_special_tokens=True)
    plain = await chat()
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens + 1
    seen.add("add_special_tokens")

    # token-choice options: deterministic, and each changes the synthetic text
    for kw in (
        {"temperature": 0.7}, {"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1},
        {"frequency_penalty": 0.5}, {"presence_penalty": 0.5}, {"repetition_penalty": 1.2},
        {"logit_bias": {"65": 3}},
    ):  # fmt: skip
        a = (await comp(**kw)).choices[0].text
        assert a == (await comp(**kw)).choices[0].text != base_c, kw
        seen |= set(kw)
    # greedy: the seed does not matter; sampled: it does
    assert (await comp(temperature=0, seed=1)).choices[0].text == (
        await comp(temperature=0, seed=2)
    ).choices[0].text
    assert (await comp(seed=1)).choices[0].text != (await comp(seed=2)).choices[0].text
    seen.add("seed")
    # vocabulary restrictions are honoured exactly
    alpha = sorted(pre_tokenizers.ByteLevel.alphabet())
    ids = [alpha.index("x"), alpha.index("y")]
    r = await comp(allowed_token_ids=ids, max_tokens=20)
    assert set(r.choices[0].text) <= {"x", "y"} and len(r.choices[0].text) == 20
    r = await comp(logit_bias={str(alpha.index("z")): 100}, max_tokens=6)
    assert r.choices[0].text == "zzzzzz"
    banned = set(base_c.replace(" ", ""))
    r = await comp(bad_words=sorted(banned), max_tokens=8)
    assert not set(r.choices[0].text) & banned
    seen |= {"allowed_token_ids", "logit_bias", "bad_words"}

    # lengths
    assert (await comp(max_tokens=5)).usage.completion_tokens == 5
    status, body = await raw("chat", {"max_tokens": 6, "max_completion_tokens": None})
    assert status == 200 and body["usage"]["completion_tokens"] == 6
    assert (await chat(max_completion_tokens=3)).usage.completion_tokens == 3
    seen |= {"max_tokens", "max_completion_tokens"}

    # stop strings, stop token ids, include_stop_str_in_output, min_tokens
    long = (await comp(max_tokens=40)).choices[0].text
    stop = long[12:14]
    at = long.find(stop)
    r = await comp(max_tokens=40, stop=[stop])
    assert r.choices[0].text == long[:at] and r.choices[0].finish_reason == "stop"
    r = await comp(max_tokens=40, stop=[stop], include_stop_str_in_output=True)
    assert r.choices[0].text == long[: at + 2]
    first_id = alpha.index(long[0]) if long[0] in alpha else None
    if first_id is not None:
        r = await comp(max_tokens=40, stop_token_ids=[first_id])
        assert r.choices[0].finish_reason == "stop" and r.choices[0].text == ""
    r = await comp(max_tokens=40, stop=[long[0]], min_tokens=10)
    assert len(r.choices[0].text) >= 9
    seen |= {"stop", "stop_token_ids", "include_stop_str_in_output", "min_tokens"}

    # n, echo, logprobs, prompt_logprobs, return_token_ids, return_tokens_as_token_ids
    r = await comp(n=2, seed=4)
    assert len(r.choices) == 2 and r.choices[0].text != r.choices[1].text
    r = await comp(echo=True, max_tokens=0, logprobs=1)
    assert r.choices[0].text == PROMPT and r.choices[0].logprobs.token_logprobs[0] is None
    r = await comp(logprobs=2)
    assert len(r.choices[0].logprobs.tokens) == 8
    status, body = await raw("completions", {"prompt_logprobs": 1})
    assert status == 200 and body["choices"][0]["prompt_logprobs"][0] is None
    assert len(body["choices"][0]["prompt_logprobs"]) == n_prompt
    r = await chat(logprobs=True, top_logprobs=2)
    assert len(r.choices[0].logprobs.content) == 8
    r = await chat(return_token_ids=True)
    assert len(r.choices[0].model_extra["token_ids"]) == 8
    r = await comp(logprobs=1, return_tokens_as_token_ids=True)
    assert all(t.startswith("token_id:") for t in r.choices[0].logprobs.tokens)
    r = await chat(
        messages=[*MSGS, {"role": "assistant", "content": "Costs"}],
        echo=True,
        continue_final_message=True,
        add_generation_prompt=False,
    )
    assert r.choices[0].message.content.startswith("Costs")
    seen |= {
        "n", "echo", "logprobs", "top_logprobs", "prompt_logprobs", "return_token_ids",
        "return_tokens_as_token_ids", "continue_final_message", "add_generation_prompt",
    }  # fmt: skip

    # request_id names the response
    r = await comp(request_id="abc-123")
    assert r.id == "cmpl-abc-123"
    seen.add("request_id")

    # truncation: keep the end (left, vLLM's default) or the start
    r = await comp(truncate_prompt_tokens=10)
    assert r.usage.prompt_tokens == 10
    left = (await comp(truncate_prompt_tokens=10, echo=True, max_tokens=0)).choices[0].text
    right = (
        (await comp(truncate_prompt_tokens=10, truncation_side="right", echo=True, max_tokens=0))
        .choices[0]
        .text
    )
    assert PROMPT.endswith(left) and len(left) == 10
    assert PROMPT.startswith(right) and len(right) == 9  # the BOS is the first of the 10
    seen |= {"truncate_prompt_tokens", "truncation_side"}

    # streaming, usage, continuous usage, stream_interval
    stream = await comp(
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        max_tokens=6,
        stream_interval=2,
    )
    chunks = [ch async for ch in stream]
    content = [ch for ch in chunks if ch.choices and ch.choices[0].text]
    assert [ch.usage.completion_tokens for ch in content] == [2, 4, 6]
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices
    seen |= {"stream", "stream_options", "stream_interval"}

    # template inputs change the prompt the same way in the router and the worker
    for kw in (
        {"tools": TOOLS},
        {"tools": TOOLS, "tool_choice": "required"},
        {"documents": [{"title": "t", "text": "body"}]},
        {"chat_template_kwargs": {"enable_thinking": True}},
        {"reasoning_effort": "low"},
    ):
        rr = await chat(**kw)
        assert rr.usage.prompt_tokens > plain.usage.prompt_tokens, kw
        async with aiohttp.ClientSession() as s:
            body = {"model": "m", "messages": MSGS, **kw}
            async with s.post(router.url + "/tokenize", json=body) as resp:
                assert (await resp.json())["count"] == rr.usage.prompt_tokens, kw
        seen |= set(kw)

    # cache_salt: a salted prompt is cached in its own key space, and the router knows it
    salted = PROMPT + " salted"
    await comp(prompt=salted, cache_salt="tenant-a")
    hit = await comp(prompt=salted, cache_salt="tenant-a")
    miss = await comp(prompt=salted, cache_salt="tenant-b")
    assert hit.usage.prompt_tokens_details.cached_tokens > 100
    assert miss.usage.prompt_tokens_details.cached_tokens == 0

    async def predicted(salt: str) -> int:
        q = {"model": "m", "prompt": salted + " again", "cache_salt": salt}
        async with aiohttp.ClientSession() as s, s.post(router.url + "/debug/route", json=q) as x:
            return (await x.json())["predicted_cached_tokens"]

    for _ in range(200):  # the salted blocks reach the router's index replica
        if await predicted("tenant-a") > 0:
            break
        await asyncio.sleep(0.05)
    assert await predicted("tenant-a") == hit.usage.prompt_tokens_details.cached_tokens
    assert await predicted("tenant-c") == 0  # (tenant-b cached its own copy above)
    seen.add("cache_salt")

    assert APPLIED - seen == set()
