"""Tokenization for routing: the real HuggingFace loader on a tokenizer this test builds
itself (no downloads), its chat template, and long prompts tokenized off the event loop."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import aiohttp
from tokenizers import Tokenizer, models, pre_tokenizers

from services.common.bus import Bus
from services.common.tokenizer import ByteTokenizer, HFTokenizer
from services.core.keys import block_keys
from services.router.tokenize import RequestParser
from tests.test_router_support import Beats, FakeWorker, RouterProc

TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant :{% endif %}"
)


def build_tokenizer(root: Path) -> Path:
    words = "<unk> <s> </s> : user assistant system hello world you are a helpful bot".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"})
    )
    return root


async def test_router_uses_local_hf_tokenizer_and_chat_template(
    nats_url, subjects, bus: Bus, tmp_path
) -> None:
    path = build_tokenizer(tmp_path / "tok")
    hf = HFTokenizer(path)
    messages = [
        {"role": "system", "content": "you are a helpful bot"},
        {"role": "user", "content": "hello world"},
    ]
    rendered = hf.apply_chat_template(messages)
    assert rendered.startswith("<s> system : you are a helpful bot </s>")
    assert rendered.endswith("<s> assistant :")
    ids = hf.encode(rendered)
    assert 0 not in ids  # every word known: the template and the vocabulary agree
    w = await FakeWorker("w0").start(bus)
    beats = Beats(bus, [w]).start()
    router = await RouterProc(nats_url, subjects, tokenizer=str(path)).start()
    try:
        await router.wait_workers(1)
        async with aiohttp.ClientSession() as s:
            async with s.post(
                router.url + "/debug/route", json={"model": "m", "messages": messages}
            ) as r:
                d = await r.json()
        assert d["prompt_tokens"] == len(ids) == 18
        assert d["worker"] == "w0"
    finally:
        await router.stop()
        await beats.stop()
        await w.stop()


async def test_long_prompts_are_tokenized_off_the_event_loop() -> None:
    loop_thread = threading.get_ident()
    seen: list[int] = []

    class Recording(ByteTokenizer):
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            seen.append(threading.get_ident())
            return super().encode(text)

    parser = RequestParser(Recording(), offload_chars=1000)
    short = await parser.parse({"model": "m", "prompt": "x" * 10}, chat=False)
    long = await parser.parse({"model": "m", "prompt": "y" * 5000, "max_tokens": 7}, chat=False)
    assert seen[0] == loop_thread and seen[1] != loop_thread
    assert long.token_ids == list(b"y" * 5000) and long.max_tokens == 7 and short.max_tokens == 256
    assert RequestParser.keys(long, 16) == block_keys(long.token_ids, 16)
    # a cache salt changes the key space (same seed rule as the workers)
    salted = await parser.parse(
        {"model": "m", "prompt": "y" * 5000, "cache_salt": "tenant-a"}, chat=False
    )
    assert RequestParser.keys(salted, 16)[0] != RequestParser.keys(long, 16)[0]
