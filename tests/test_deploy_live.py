"""compose.yaml's services, run as compose would run them but without Docker.

NATS runs from deploy/nats.conf (the real nats-server binary, only its ports and store
directory changed), Postgres is the test server. Every kvgate service is started with its
compose command and environment; only what Docker's network would provide differently is
overridden: the NATS / Postgres addresses, the bind address (127.0.0.1) and the ports (free
ones). The compose health-check URLs must answer, the routers must see the simulated
workers, a chat completion must go through every router replica, and every service must
stop cleanly on SIGTERM (what `docker compose stop` sends) within its grace period.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.common.embedded import free_port
from tests.test_deploy_compose import HOST_VARS, SERVICES
from tests.test_deploy_helpers import (
    ROOT,
    TEST_SECRETS,
    command_of,
    environment_of,
    health_url,
    load_compose,
)

NO_PROXY = {"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _free_run(n: int) -> int:
    """A first port p such that p .. p+n-1 are all free on 127.0.0.1."""
    for _ in range(200):
        base = free_port()
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports")


@dataclass
class NatsServer:
    url: str
    http_port: int


@pytest.fixture(scope="module")
def compose_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """The compose NATS cluster as three local processes: each node runs deploy/nats.conf
    with its compose command's --name and --routes, rewritten to free local ports (client,
    monitoring, route) and its own store directory. ``url`` is the seed list, as in compose."""
    base = tmp_path_factory.mktemp("compose-nats")
    conf = (ROOT / "deploy" / "nats.conf").read_text()
    services = load_compose()["services"]
    nodes = [n for n in ("nats-1", "nats-2", "nats-3") if n in services]
    assert len(nodes) == 3
    ports = {n: (free_port(), free_port(), free_port()) for n in nodes}  # client, http, route
    server = Path(sys.executable).parent / "nats-server"
    procs = []
    for node in nodes:
        cmd = [str(x) for x in services[node]["command"]]
        name = cmd[cmd.index("--name") + 1]
        peers = [r.split("//")[1].split(":")[0] for r in cmd[cmd.index("--routes") + 1].split(",")]
        client, http, route = ports[node]
        node_conf, n = re.subn(r"store_dir:\s*\S+", f'store_dir: "{base / node}"', conf)
        assert n == 1
        (base / f"{node}.conf").write_text(node_conf)
        procs.append(
            subprocess.Popen(
                [
                    str(server),
                    "-c",
                    str(base / f"{node}.conf"),
                    "--name",
                    name,
                    "-p",
                    str(client),
                    "-m",
                    str(http),
                    "--cluster",
                    f"nats://127.0.0.1:{route}",
                    "--routes",
                    ",".join(f"nats://127.0.0.1:{ports[p][2]}" for p in peers),
                ],
                env={**os.environ, **TEST_SECRETS},  # the users' passwords, as compose passes them
                stdout=subprocess.DEVNULL,
                stderr=open(base / f"{node}.log", "wb"),  # noqa: SIM115 - closed with the process
            )
        )
    try:
        deadline = time.monotonic() + 30
        for node, proc in zip(nodes, procs, strict=True):
            while True:
                assert proc.poll() is None, (base / f"{node}.log").read_text()
                with contextlib.suppress(OSError):
                    if _get(f"http://127.0.0.1:{ports[node][1]}/healthz")[0] == 200:
                        break
                assert time.monotonic() < deadline, (base / f"{node}.log").read_text()
                time.sleep(0.1)
        url = ",".join(f"nats://127.0.0.1:{ports[n][0]}" for n in nodes)
        yield NatsServer(url, ports[nodes[0]][1])
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)


def test_nats_config_is_valid_and_its_health_check_reports_jetstream(
    compose_nats: NatsServer,
) -> None:
    server = Path(sys.executable).parent / "nats-server"
    check = subprocess.run(
        [str(server), "-t", "-c", str(ROOT / "deploy" / "nats.conf")],
        env={**os.environ, **TEST_SECRETS},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    _, _, path = health_url(load_compose()["services"]["nats-1"])
    status, body = _get(f"http://127.0.0.1:{compose_nats.http_port}{path}")
    assert status == 200 and json.loads(body)["status"] == "ok", body
    status, body = _get(f"http://127.0.0.1:{compose_nats.http_port}/jsz")
    jsz = json.loads(body)
    assert status == 200 and jsz["config"]["max_storage"] >= 1 << 30, jsz.get("config")


@dataclass
class Running:
    name: str
    proc: subprocess.Popen
    health: str
    log: Path
    port: int
    operator_health: str = ""  # a router's operator port /health (the public one: status only)


def _service_env(svc: dict, overrides: dict[str, str]) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KVGATE_") and k.lower() not in {"http_proxy", "https_proxy"}
    }
    env.update(NO_PROXY)
    env.update(environment_of(svc))
    env.update(overrides)
    env["KVGATE_LOG_FORMAT"] = "console"
    return env


def _grace_s(svc: dict) -> float:
    """A service's stop_grace_period in seconds (compose's default is 10 s)."""
    m = re.fullmatch(r"(\d+)s", str(svc.get("stop_grace_period", "10s")))
    assert m, svc.get("stop_grace_period")
    return float(m.group(1))


def _logs(running: list[Running]) -> str:
    """Each service's log, repeated lines (a retry loop) collapsed, the last 40 lines."""
    out = []
    for r in running:
        lines: list[str] = []
        repeats = 0
        for line in r.log.read_text(errors="replace").splitlines():
            msg = line[28:]  # without the timestamp
            if lines and lines[-1][28:] == msg:
                repeats += 1
                continue
            if repeats:
                lines.append(f"    (repeated {repeats} more times)")
                repeats = 0
            lines.append(line)
        if repeats:
            lines.append(f"    (repeated {repeats} more times)")
        out.append(f"--- {r.name}:{r.port}\n" + "\n".join(lines[-40:]))
    return "\n".join(out)


@pytest.mark.slow
def test_compose_services_come_up_route_and_stop_cleanly(
    compose_nats: NatsServer, fresh_database_url: str, tmp_path: Path
) -> None:
    compose = load_compose()
    services = compose["services"]
    # a private server: no subject prefix, so deploy/nats.conf's per-role permissions apply as
    # shipped (each service logs in as its compose user)
    common = {"KVGATE_NATS_URL": compose_nats.url, "KVGATE_SUBJECT_PREFIX": ""}
    seed_file = tmp_path / "api_signing_seed"
    seed_file.write_text(TEST_SECRETS["API_SIGNING_SEED"])

    def overrides(name: str, port: int) -> dict[str, str]:
        svc = services[name]
        out = dict(common)
        if "KVGATE_DATABASE_URL" in environment_of(svc):
            out["KVGATE_DATABASE_URL"] = fresh_database_url
            out["KVGATE_DATABASE_PASSWORD_FILE"] = ""  # the test database trusts local users
        if "KVGATE_SIGNING_SEED" in environment_of(svc):  # compose's secret file, written here
            out["KVGATE_SIGNING_SEED"] = str(seed_file)
        if "KVGATE_ROUTER_OPERATOR_PORT" in environment_of(svc):  # replicas share this host
            out["KVGATE_ROUTER_OPERATOR_PORT"] = str(free_port())
            out["KVGATE_ROUTER_OPERATOR_HOST"] = "127.0.0.1"
        if name in SERVICES:
            out[HOST_VARS[name]] = "127.0.0.1"
            out[SERVICES[name][1]] = str(port)
        if "KVGATE_SIM_ADVERTISE_HOST" in environment_of(svc):  # no Docker DNS here
            out["KVGATE_SIM_ADVERTISE_HOST"] = "127.0.0.1"
        return {k: v for k, v in out.items() if k in environment_of(svc) or k.endswith("_PORT")}

    kvgate = [sys.executable, "-m", "services.cli"]
    # the one-shot jobs first (the services wait for them to complete successfully): the
    # database migrations, and the streams, which no service's credential may create
    for job in ("migrate", "bus-provision"):
        done = subprocess.run(
            kvgate + command_of(services[job]),
            env=_service_env(services[job], overrides(job, 0)),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr

    sim_count = int(environment_of(services["sim"])["KVGATE_SIM_COUNT"])
    replicas = int(services["router"]["deploy"]["replicas"])
    plan = [("sim", _free_run(sim_count))]
    plan += [(name, free_port()) for name in ("kv-indexer-1", "kv-indexer-2", "telemetry", "api")]
    plan += [("router", free_port()) for _ in range(replicas)]
    running: list[Running] = []
    try:
        for i, (name, port) in enumerate(plan):
            svc = services[name]
            log = tmp_path / f"{i}-{name}.log"
            env = _service_env(svc, overrides(name, port))
            proc = subprocess.Popen(
                kvgate + command_of(svc),
                env=env,
                stdout=open(log, "wb"),  # noqa: SIM115 - the child owns it
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
            _, _, path = health_url(svc)
            running.append(Running(name, proc, f"http://127.0.0.1:{port}{path}", log, port))
            if "KVGATE_ROUTER_OPERATOR_PORT" in env:
                op = env["KVGATE_ROUTER_OPERATOR_PORT"]
                running[-1].operator_health = f"http://127.0.0.1:{op}/health"

        deadline = time.monotonic() + 60
        pending = list(running)
        while pending and time.monotonic() < deadline:
            for r in list(pending):
                assert r.proc.poll() is None, f"{r.name} exited\n{_logs(running)}"
                with contextlib.suppress(OSError):
                    if _get(r.health, 1.0)[0] == 200:
                        pending.remove(r)
            time.sleep(0.1)
        assert not pending, f"not healthy: {[r.name for r in pending]}\n{_logs(running)}"

        routers = [r for r in running if r.name == "router"]
        assert len(routers) == replicas >= 2
        for r in routers:  # each replica learns every worker from the heartbeats
            seen = 0
            while time.monotonic() < deadline:
                seen = int(json.loads(_get(r.operator_health)[1]).get("workers", 0))
                if seen >= sim_count:
                    break
                time.sleep(0.1)
            assert seen >= sim_count, f"router on {r.port} sees {seen} workers\n{_logs(running)}"
            body = json.dumps(
                {
                    "model": environment_of(services["sim"]).get(
                        "KVGATE_SIM_MODEL", "sim-llama-8b"
                    ),
                    "messages": [{"role": "user", "content": "hello from compose"}],
                    "max_tokens": 4,
                }
            ).encode()
            req = urllib.request.Request(
                f"http://127.0.0.1:{r.port}/v1/chat/completions",
                data=body,
                headers={
                    "Content-Type": "application/json",  # compose's client key is required
                    "Authorization": f"Bearer {TEST_SECRETS['KVGATE_ROUTER_API_KEYS']}",
                },
            )
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            with opener.open(req, timeout=30) as resp:
                answer = json.loads(resp.read())
            assert resp.status == 200 and answer["choices"], answer
    finally:
        for r in running:
            if r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
        codes = {}
        stop_deadline = time.monotonic() + _grace_s(services["router"])
        for r in running:
            try:
                codes[f"{r.name}:{r.port}"] = r.proc.wait(
                    max(0.1, stop_deadline - time.monotonic())
                )
            except subprocess.TimeoutExpired:
                r.proc.kill()
                codes[f"{r.name}:{r.port}"] = "killed"
    assert all(c == 0 for c in codes.values()), (
        f"exit codes after SIGTERM ('killed': still running after the "
        f"{_grace_s(services['router']):.0f} s stop_grace_period): {codes}\n{_logs(running)}"
    )
    # every service did its job within its role's NATS permissions (deploy/nats.conf)
    for r in running:
        text = r.log.read_text(errors="replace").lower()
        assert "permissions violation" not in text, f"{r.name}:\n{_logs([r])}"
        assert "authorization violation" not in text, f"{r.name}:\n{_logs([r])}"
