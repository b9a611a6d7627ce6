"""Helpers shared by the deployment tests (compose.yaml, Dockerfile, docs/deploy.md), and
tests of the helpers themselves.

There is no Docker engine on the development machines, so the deployment files are checked
the way Compose reads them: YAML (merge keys resolved), then ``${VAR...}`` interpolation from
the environment / ``.env`` file, then the commands and settings the kvgate image will run.
"""

from __future__ import annotations

import argparse
import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys
import pytest
import yaml

from services.common.signing import Signer

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
ENV_EXAMPLE = ROOT / ".env.example"

# A fixed throwaway signing key for the api (the routers trust its public key).
TEST_SIGNING_SEED = nkeys.encode_seed(bytes(range(32)), nkeys.PREFIX_BYTE_ACCOUNT)

# Secrets .env.example leaves empty on purpose; tests supply throwaway values.
TEST_SECRETS = {
    "API_SIGNING_SEED": TEST_SIGNING_SEED.decode(),
    "API_SIGNING_PUBLIC_KEY": Signer(TEST_SIGNING_SEED).public_key,
    "POSTGRES_PASSWORD": "pw0123456789abcdef",
    "KVGATE_API_ADMIN_TOKEN": "tok-" + "a" * 32,
    "KVGATE_ROUTER_API_KEYS": "client-key-" + "c" * 24,
    **{
        f"NATS_PASSWORD_{role}": f"nats-{role.lower()}-0123456789"
        for role in (
            "API",
            "ROUTER",
            "INDEXER",
            "TELEMETRY",
            "OPERATOR",
            "PROVISIONER",
            *(f"WORKER_SIM_{i}" for i in range(8)),
        )
    },
    "GRAFANA_ADMIN_PASSWORD": "grafana-" + "b" * 16,
}
# Site-specific values the env examples leave empty (deploy/gpu-node.env.example).
TEST_SITE = {
    "KVGATE_NATS_URL": "nats://10.0.0.5:4222",
    "NODE_NAME": "gpu-node-1",
    "NODE_ADDRESS": "10.0.0.7",
    "MODEL": "meta-llama/Llama-3.1-8B-Instruct",
}


class InterpolationError(ValueError):
    """A required variable (``${VAR:?msg}``) is missing, or the syntax is invalid."""


_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<invalid>))"
)


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable interpolation: ``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-default}``,
    ``${VAR-default}``, ``${VAR:?error}``, ``${VAR?error}``, ``${VAR:+alt}``, ``${VAR+alt}``."""

    def sub(m: re.Match[str]) -> str:
        if m.group("escaped") is not None:
            return "$"
        if m.group("named") is not None:
            return env.get(m.group("named"), "")
        name = m.group("braced")
        if name is None:
            raise InterpolationError(f"invalid interpolation in {text!r}")
        op, arg = m.group("op"), m.group("arg") or ""
        value = env.get(name)
        unset_or_empty = value is None or (op is not None and op.startswith(":") and value == "")
        if op is None:
            return value or ""
        if op.endswith("-"):
            return arg if unset_or_empty else value
        if op.endswith("?"):
            if unset_or_empty:
                raise InterpolationError(f"required variable {name} is missing a value: {arg}")
            return value
        return "" if unset_or_empty else arg  # ':+' / '+'

    return _VAR.sub(sub, text)


def interpolate_tree(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {k: interpolate_tree(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate_tree(v, env) for v in node]
    return node


def referenced_variables(text: str) -> set[str]:
    """Names of the variables a compose file interpolates (``$$`` escapes excluded)."""
    names = set()
    for m in _VAR.finditer(text):
        name = m.group("braced") or m.group("named")
        if name:
            names.add(name)
    return names


def read_env_file(path: Path) -> dict[str, str]:
    """A Compose ``.env`` file: KEY=VALUE lines; '#' comments; optional quotes."""
    env: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ValueError(f"{path}: not KEY=VALUE: {raw!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def load_compose(path: Path = COMPOSE, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The compose file as Compose sees it, interpolated with ``.env.example`` + test secrets
    (or ``env``)."""
    if env is None:
        env = Project((COMPOSE,), ENV_EXAMPLE).example_env()
    return interpolate_tree(yaml.safe_load(path.read_text()), env)


def compose_files() -> list[Path]:
    """compose.yaml and the other compose files under deploy/."""
    return [COMPOSE, *sorted((ROOT / "deploy").glob("compose.*.yaml"))]


_REPLACED_SEQUENCES = {"command", "entrypoint", "test"}


def merge(base: Any, over: Any, key: str = "") -> Any:
    """Compose's override merge: mappings merge key by key; ``command``, ``entrypoint`` and
    health-check ``test`` are replaced; other sequences (ports, volumes, ...) are unioned;
    scalars are replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, value in over.items():
            out[k] = merge(base[k], value, k) if k in base else value
        return out
    if isinstance(base, list) and isinstance(over, list) and key not in _REPLACED_SEQUENCES:
        return base + [v for v in over if v not in base]
    return over


@dataclass(frozen=True)
class Project:
    """One way the compose files are used: compose.yaml alone, compose.yaml plus an override
    under deploy/ (a file without a top-level ``name``), or a project of its own under deploy/
    (with ``name``; its variables documented in deploy/<stem>.env.example)."""

    files: tuple[Path, ...]
    env_example: Path

    @property
    def label(self) -> str:
        return " + ".join(str(f.relative_to(ROOT)) for f in self.files)

    def raw(self) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        for f in self.files:
            doc = merge(doc, yaml.safe_load(f.read_text()))
        return doc

    def variables(self) -> set[str]:
        return set().union(*(referenced_variables(f.read_text()) for f in self.files))

    def example_env(self) -> dict[str, str]:
        """The env example, its empty required values filled with test values."""
        env = read_env_file(self.env_example)
        fill = {**TEST_SECRETS, **TEST_SITE}
        return {**env, **{k: v for k, v in fill.items() if k in env and not env[k]}}

    def load(self, env: dict[str, str] | None = None) -> dict[str, Any]:
        return interpolate_tree(self.raw(), self.example_env() if env is None else env)


def compose_projects() -> list[Project]:
    projects = [Project((COMPOSE,), ENV_EXAMPLE)]
    for path in compose_files()[1:]:
        if "name" in yaml.safe_load(path.read_text()):
            example = path.with_name(path.name.removeprefix("compose.").removesuffix(".yaml"))
            projects.append(Project((path,), example.with_suffix(".env.example")))
        else:
            projects.append(Project((COMPOSE, path), ENV_EXAMPLE))
    return projects


def kvgate_services(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Services that run the kvgate image (everything but NATS, Postgres, the gateway and
    engines)."""
    out = {}
    for name, svc in doc.get("services", {}).items():
        image = str(svc.get("image", ""))
        if "build" in svc or image.split(":")[0].endswith("kvgate"):
            out[name] = svc
    return out


def command_of(svc: dict[str, Any]) -> list[str]:
    cmd = svc.get("command")
    assert isinstance(cmd, list) and cmd, f"command must be a non-empty list, got {cmd!r}"
    return [str(c) for c in cmd]


def environment_of(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def import_all_commands() -> None:
    """Import every command module so ALL_OPTIONS holds every option the code declares."""
    from services.cli import COMMANDS

    for module_name, _ in COMMANDS.values():
        importlib.import_module(module_name)
    # shared options that command modules may import lazily (inside functions)
    importlib.import_module("services.common.streams")


def command_env_vars(command: str) -> set[str]:
    """Environment variables the ``kvgate <command>`` reads: those of its module's OPTIONS and
    those its parser (and sub-parsers) name in their help, which ``settings.add_options``
    writes as ``[env KVGATE_...; default ...]``."""
    from services.cli import COMMANDS, build_parser

    module = importlib.import_module(COMMANDS[command][0])
    found = {opt.env_var for opt in getattr(module, "OPTIONS", ())}

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)
            elif action.help:
                found.update(re.findall(r"\[env (KVGATE_[A-Z0-9_]+)", action.help))

    walk(build_parser(command))
    return found


_URL = re.compile(r"https?://(?P<host>[A-Za-z0-9_.\-]+):(?P<port>\d+)(?P<path>/[^'\"\s]*)")


def health_url(svc: dict[str, Any]) -> tuple[str, int, str]:
    """(host, port, path) of the URL a service's health check requests."""
    test = svc["healthcheck"]["test"]
    text = " ".join(test) if isinstance(test, list) else test
    m = _URL.search(text)
    assert m, f"no URL in health check {test!r}"
    return m.group("host"), int(m.group("port")), m.group("path")


# ------------------------------------------------------------------------------ self-tests


@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        ("a${X}b", {"X": "1"}, "a1b"),
        ("$X/$$Y", {"X": "1"}, "1/$Y"),
        ("${X:-d}", {"X": ""}, "d"),
        ("${X-d}", {"X": ""}, ""),
        ("${X-d}", {}, "d"),
        ("${X:?need X}", {"X": "v"}, "v"),
        ("${X:+alt}", {"X": "v"}, "alt"),
        ("${X:+alt}", {}, ""),
        ("${MISSING}", {}, ""),
    ],
)
def test_interpolate_follows_compose_rules(text: str, env: dict[str, str], expected: str) -> None:
    assert interpolate(text, env) == expected


def test_interpolate_refuses_a_missing_required_variable() -> None:
    with pytest.raises(InterpolationError, match="need X"):
        interpolate("${X:?need X}", {"X": ""})
    with pytest.raises(InterpolationError, match="need X"):
        interpolate("${X?need X}", {})


def test_read_env_file_parses_values_comments_and_quotes(tmp_path: Path) -> None:
    p = tmp_path / ".env"
    p.write_text("# c\nA=1\nB=\nC='x y'\n\n#D=4\n")
    assert read_env_file(p) == {"A": "1", "B": "", "C": "x y"}


def test_merge_follows_compose_override_rules() -> None:
    base = {"services": {"a": {"image": "x", "command": ["r"], "environment": {"A": "1"}}}}
    base["services"]["a"]["ports"] = ["1:1"]
    over = {"services": {"a": {"image": "y", "command": ["s"], "environment": {"B": "2"}}}}
    over["services"]["a"]["ports"] = ["1:1", "2:2"]
    over["services"]["b"] = {}
    assert merge(base, over) == {
        "services": {
            "a": {
                "image": "y",
                "command": ["s"],
                "environment": {"A": "1", "B": "2"},
                "ports": ["1:1", "2:2"],
            },
            "b": {},
        }
    }


def test_projects_cover_every_compose_file() -> None:
    projects = compose_projects()
    assert projects[0].files == (COMPOSE,)
    assert {f for p in projects for f in p.files} == set(compose_files())
    for p in projects:
        assert p.env_example.exists(), f"{p.label}: missing {p.env_example}"


def test_health_url_reads_host_port_and_path() -> None:
    svc = {"healthcheck": {"test": ["CMD", "python", "-c", "u.urlopen('http://sim:8100/health')"]}}
    assert health_url(svc) == ("sim", 8100, "/health")
