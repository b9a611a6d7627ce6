"""bench.offline_tokenizer writes a HuggingFace tokenizer folder that tokenizes and renders
chats exactly like kvgate's default byte-level tokenizer (what benchmark clients load)."""

from __future__ import annotations

import json

import pytest

from bench.offline_tokenizer import main
from services.common.tokenizer import ByteTokenizer, HFTokenizer, render_chat

TEXTS = ["hello world", "  two  spaces\n\ttab", "héllo ✓ 日本語", "x" * 5000, "!~\x00\x7f"]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": "é"}}}]
BODIES = [
    {"messages": [{"role": "user", "content": "hi"}]},
    {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}]},
    {
        "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}],
        "tools": TOOLS,
        "documents": [{"title": "t", "text": "d"}],
    },
    {"messages": [{"role": "user", "content": "q"}], "tools": TOOLS},
    {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Par"}],
        "continue_final_message": True,
    },
    {"messages": [{"role": "user", "content": "q"}], "add_generation_prompt": False},
]


@pytest.mark.parametrize("body", BODIES)
def test_folder_matches_the_byte_tokenizer(tmp_path, body) -> None:
    assert main([str(tmp_path / "tok")]) == 0
    cfg = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    hf, byte = HFTokenizer(tmp_path / "tok"), ByteTokenizer()
    for text in TEXTS:
        assert hf.encode(text) == byte.encode(text) == hf.encode(text, add_special_tokens=True)
        assert hf.decode(hf.encode(text)) == text
    assert render_chat(hf, body) == render_chat(byte, body)
