"""``kvgate tenants``: every subcommand against the real admin API (real Postgres, real NATS),
its ``--help``, and its errors (the API's error shown, nonzero exit status)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

import services
from services import cli
from services.api.testing import start_api
from services.common.embedded import free_port

SUBCOMMANDS = (
    [],
    ["list"],
    ["show"],
    ["create"],
    ["update"],
    ["delete"],
    ["keys"],
    ["keys", "list"],
    ["keys", "create"],
    ["keys", "revoke"],
    ["usage"],
)


def _run(argv: list[str]) -> int:
    try:
        return cli.main(["tenants", *argv])
    except SystemExit as exc:  # argparse: --help (0) and bad arguments (2)
        return int(exc.code or 0)


async def kvgate(*argv: str) -> tuple[int, str, str]:
    """``kvgate tenants ARGV`` as a user runs it: its own process (environment inherited)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli",
        "tenants",
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(services.__file__).parents[1])},
    )
    out, err = await proc.communicate()
    return int(proc.returncode or 0), out.decode(), err.decode()


@pytest.mark.parametrize("argv", SUBCOMMANDS, ids=lambda a: " ".join(a) or "tenants")
def test_every_subcommand_has_help(argv: list[str], capsys) -> None:
    assert _run([*argv, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvgate tenants"), out
    if argv in (["create"], ["update"]):
        assert "--cache-budget-blocks" in out and "--rpm" in out


def test_bad_arguments_exit_2(capsys) -> None:
    assert _run(["create", "x", "--rpm", "lots"]) == 2
    assert "not a whole number" in capsys.readouterr().err
    assert _run(["usage", "x", "--since", "yesterday"]) == 2


@pytest.fixture
def _no_stack(tmp_path, monkeypatch) -> None:
    """No running 'kvgate up' is found (its state dir is empty)."""
    monkeypatch.setenv("KVGATE_STATE_DIR", str(tmp_path))


async def test_tenants_cli_against_the_admin_api(
    database_url, nats_url, subject_prefix, monkeypatch, _no_stack
) -> None:
    api = await start_api(database_url, nats_url, subject_prefix)
    monkeypatch.setenv("KVGATE_API_URL", api.url)
    monkeypatch.setenv("KVGATE_API_TOKEN", api.admin)
    try:
        rc, out, err = await kvgate(
            "create",
            "cli-a",
            "--weight",
            "2",
            "--priority",
            "critical",
            "--rpm",
            "600",
            "--cache-budget-blocks",
            "500",
            "--description",
            "team a",
        )
        assert (rc, out.strip()) == (0, "created tenant cli-a (version 1)"), err
        _, t = await api.call("GET", "/api/v1/tenants/cli-a")
        assert t["spec"]["weight"] == 2 and t["spec"]["default_priority"] == "critical"
        assert t["spec"]["quota"]["cache_budget_blocks"] == 500 and t["description"] == "team a"

        # the API's errors, shown, exit 1: a duplicate, a bad budget
        rc, _, err = await kvgate("create", "cli-a")
        assert rc == 1 and "409" in err and "exists" in err, err
        rc, _, err = await kvgate("create", "cli-b", "--cache-budget-blocks", "0")
        assert rc == 1 and "400 invalid_body" in err and "cache_budget_blocks" in err, err
        assert (await api.call("GET", "/api/v1/tenants/cli-b"))[0] == 404

        rc, out, _ = await kvgate("list")
        row = next(line for line in out.splitlines() if line.startswith("cli-a "))
        assert "critical" in row and "rpm=600" in row and "cache blocks=500" in row, out
        rc, out, _ = await kvgate("list", "--json")
        assert "cli-a" in {t["tenant_id"] for t in json.loads(out)["tenants"]}

        # update: the flags given change, the rest stays; none clears a limit
        rc, out, err = await kvgate(
            "update", "cli-a", "--cache-budget-blocks", "800", "--rpm", "none"
        )
        assert (rc, out.strip()) == (0, "updated tenant cli-a (version 2)"), err
        _, t = await api.call("GET", "/api/v1/tenants/cli-a")
        assert t["spec"]["quota"]["cache_budget_blocks"] == 800
        assert t["spec"]["quota"]["requests_per_min"] is None
        assert (t["spec"]["weight"], t["spec"]["default_priority"]) == (2, "critical")
        rc, _, err = await kvgate("update", "cli-a")
        assert rc == 1 and "nothing to change" in err
        rc, _, err = await kvgate("update", "cli-a", "--weight", "-1")
        assert rc == 1 and "400" in err and "weight" in err, err
        rc, out, _ = await kvgate("show", "cli-a")
        assert rc == 0 and "version       2 (of 2)" in out and "cache blocks=800" in out, out

        # keys: the secret printed once (stdout: the key alone), never listed
        rc, out, err = await kvgate(
            "keys", "create", "cli-a", "--name", "prod", "--priority", "standard"
        )
        key = out.strip()
        assert rc == 0 and key.startswith("kvt_") and "not shown again" in err
        rc, out, _ = await kvgate("keys", "list", "cli-a")
        assert rc == 0 and key not in out
        (row,) = [line for line in out.splitlines()[1:]]
        key_id = row.split()[0]
        assert "prod" in row and "active" in row and "standard" in row
        rc, out, _ = await kvgate("keys", "revoke", "cli-a", key_id)
        assert rc == 0 and out.strip() == f"key {key_id} of tenant cli-a: revoked"
        rc, _, err = await kvgate("keys", "revoke", "cli-a", "999999")
        assert rc == 1 and "404" in err

        # usage: a table, and the API's JSON
        rc, out, _ = await kvgate("usage", "cli-a", "--since", "1h", "--per-minute")
        assert rc == 0 and "requests" in out and "cache_blocks_held" in out and "800" in out
        rc, out, _ = await kvgate("usage", "cli-a", "--json")
        u = json.loads(out)
        assert u["tenant_id"] == "cli-a" and u["cache_budget_blocks"] == 800
        assert u["over_cache_budget"] is False

        # a viewer reads but may not change; a wrong token is 401
        monkeypatch.setenv("KVGATE_API_TOKEN", api.viewer)
        assert (await kvgate("show", "cli-a"))[0] == 0
        rc, _, err = await kvgate("delete", "cli-a", "--yes")
        assert rc == 1 and "403" in err, err
        monkeypatch.setenv("KVGATE_API_TOKEN", "kvg_wrong")
        rc, _, err = await kvgate("list")
        assert rc == 1 and "401" in err and "KVGATE_API_TOKEN" in err and "kvg_wrong" not in err
        monkeypatch.setenv("KVGATE_API_TOKEN", api.admin)

        # delete: asks for --yes
        rc, _, err = await kvgate("delete", "cli-a")
        assert rc == 1 and "--yes" in err
        assert (await api.call("GET", "/api/v1/tenants/cli-a"))[0] == 200
        rc, out, _ = await kvgate("delete", "cli-a", "--yes")
        assert rc == 0 and "deleted tenant cli-a" in out
        rc, _, err = await kvgate("show", "cli-a")
        assert rc == 1 and "404" in err

        # nothing listening
        monkeypatch.setenv("KVGATE_API_URL", f"http://127.0.0.1:{free_port()}")
        rc, _, err = await kvgate("list")
        assert rc == 1 and "no admin API answers" in err
    finally:
        await api.close()


async def test_update_refused_when_the_tenant_changed_since_it_was_read(
    database_url, nats_url, subject_prefix, monkeypatch, capsys, _no_stack
) -> None:
    """Another writer's update lands between the CLI's read and its write: the CLI's PUT
    (If-Match: the version it read) is refused, exit 1 with the reason, and the other
    writer's change stands. The race is made real: the CLI's client makes the other update
    through the API right after its GET, and the CLI runs in a thread so this loop serves."""
    from services.api import tenants_cli

    api = await start_api(database_url, nats_url, subject_prefix)
    monkeypatch.setenv("KVGATE_API_URL", api.url)
    monkeypatch.setenv("KVGATE_API_TOKEN", api.admin)
    try:
        rc, _, err = await kvgate("create", "race", "--rpm", "100")
        assert rc == 0, err
        rc, out, err = await kvgate("update", "race", "--rpm", "150")  # no race: version 2
        assert (rc, out.strip()) == (0, "updated tenant race (version 2)"), err

        class OtherWriterAfterRead(tenants_cli.Client):
            def exchange(self, method, path, body=None, headers=None):
                answer = super().exchange(method, path, body, headers)
                if method == "GET":  # the other writer, between this read and the write
                    super().exchange("PUT", path, {"spec": {"weight": 3.0}})
                return answer

        real = tenants_cli.connection
        monkeypatch.setattr(
            tenants_cli, "connection", lambda _args: OtherWriterAfterRead(api.url, api.admin)
        )
        rc = await asyncio.to_thread(cli.main, ["tenants", "update", "race", "--rpm", "200"])
        err = capsys.readouterr().err
        assert rc == 1, err
        assert "changed by someone else since it was read (version 2)" in err, err
        assert "run it again" in err
        _, t = await api.call("GET", "/api/v1/tenants/race")
        # the other writer's spec (weight 3, no quota) is version 3; the CLI's rpm is not in
        assert (t["version"], t["spec"]["weight"]) == (3, 3.0), t
        assert t["spec"]["quota"]["requests_per_min"] is None, t

        # run again (no one in between): it applies over the current version
        monkeypatch.setattr(tenants_cli, "connection", real)
        rc, out, err = await kvgate("update", "race", "--rpm", "200")
        assert (rc, out.strip()) == (0, "updated tenant race (version 4)"), err
        _, t = await api.call("GET", "/api/v1/tenants/race")
        assert (t["spec"]["weight"], t["spec"]["quota"]["requests_per_min"]) == (3.0, 200)
    finally:
        await api.close()
