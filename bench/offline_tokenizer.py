"""Write a local HuggingFace tokenizer folder equal to kvgate's default byte-level tokenizer,
for benchmark clients that need one (guidellm ``--processor``, aiperf ``--tokenizer``) on a
machine without network: ``python -m bench.offline_tokenizer DIR``.

Invariant: for every text, ``HFTokenizer(DIR).encode(text) == ByteTokenizer().encode(text)``
(token id = UTF-8 byte value, no special tokens added), and its chat template renders exactly
:func:`services.common.tokenizer.default_chat_template` (messages, tools and documents after
the system prompt, generation prompt), so a client counting tokens with it, the router and the
simulated workers all count the same tokens, whichever of the two tokenizers each one loads.
The folder has ``tokenizer.json`` and ``tokenizer_config.json`` (``PreTrainedTokenizerFast``),
which ``transformers.AutoTokenizer`` loads offline.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# kvgate's default chat template (services.common.tokenizer.default_chat_template) in Jinja,
# for HuggingFace's renderer (trim_blocks, lstrip_blocks; its tojson is json.dumps)
CHAT_TEMPLATE = (
    "{%- set ns = namespace(msgs=messages, out='') -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.out = '<|system|>\\n' + messages[0]['content'] + '\\n' -%}"
    "{%- set ns.msgs = messages[1:] -%}"
    "{%- endif -%}"
    "{%- if tools -%}{%- set ns.out = ns.out + '<|tools|>\\n' + (tools | tojson(sort_keys=true))"
    " + '\\n' -%}{%- endif -%}"
    "{%- if documents -%}{%- set ns.out = ns.out + '<|documents|>\\n'"
    " + (documents | tojson(sort_keys=true)) + '\\n' -%}{%- endif -%}"
    "{%- for m in ns.msgs -%}"
    "{%- set ns.out = ns.out + '<|' + m['role'] + '|>\\n' + (m['content'] or '') -%}"
    "{%- if not (loop.last and continue_final_message) -%}{%- set ns.out = ns.out + '\\n' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt and not continue_final_message -%}"
    "{%- set ns.out = ns.out + '<|assistant|>\\n' -%}{%- endif -%}"
    "{{ ns.out }}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character map of byte-level BPE (GPT-2's), which the ByteLevel
    pre-tokenizer and decoder use."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


def write(folder: Path, model_max_length: int = 8192) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}  # token id = byte value
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": model_max_length,
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.offline_tokenizer",
        description="write a local HuggingFace tokenizer folder equal to kvgate's byte-level "
        "tokenizer (for guidellm --processor / aiperf --tokenizer without network)",
    )
    ap.add_argument("folder", type=Path, help="directory to write (created if missing)")
    ap.add_argument(
        "--model-max-length", type=int, default=8192, help="context length to declare (8192)"
    )
    args = ap.parse_args(argv)
    print(write(args.folder, args.model_max_length))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
