"""Operator-facing CLI behaviour: --version, readable --help placeholders and defaults,
`kvgate alerts tail` without a NATS server, no RuntimeDirWarning from the embedded Postgres."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from services.cli import main
from services.common.embedded import env_without_proxy, free_port


def _run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or env_without_proxy(),
        cwd=cwd,
    )


def test_version(capsys) -> None:
    assert main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("kvgate ") and out.split()[1][0].isdigit(), out


def test_up_help_shows_placeholders_not_option_names(capsys) -> None:
    try:
        main(["up", "--help"])
    except SystemExit:
        pass
    out = capsys.readouterr().out
    assert "--nats-url UP_NATS_URL" not in out and "--router-port ROUTER_PORT" not in out
    assert "--nats-url URL" in out and "--router-port PORT" in out and "--workers N" in out


def test_bench_help_shows_defaults(capsys) -> None:
    try:
        main(["bench", "--help"])
    except SystemExit:
        pass
    out = " ".join(capsys.readouterr().out.split())
    assert "simulated workers (default: 8)" in out
    assert "(default: 120.0)" in out  # --timeout


def test_alerts_tail_without_nats_is_one_clear_error(tmp_path: Path) -> None:
    env = env_without_proxy()
    env["KVGATE_NATS_URL"] = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    r = _run("alerts", "tail", env=env, cwd=tmp_path, timeout=30)
    elapsed = time.monotonic() - t0
    assert r.returncode == 1
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr  # no retry loop
    assert "no NATS server at" in lines[0] and "kvgate up" in lines[0]
    assert elapsed < 15


def test_embedded_postgres_import_prints_no_runtime_dir_warning() -> None:
    env = env_without_proxy()
    env.pop("XDG_RUNTIME_DIR", None)  # what makes platformdirs warn
    code = "from services.common.embedded import import_pgserver; import_pgserver()"
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert "RuntimeDirWarning" not in r.stderr, r.stderr
