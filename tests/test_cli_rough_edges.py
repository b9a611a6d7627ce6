"""Operator CLIs as a new operator meets them (issue 41's rough edges), run as subprocesses
against the real NATS and Postgres: `kvgate alerts tail` says where it is connected and exits
quietly on Ctrl-C, `kvgate index verify` explains a missing indexer, `kvgate api token create`
names the real database error."""

from __future__ import annotations

import selectors
import signal
import subprocess
import sys
from pathlib import Path

from services.common.bus import Bus
from services.common.embedded import env_without_proxy


def _popen(*args: str, env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
    )


def _first_stderr_line(proc: subprocess.Popen[str], timeout: float = 30) -> str:
    """The first line the CLI writes to stderr, waiting for it at most ``timeout`` seconds."""
    assert proc.stderr is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stderr, selectors.EVENT_READ)
        assert sel.select(timeout), "nothing on stderr"
    return proc.stderr.readline()


def _run(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=cwd,
    )


def test_alerts_tail_says_it_is_connected_and_exits_quietly_on_ctrl_c(
    nats_url: str, subject_prefix: str, bus: Bus, tmp_path: Path
) -> None:
    env = env_without_proxy()
    env.update(KVGATE_NATS_URL=nats_url, KVGATE_SUBJECT_PREFIX=subject_prefix)
    proc = _popen("alerts", "tail", "--color", "never", env=env, cwd=tmp_path)
    try:
        first = _first_stderr_line(proc)  # written once the subscription is live
        assert "connected to" in first and "following alerts from now on" in first, first
        assert "(from --nats-url / KVGATE_NATS_URL)" in first, first
        proc.send_signal(signal.SIGINT)  # the operator's Ctrl-C
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err
    assert "bus disconnected" not in err, err
    assert out == ""


def test_alerts_tail_without_a_stack_says_it_uses_the_default_url(tmp_path: Path) -> None:
    env = env_without_proxy()
    for var in ("KVGATE_NATS_URL", "KVGATE_STATE_DIR"):
        env.pop(var, None)
    # cwd has no ./.kvgate: whatever answers (or not) on the default URL, it is said to be the
    # default and that no stack was found
    proc = _popen("alerts", "tail", "--color", "never", env=env, cwd=tmp_path)
    try:
        first = _first_stderr_line(proc)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert "nats://127.0.0.1:4222" in first, first
    assert "from the default; no running 'kvgate up' stack in .kvgate" in first, first
    assert "bus disconnected" not in err, err


def test_index_verify_without_an_indexer_gives_a_hint(
    nats_url: str, subject_prefix: str, tmp_path: Path
) -> None:
    env = env_without_proxy()
    env.update(KVGATE_NATS_URL=nats_url, KVGATE_SUBJECT_PREFIX=subject_prefix)
    r = _run("index", "verify", "--timeout", "5", env=env, cwd=tmp_path)
    assert r.returncode == 3, r.stderr
    assert "no responder" in r.stderr
    assert f"no indexer subscribed under subject prefix '{subject_prefix}'" in r.stderr
    assert "'kvgate indexer'" in r.stderr and "'kvgate status'" in r.stderr
    assert "bus disconnected" not in r.stderr, r.stderr


def test_api_token_create_names_the_real_database_error(
    fresh_database_url: str, tmp_path: Path
) -> None:
    from services.common.embedded import free_port

    base = fresh_database_url.rsplit("/", 1)[0]
    cases = {
        # no such database: not a migration problem
        f"{base}/kvgate_no_such_db_{free_port()}": "does not exist on the PostgreSQL at",
        # nothing listens: not a migration problem either
        f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/kvgate": "no PostgreSQL answers",
        # an empty database (never migrated): this one is
        fresh_database_url: "has no kvgate tables: run 'kvgate migrate'",
    }
    for url, expected in cases.items():
        env = env_without_proxy()
        env["KVGATE_DATABASE_URL"] = url
        r = _run("api", "token", "create", "--role", "viewer", env=env, cwd=tmp_path)
        assert r.returncode == 1, (url, r.stderr)
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("kvgate api token: ") and expected in last, (url, r.stderr)
        assert "did you run 'kvgate migrate'" not in r.stderr


def test_simulate_help_states_the_real_worker_range_defaults_and_policy_sets(capsys) -> None:
    import pytest

    from bench.common import BUILTIN_POLICIES
    from services.cli import main
    from services.core.policy import DEFAULT_POLICY, policy_names

    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "simulated engines, 1..4096 (default: 8)" in out
    assert "(8..512)" not in out and "every built-in" not in out
    # the router's default policy is in the default comparison, and every policy is named
    assert DEFAULT_POLICY["name"] in BUILTIN_POLICIES
    others = [n for n in policy_names() if n not in BUILTIN_POLICIES]
    assert f"default: these {len(BUILTIN_POLICIES)} ({', '.join(BUILTIN_POLICIES)})" in out
    assert f"the other {len(others)} run only when named ({', '.join(others)})" in out


def test_bench_against_a_running_router_records_its_workers_not_the_default() -> None:
    from bench.cli import target_workers
    from bench.metrics import RequestResult

    served = [RequestResult(f"r{i}", worker=f"w{i % 4}").to_dict() for i in range(20)]
    # a 4-worker stack: the answers' worker header says 4, not --workers' default of 8
    assert target_workers({}, served) == (4, "workers that served a request")
    urls = {f"w{i}": f"http://127.0.0.1:{9000 + i}" for i in range(5)}
    assert target_workers(urls, served) == (5, "--worker-urls")
    anonymous = [RequestResult(f"r{i}").to_dict() for i in range(3)]
    assert target_workers({}, anonymous)[0] is None


def test_readme_says_make_test_may_install_chromium() -> None:
    root = Path(__file__).resolve().parent.parent
    makefile = (root / "Makefile").read_text()
    installs = "apt-get install" in makefile and "chromium" in makefile
    readme = (root / "README.md").read_text()
    before_make_test = readme.split("```bash\nmake test", 1)[0].strip().rsplit("\n\n", 1)[-1]
    if installs:  # what `make test` does to the machine is said where it is shown
        assert "apt-get install chromium" in before_make_test, before_make_test
