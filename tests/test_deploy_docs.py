"""docs/deploy.md stays true to the code and the deployment files: every variable, command,
port and file it names exists, and everything compose sets is documented."""

from __future__ import annotations

import re

import pytest

from services.cli import COMMANDS
from services.common import settings as S
from tests.test_deploy_compose import SERVICES
from tests.test_deploy_helpers import (
    ROOT,
    compose_projects,
    environment_of,
    import_all_commands,
    kvgate_services,
    read_env_file,
)

DOC = ROOT / "docs" / "deploy.md"


@pytest.fixture(scope="module")
def doc() -> str:
    import_all_commands()
    return DOC.read_text()


def test_every_kvgate_setting_named_in_the_guide_exists(doc: str) -> None:
    named = set(re.findall(r"\bKVGATE_[A-Z0-9_]*[A-Z0-9]\b", doc))
    compose_only = {v for p in compose_projects() for v in read_env_file(p.env_example)}
    unknown = sorted(named - set(S.ALL_OPTIONS) - compose_only)
    assert not unknown, f"docs/deploy.md names settings no command reads: {unknown}"


def test_everything_compose_sets_or_interpolates_is_documented(doc: str) -> None:
    for project in compose_projects():
        for name, svc in kvgate_services(project.load()).items():
            for var in environment_of(svc):
                assert f"`{var}" in doc or f" {var}" in doc, f"{name}: {var} undocumented"
        for var in read_env_file(project.env_example):
            assert f"`{var}`" in doc, f"{project.env_example.name}'s {var} is undocumented"


def test_commands_ports_and_files_named_in_the_guide_exist(doc: str) -> None:
    code = "\n".join(re.findall(r"```.*?```", doc, re.S) + re.findall(r"`([^`\n]+)`", doc))
    for cmd in set(re.findall(r"\bkvgate ([a-z][a-z-]+)", code)):
        assert cmd in COMMANDS, f"docs/deploy.md: no command `kvgate {cmd}`"
    for _, (_command, _var, port, path) in SERVICES.items():
        assert re.search(rf"\|\s*{port}\+?\s*\|", doc), f"port {port} missing from the table"
        assert path in doc
    for rel in set(re.findall(r"`((?:deploy|docs|services)/[\w./-]+)`", doc)) | {
        "compose.yaml",
        "Dockerfile",
        ".env.example",
    }:
        assert (ROOT / rel).exists(), f"docs/deploy.md names missing file {rel}"


def test_guide_gives_the_engine_flags_and_bridges(doc: str) -> None:
    vllm_flag = (
        """--kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq","""
        """"endpoint":"tcp://*:5557","""
    )
    assert vllm_flag in doc
    for engine in ("vllm", "sglang", "trtllm"):
        assert f"kvgate bridge {engine}" in doc
    assert "driver: nvidia" in doc and "NVIDIA Container Toolkit" in doc
