"""The engines' P/D handshake fields, read from their own code.

    python -m tests.tools.pd_conformance [--cache-dir DIR] [--record]

Downloads the vLLM 0.33.0 and SGLang 0.5.23 wheels (``pip download --no-deps``, into a cache
directory outside the repository, as tests/tools/engine_conformance.py does), and reads with
``ast`` (nothing is imported or run):

- vLLM's NIXL connector (``nixl/pull_scheduler.py``, ``nixl/base_scheduler.py``): every
  ``kv_transfer_params`` key it reads (``params.get("...")``, ``params["..."]``,
  ``"..." in params``), the keys of the dict a finished prefill returns
  (``request_finished``), and the default ``kv_lease_duration``; which OpenAI protocol classes
  carry a top-level ``kv_transfer_params``; the ``kv_role`` values (``config/kv_transfer.py``);
- SGLang's OpenAI protocol: which request classes carry ``bootstrap_host`` /
  ``bootstrap_port`` / ``bootstrap_room``; the ``disaggregation_mode`` values and the default
  ``disaggregation_bootstrap_port`` (``arg_groups/fields/disagg.py``).

Without ``--record`` it compares them with ``tests/fixtures/engine_pd/facts.json`` (exit 1 on
a difference); with it, writes that file. tests/test_pd_conformance.py checks the fields our
router and simulated worker send and read against the recorded facts, offline.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "engine_pd" / "facts.json"
VLLM = ("vllm", "0.33.0")
SGLANG = ("sglang", "0.5.23")
NIXL = "vllm/distributed/kv_transfer/kv_connector/v1/nixl/"
MEMBERS = {
    VLLM: (
        NIXL + "pull_scheduler.py",
        NIXL + "base_scheduler.py",
        "vllm/entrypoints/openai/chat_completion/protocol.py",
        "vllm/entrypoints/openai/completion/protocol.py",
        "vllm/config/kv_transfer.py",
    ),
    SGLANG: (
        "sglang/srt/entrypoints/openai/protocol.py",
        "sglang/srt/arg_groups/fields/disagg.py",
    ),
}


def fetch(cache: Path, name: str, version: str) -> dict[str, str]:
    """The members' source (downloaded once into ``cache``)."""
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"{name}-{version}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"{name}=={version}"]
        subprocess.run([*cmd, "-d", str(wheels)], check=True)
        found = sorted(wheels.glob(f"{name}-{version}-*.whl"))
    with zipfile.ZipFile(found[0]) as z:
        return {m: z.read(m).decode() for m in MEMBERS[(name, version)]}


def _str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def params_read(src: str) -> set[str]:
    """Keys read from a variable named ``params`` (the request's kv_transfer_params)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(src)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "params"
            and node.args
            and (k := _str(node.args[0]))
        ):
            out.add(k)
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id == "params"
            and (k := _str(node.slice))
        ):
            out.add(k)
        elif (
            isinstance(node, ast.Compare)
            and len(node.ops) == 1
            and isinstance(node.ops[0], ast.In)
            and isinstance(node.comparators[0], ast.Name)
            and node.comparators[0].id == "params"
        ):
            left = node.left
            if k := _str(left):
                out.add(k)
        elif isinstance(node, ast.GeneratorExp):  # all(p in params for p in ("a", "b"))
            elt = node.elt
            if (
                isinstance(elt, ast.Compare)
                and isinstance(elt.comparators[0], ast.Name)
                and elt.comparators[0].id == "params"
            ):
                for gen in node.generators:
                    if isinstance(gen.iter, ast.Tuple):
                        out.update(k for e in gen.iter.elts if (k := _str(e)))
    return {k for k in out if not k.startswith("_")}  # private bookkeeping keys


def finished_params(src: str) -> list[str]:
    """Keys of the ``dict(...)`` that ``request_finished`` returns (a prefill's answer)."""
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.FunctionDef) and node.name == "request_finished":
            for sub in ast.walk(node):
                if (
                    isinstance(sub, ast.Call)
                    and isinstance(sub.func, ast.Name)
                    and sub.func.id == "dict"
                    and sub.keywords
                ):
                    return [k.arg for k in sub.keywords if k.arg]
    raise SystemExit("request_finished's dict not found")


def extra_config_default(src: str, key: str) -> Any:
    for node in ast.walk(ast.parse(src)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get_from_extra_config"
            and node.args
            and _str(node.args[0]) == key
        ):
            return ast.literal_eval(node.args[1])
    raise SystemExit(f"{key} not found")


def classes_with_field(src: str, fields: tuple[str, ...]) -> dict[str, list[str]]:
    """Per field, the classes that declare it (an annotated class attribute)."""
    out: dict[str, list[str]] = {f: [] for f in fields}
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if (
                    isinstance(stmt, ast.AnnAssign)
                    and isinstance(stmt.target, ast.Name)
                    and stmt.target.id in out
                ):
                    out[stmt.target.id].append(node.name)
    return {f: sorted(v) for f, v in out.items()}


def subclasses(src: str, base: str) -> list[str]:
    """Classes that list ``base`` among their bases (directly)."""
    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ClassDef):
            names = {b.id for b in node.bases if isinstance(b, ast.Name)}
            if base in names:
                out.append(node.name)
    return sorted(out)


def literal_values(src: str, name: str) -> list[str]:
    """The string constants of the Literal[...] assigned to / annotating ``name``."""
    for node in ast.walk(ast.parse(src)):
        target = None
        value = None
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            target, value = node.target.id, node.annotation
        if target == name and value is not None:
            vals = [
                c.value
                for c in ast.walk(value)
                if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value.islower()
            ]
            lits = [v for v in vals if " " not in v]
            if lits:
                return lits
    raise SystemExit(f"Literal {name} not found")


def field_default(src: str, name: str) -> Any:
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.target.id == name and node.value is not None:
                return ast.literal_eval(node.value)
    raise SystemExit(f"{name} not found")


def facts(cache: Path) -> dict[str, Any]:
    v = fetch(cache, *VLLM)
    g = fetch(cache, *SGLANG)
    pull, base = v[NIXL + "pull_scheduler.py"], v[NIXL + "base_scheduler.py"]
    chat = classes_with_field(
        v["vllm/entrypoints/openai/chat_completion/protocol.py"], ("kv_transfer_params",)
    )
    comp = classes_with_field(
        v["vllm/entrypoints/openai/completion/protocol.py"], ("kv_transfer_params",)
    )
    kvt = v["vllm/config/kv_transfer.py"]
    boot = classes_with_field(
        g["sglang/srt/entrypoints/openai/protocol.py"],
        ("bootstrap_host", "bootstrap_port", "bootstrap_room"),
    )
    disagg = g["sglang/srt/arg_groups/fields/disagg.py"]
    holders = sorted({c for v in boot.values() for c in v})
    inherit = {h: subclasses(g["sglang/srt/entrypoints/openai/protocol.py"], h) for h in holders}
    return {
        f"vllm-{VLLM[1]}": {
            "source": [NIXL + "pull_scheduler.py", NIXL + "base_scheduler.py"],
            "kv_transfer_params_read": sorted(params_read(pull) | params_read(base)),
            "prefill_answer_params": finished_params(pull),
            "kv_lease_duration_default_s": extra_config_default(base, "kv_lease_duration"),
            "classes_with_kv_transfer_params": sorted(
                chat["kv_transfer_params"] + comp["kv_transfer_params"]
            ),
            "kv_roles": sorted(
                set(literal_values(kvt, "KVProducer") + literal_values(kvt, "KVConsumer"))
            ),
        },
        f"sglang-{SGLANG[1]}": {
            "source": list(MEMBERS[SGLANG]),
            "classes_with_bootstrap_fields": boot,
            "requests_inheriting_them": inherit,
            "disaggregation_modes": literal_values(disagg, "disaggregation_mode"),
            "disaggregation_bootstrap_port_default": field_default(
                disagg, "disaggregation_bootstrap_port"
            ),
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--cache-dir",
        default=os.path.expanduser("~/.cache/kvgate-conformance"),
        help="where the engine wheels are downloaded (outside the repository)",
    )
    ap.add_argument("--record", action="store_true", help=f"write {FIXTURE}")
    args = ap.parse_args()
    got = facts(Path(args.cache_dir))
    text = json.dumps(got, indent=2, sort_keys=True) + "\n"
    if args.record:
        FIXTURE.parent.mkdir(parents=True, exist_ok=True)
        FIXTURE.write_text(text)
        print(f"recorded {FIXTURE}")
        return 0
    want = json.loads(FIXTURE.read_text())
    if want != got:
        print("the engines' P/D fields differ from the recorded facts:")
        print(text)
        return 1
    print("the engines' P/D fields match tests/fixtures/engine_pd/facts.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
