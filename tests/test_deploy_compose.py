"""compose.yaml, checked without a Docker engine.

- it validates against the Compose Specification JSON schema (the copy check-jsonschema
  vendors, so nothing is downloaded), and the validator does reject a broken file;
- .env.example supplies every variable, and the secrets only from the environment;
- every service's command answers ``--help`` in the installed package;
- every KVGATE_* variable a service sets is one its command reads, with a valid value;
- ports, bind addresses and health-check URLs agree with the services' defaults;
- start order: health checks behind every ``service_healthy``, the API after migrations.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.common import settings as S
from tests.test_deploy_helpers import (
    COMPOSE,
    ENV_EXAMPLE,
    ROOT,
    TEST_SECRETS,
    InterpolationError,
    command_env_vars,
    command_of,
    compose_files,
    compose_projects,
    environment_of,
    health_url,
    import_all_commands,
    interpolate_tree,
    kvgate_services,
    load_compose,
    read_env_file,
)

# What each long-running kvgate service is, independently of compose.yaml: the command, the
# variable holding its HTTP port, the port the docs and `kvgate up` use, its health path.
SERVICES = {
    "kv-indexer-1": ("indexer", "KVGATE_INDEXER_PORT", 8082, "/health"),
    "kv-indexer-2": ("indexer", "KVGATE_INDEXER_PORT", 8082, "/health"),
    "telemetry": ("telemetry", "KVGATE_TELEMETRY_PORT", 8083, "/health"),
    "router": ("router", "KVGATE_ROUTER_PORT", 8080, "/health"),
    "api": ("api", "KVGATE_API_PORT", 8081, "/api/v1/health"),
    "sim": ("sim-worker", "KVGATE_SIM_PORT", 8100, "/health"),
}
NATS_NODES = ("nats-1", "nats-2", "nats-3")  # the JetStream cluster (3 replicas per stream)
HOST_VARS = {
    "kv-indexer-1": "KVGATE_INDEXER_HOST",
    "kv-indexer-2": "KVGATE_INDEXER_HOST",
    "telemetry": "KVGATE_TELEMETRY_HOST",
    "router": "KVGATE_ROUTER_HOST",
    "api": "KVGATE_API_HOST",
    "sim": "KVGATE_SIM_HOST",
}


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose()


@pytest.fixture(scope="module", autouse=True)
def _all_options_loaded() -> None:
    import_all_commands()


def _check_jsonschema(*files: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            *map(str, files),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_compose_files_validate_against_the_compose_specification() -> None:
    result = _check_jsonschema(*compose_files())
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_schema_check_rejects_a_broken_compose_file(tmp_path: Path) -> None:
    """The validation above is not vacuous: a misspelt condition and an unknown key fail."""
    text = COMPOSE.read_text()
    assert "condition: service_completed_successfully" in text
    bad_condition = tmp_path / "bad-condition.yaml"
    bad_condition.write_text(
        text.replace("condition: service_completed_successfully", "condition: service_done")
    )
    bad_key = tmp_path / "bad-key.yaml"
    bad_key.write_text(text.replace("  init: true\n", "  init: true\n  replica: 2\n", 1))
    for bad in (bad_condition, bad_key):
        result = _check_jsonschema(bad)
        assert result.returncode == 1, f"{bad.name} passed validation:\n{result.stdout}"
        assert "services" in result.stdout


def test_env_example_documents_every_variable_and_secrets_are_required() -> None:
    for project in compose_projects():
        documented = set(read_env_file(project.env_example))
        used = project.variables()
        assert used <= documented, f"{project.label}: undocumented {used - documented}"
    example = read_env_file(ENV_EXAMPLE)
    # the secrets have no value in .env.example and nowhere else: compose must refuse to start
    for secret in TEST_SECRETS:
        assert example[secret] == "", f"{secret} has a value in .env.example"
        with pytest.raises(InterpolationError, match=secret):
            load_compose(env={**example, **{k: v for k, v in TEST_SECRETS.items() if k != secret}})


def test_no_secret_is_written_in_the_compose_files() -> None:
    for path in compose_files():
        raw = yaml.safe_load(path.read_text())
        for name, svc in raw.get("services", {}).items():
            for key, value in environment_of(svc).items():
                if key.endswith("_FILE") and value.startswith("/run/secrets/"):
                    continue  # a compose secret, mounted as a file
                if re.search(r"PASSWORD|TOKEN|SECRET", key):
                    # ${X:?why} (required) or ${X} / ${X:-} (optional): never a literal; a
                    # list of id=${X:?why} pairs (the simulated workers' own credentials)
                    variable = r"\$\{[A-Z0-9_]+(:\?[^}]+|:-)?\}"
                    pair = rf"[a-z0-9-]+={variable}"
                    assert re.fullmatch(variable, value) or re.fullmatch(
                        rf"{pair}(,{pair})*", value
                    ), f"{path.name}:{name}: {key} must come from a variable, no default"
                if "://" in value and "@" in value:  # credentials inside a URL
                    userinfo = value.split("://", 1)[1].split("@", 1)[0]
                    if ":" in userinfo:
                        assert re.search(r":\$\{[A-Z0-9_]+:\?", userinfo), (
                            f"{path.name}:{name}: {key} has a literal password"
                        )


def test_every_command_answers_help_in_the_installed_package() -> None:
    commands = {
        tuple(command_of(svc))
        for project in compose_projects()
        for svc in kvgate_services(project.load()).values()
    }
    assert {c[0] for c in commands} >= {"migrate", "indexer", "telemetry", "router", "api"}
    assert "sim-worker" in {c[0] for c in commands}
    kvgate = Path(sys.executable).parent / "kvgate"
    procs = {
        cmd: subprocess.Popen(
            [str(kvgate), *cmd, "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for cmd in commands
    }
    for cmd, proc in procs.items():
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, f"kvgate {' '.join(cmd)} --help failed: {err.decode()}"
        assert out.decode().startswith(f"usage: kvgate {cmd[0]}"), out.decode()[:200]


def test_every_kvgate_variable_is_read_by_the_service_command() -> None:
    checked = 0
    for project in compose_projects():
        where = project.label
        for name, svc in kvgate_services(project.load()).items():
            command = command_of(svc)[0]
            reads = command_env_vars(command)
            for var, value in environment_of(svc).items():
                assert var.startswith("KVGATE_"), f"{where}:{name}: stray variable {var}"
                assert var in S.ALL_OPTIONS, f"{where}:{name}: {var} is no kvgate setting"
                assert var in reads, f"{where}:{name}: `kvgate {command}` ignores {var}"
                opt = S.ALL_OPTIONS[var]
                resolved = S.resolve(None, [opt], environ={var: value})  # SystemExit if invalid
                assert getattr(resolved, opt.name) is not None
                checked += 1
    assert checked >= 15


def test_ports_hosts_and_health_checks_match_the_services(compose: dict) -> None:
    services = kvgate_services(compose)
    for name, (command, port_var, port, path) in SERVICES.items():
        svc = services[name]
        assert command_of(svc)[0] == command
        assert S.ALL_OPTIONS[port_var].default == port, f"{port_var} default changed"
        env = environment_of(svc)
        effective = int(env.get(port_var, port))
        assert effective == port, f"{name} listens on {effective}, documented {port}"
        host, hc_port, hc_path = health_url(svc)
        assert (hc_port, hc_path) == (port, path), f"{name} health check"
        assert env.get(HOST_VARS[name]) == "0.0.0.0", f"{name} must listen on all interfaces"
        assert host == "127.0.0.1", f"{name}: health check from inside its container"
        if name == "sim":
            # workers announce http://<advertised host>:<port> in heartbeats and the routers
            # (other containers) proxy there: it must be this container's name on the network
            assert env.get("KVGATE_SIM_ADVERTISE_HOST") == svc.get("hostname") == "sim"
    # published ports reach the services' container ports
    assert any(str(p).endswith(":8081") for p in compose["services"]["api"]["ports"])
    assert any(str(p).endswith(":8080") for p in compose["services"]["gateway"]["ports"])
    assert "ports" not in services["router"], "router replicas are reached through the gateway"
    # the router count is configurable and defaults to more than one; replicas tell their
    # loads apart by router id, so a replicated service must not pin one id for all
    assert int(compose["services"]["router"]["deploy"]["replicas"]) >= 2
    assert "KVGATE_ROUTER_ID" in S.ALL_OPTIONS
    assert "KVGATE_ROUTER_ID" not in environment_of(services["router"])


def test_the_indexers_are_a_highly_available_pair(compose: dict) -> None:
    """Two indexers by default, each with its own HA id (one lease per namespace decides which
    publishes); routers wait for both; Prometheus scrapes both."""
    services = kvgate_services(compose)
    indexers = sorted(n for n, svc in services.items() if command_of(svc)[0] == "indexer")
    assert indexers == ["kv-indexer-1", "kv-indexer-2"]
    ids = [environment_of(services[n]).get("KVGATE_INDEXER_HA_ID") for n in indexers]
    assert all(ids) and len(set(ids)) == 2, ids
    assert "KVGATE_INDEXER_HA_ID" in S.ALL_OPTIONS
    router_deps = compose["services"]["router"]["depends_on"]
    assert all(router_deps[n]["condition"] == "service_healthy" for n in indexers)
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = [
        t
        for job in prom["scrape_configs"]
        for c in job.get("static_configs", [])
        for t in c["targets"]
    ]
    assert {f"{n}:8082" for n in indexers} <= set(targets)


def test_gateway_balances_over_every_router_replica_on_the_router_port(compose: dict) -> None:
    cfg = (ROOT / "deploy" / "haproxy.cfg").read_text()
    router_port = SERVICES["router"][2]
    assert re.search(rf"^\s*server-template\s+\S+\s+\d+\s+router:{router_port}\b", cfg, re.M)
    # the gateway checks readiness (503 while a router starts or drains), not liveness
    assert re.search(r"^\s*option httpchk GET /ready\s*$", cfg, re.M)
    assert re.search(r"^\s*bind :8080\s*$", cfg, re.M)
    gateway = compose["services"]["gateway"]
    _, port, path = health_url(gateway)
    assert re.search(rf"^\s*bind :{port}\s*$", cfg, re.M) and path in cfg
    mounts = [str(v) for v in gateway["volumes"]]
    assert any(m.startswith("./deploy/haproxy.cfg:") for m in mounts)


def test_start_order_and_restart_policies(compose: dict) -> None:
    services = compose["services"]
    for name, svc in services.items():
        for dep, spec in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}'s health"
        if name not in ("migrate", "bus-provision"):  # the one-shot jobs
            assert svc.get("restart") in {"unless-stopped", "always"}, name
            assert "healthcheck" in svc, f"{name} has no health check"
    assert services["migrate"]["restart"] == "no"
    assert command_of(services["migrate"])[:1] == ["migrate"]
    # the streams are provisioned before any service uses them, by a job of its own
    assert services["bus-provision"]["restart"] == "no"
    assert command_of(services["bus-provision"]) == ["bus", "provision"]
    for name in ("kv-indexer-1", "kv-indexer-2", "telemetry", "router", "api", "sim"):
        dep = services[name]["depends_on"]["bus-provision"]
        assert dep["condition"] == "service_completed_successfully", name
    api_deps = services["api"]["depends_on"]
    assert api_deps["migrate"]["condition"] == "service_completed_successfully"
    assert api_deps["postgres"]["condition"] == "service_healthy"
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("kv-indexer-1", "kv-indexer-2", "telemetry", "router", "api", "sim"):
        for node in NATS_NODES:
            assert services[name]["depends_on"][node]["condition"] == "service_healthy", name
    assert services["sim"]["profiles"] == ["sim"]
    # every kvgate service talks to the compose NATS and Postgres by service name
    for name, svc in kvgate_services(compose).items():
        env = environment_of(svc)
        if name != "migrate":  # migrations need only the database
            assert env["KVGATE_NATS_URL"] == ",".join(f"nats://{n}:4222" for n in NATS_NODES)
        if "KVGATE_DATABASE_URL" in env:
            assert "@postgres:5432/" in env["KVGATE_DATABASE_URL"], name


def test_infrastructure_health_checks_and_volumes(compose: dict) -> None:
    pg = compose["services"]["postgres"]
    conf = (ROOT / "deploy" / "nats.conf").read_text()
    route_port = re.search(r"cluster\s*\{[^}]*port:\s*(\d+)", conf).group(1)
    for node in NATS_NODES:
        nats = compose["services"][node]
        _, port, path = health_url(nats)
        assert re.search(rf"^http_port:\s*{port}\s*$", conf, re.M)
        assert path.startswith("/healthz") and "js-enabled-only=true" in path
        store = re.search(r"store_dir:\s*(\S+)", conf).group(1)
        data_mount = next(str(v) for v in nats["volumes"] if str(v).startswith(f"{node}-data:"))
        assert store.startswith(data_mount.split(":")[1]), "JetStream must store on the volume"
        # a cluster node: its own name, routes to exactly the two others on the route port
        cmd = nats["command"]
        assert cmd[cmd.index("--name") + 1] == node
        routes = cmd[cmd.index("--routes") + 1].split(",")
        others = [n for n in NATS_NODES if n != node]
        assert routes == [f"nats://{n}:{route_port}" for n in others], node
    assert pg["healthcheck"]["test"][:2] == ["CMD", "pg_isready"]
    assert any(str(v).startswith("pg-data:/var/lib/postgresql/data") for v in pg["volumes"])
    assert set(compose["volumes"]) >= {f"{n}-data" for n in NATS_NODES} | {"pg-data"}


def test_raw_file_interpolates_without_a_dotenv_only_for_secrets() -> None:
    """With only the secrets exported (no .env at all), every other variable has a default."""
    doc = interpolate_tree(yaml.safe_load(COMPOSE.read_text()), dict(TEST_SECRETS))
    assert doc["services"]["router"]["deploy"]["replicas"] == "2"
    assert doc["services"]["kv-indexer-2"]["image"] == "kvgate:latest"


def test_nats_authorization_is_on_by_default_and_generated_from_the_code(compose: dict) -> None:
    """deploy/nats.conf is `kvgate nats-config`'s output (permissions follow the subjects), each
    NATS node gets every user's password, and every service that talks to NATS logs in as
    the user of its role."""
    from services.nats_config import password_vars, render

    conf = (ROOT / "deploy" / "nats.conf").read_text()
    assert conf == render(), "deploy/nats.conf is stale: kvgate nats-config > deploy/nats.conf"
    assert "authorization {" in conf
    node_envs = [environment_of(compose["services"][node]) for node in NATS_NODES]
    for node, env in zip(NATS_NODES, node_envs, strict=True):
        assert set(password_vars()) <= set(env), f"{node} needs every user's password"
    nats_env = node_envs[0]
    users = set(re.findall(r'\{user: "([^"]+)"', conf))
    expected = {"kv-indexer-1": "indexer", "kv-indexer-2": "indexer", "telemetry": "telemetry"}
    expected["router"] = "router"
    expected |= {"api": "api", "bus-provision": "provisioner"}
    for name, svc in kvgate_services(compose).items():
        env = environment_of(svc)
        if "KVGATE_NATS_URL" not in env or name.startswith("sim"):
            continue
        assert env.get("KVGATE_NATS_USER") == expected[name], name
        assert env["KVGATE_NATS_USER"] in users, name
        assert env["KVGATE_NATS_PASSWORD"] == nats_env[f"NATS_PASSWORD_{expected[name].upper()}"]
    # each simulated worker logs in as its own user, which may speak for that worker only
    sim = environment_of(compose["services"]["sim"])
    assert "KVGATE_NATS_USER" not in sim and "KVGATE_NATS_PASSWORD" not in sim
    pairs = dict(p.split("=", 1) for p in sim["KVGATE_SIM_WORKER_PASSWORDS"].split(","))
    assert sorted(pairs) == [f"sim-{i}" for i in range(8)]
    for wid, password in pairs.items():
        assert f"worker-{wid}" in users
        assert password == nats_env[f"NATS_PASSWORD_WORKER_{wid.upper().replace('-', '_')}"]
    assert len(set(pairs.values())) == 8  # no two workers share a credential
    # only the one-shot job holds the provisioner's credential
    holders = [
        name
        for name, svc in kvgate_services(compose).items()
        if nats_env["NATS_PASSWORD_PROVISIONER"] in str(environment_of(svc))
    ]
    assert holders == ["bus-provision"]


def test_nothing_is_published_beyond_this_host_by_default(compose: dict) -> None:
    """Every published port, the OpenAI endpoint included, is on 127.0.0.1 unless the user
    opts in (ROUTER_PUBLISH_ADDRESS), and the OpenAI endpoint needs a client key."""
    published = {
        name: [str(p) for p in svc.get("ports", [])]
        for name, svc in compose["services"].items()
        if svc.get("ports")
    }
    assert "gateway" in published
    for name, ports in published.items():
        for port in ports:
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} on every address"
    opted_in = load_compose(
        env={**read_env_file(ENV_EXAMPLE), **TEST_SECRETS, "ROUTER_PUBLISH_ADDRESS": "0.0.0.0"}
    )
    assert opted_in["services"]["gateway"]["ports"] == ["0.0.0.0:8080:8080"]
    router = environment_of(compose["services"]["router"])
    assert router["KVGATE_ROUTER_API_KEYS"] == TEST_SECRETS["KVGATE_ROUTER_API_KEYS"]


def test_shipped_nats_config_is_valid_for_nats_server() -> None:
    from services.common.embedded import nats_server_binary

    env = {**os.environ, **TEST_SECRETS}
    result = subprocess.run(
        [nats_server_binary(), "-c", str(ROOT / "deploy" / "nats.conf"), "-t"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_postgres_password_reaches_containers_only_as_a_secret_file(compose: dict) -> None:
    assert compose["secrets"]["postgres_password"] == {"environment": "POSTGRES_PASSWORD"}
    for name in ("postgres", "migrate", "api"):
        svc = compose["services"][name]
        assert "postgres_password" in svc["secrets"], name
        env = environment_of(svc)
        assert TEST_SECRETS["POSTGRES_PASSWORD"] not in " ".join(map(str, env.values())), name
    assert environment_of(compose["services"]["postgres"])["POSTGRES_PASSWORD_FILE"] == (
        "/run/secrets/postgres_password"
    )
    for name in ("migrate", "api"):
        env = environment_of(compose["services"][name])
        assert env["KVGATE_DATABASE_PASSWORD_FILE"] == "/run/secrets/postgres_password"


def test_the_api_signs_and_every_router_trusts_only_its_key(compose: dict) -> None:
    """Signing is on by default: the api gets its seed as a secret file (only the api), and
    every router service trusts exactly the matching public key, so an unsigned or foreign
    policy.updated / workers.control is rejected even from a credential allowed to publish it."""
    from services.common.signing import Signer, Verifier

    assert compose["secrets"]["api_signing_seed"] == {"environment": "API_SIGNING_SEED"}
    api = compose["services"]["api"]
    assert "api_signing_seed" in api["secrets"]
    assert environment_of(api)["KVGATE_SIGNING_SEED"] == "/run/secrets/api_signing_seed"
    for name, svc in compose["services"].items():
        if name != "api":
            assert "api_signing_seed" not in (svc.get("secrets") or []), name
            assert "KVGATE_SIGNING_SEED" not in environment_of(svc), name
    # the seed compose writes into the secret file signs what the routers verify
    signer = Signer(TEST_SECRETS["API_SIGNING_SEED"].encode())
    routers = 0
    for project in compose_projects():
        for name, svc in kvgate_services(project.load()).items():
            if command_of(svc)[0] != "router":
                continue
            routers += 1
            trusted = environment_of(svc).get("KVGATE_TRUSTED_SIGNERS", "")
            assert trusted == signer.public_key, f"{project.label}:{name} trusts {trusted!r}"
            verifier = Verifier(trusted.split(","))
            data = b'{"revision": 1}'
            assert verifier.reject_reason("policy.updated", data, None) == "unsigned"
            good = signer.headers("policy.updated", data)
            assert verifier.reject_reason("policy.updated", data, good) == ""
    assert routers >= 1
    # compose refuses to start without either half of the key
    example = read_env_file(ENV_EXAMPLE)
    for var in ("API_SIGNING_SEED", "API_SIGNING_PUBLIC_KEY"):
        env = {**example, **{k: v for k, v in TEST_SECRETS.items() if k != var}}
        with pytest.raises(InterpolationError, match=var):
            load_compose(env=env)


def test_nats_config_worker_add_and_rotate_keep_the_password_in_the_env_file(
    tmp_path: Path,
) -> None:
    """`kvgate nats-config worker add ID` writes the worker user's password (owner-only) and the
    worker list the config renders from; `rotate` replaces the password; neither prints it."""
    env_file = tmp_path / ".env"

    def step(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "services.cli",
                "nats-config",
                "worker",
                *args,
                "--env-file",
                str(env_file),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )

    added = step("add", "gpu-a")
    assert added.returncode == 0, added.stderr
    first = read_env_file(env_file)
    assert first["KVGATE_NATS_CONFIG_WORKERS"] == "gpu-a"
    assert len(first["NATS_PASSWORD_WORKER_GPU_A"]) >= 32
    assert first["NATS_PASSWORD_WORKER_GPU_A"] not in added.stdout + added.stderr
    assert env_file.stat().st_mode & 0o077 == 0
    assert step("add", "gpu-a").returncode == 1  # exists: rotate it instead
    assert step("add", "gpu-b").returncode == 0
    assert read_env_file(env_file)["KVGATE_NATS_CONFIG_WORKERS"] == "gpu-a,gpu-b"
    rotated = step("rotate", "gpu-a")
    assert rotated.returncode == 0, rotated.stderr
    after = read_env_file(env_file)
    assert after["NATS_PASSWORD_WORKER_GPU_A"] != first["NATS_PASSWORD_WORKER_GPU_A"]
    assert after["NATS_PASSWORD_WORKER_GPU_A"] not in rotated.stdout + rotated.stderr
    assert step("rotate", "gpu-c").returncode == 1  # no such worker yet


def test_the_pd_profile_runs_prefill_and_decode_workers_beside_the_sim_ones(compose: dict) -> None:
    """Profile ``pd``: two prefill-only and two decode-only simulated workers with ids that are
    not the ``sim`` profile's default ones (sim-0..3), each logging in as its own worker user,
    announcing its container's name (decoders read the prompt's KV there); the router's policy
    is settable from .env (KVGATE_ROUTER_POLICY=pd_slo pairs them)."""
    from services.worker_sim.app import worker_ids

    services = compose["services"]
    nats_env = environment_of(services["nats-1"])
    seen: set[str] = set()
    for name, role in (("sim-prefill", "prefill"), ("sim-decode", "decode")):
        svc = services[name]
        env = environment_of(svc)
        assert svc["profiles"] == ["pd"] and command_of(svc) == ["sim-worker"]
        assert env["KVGATE_SIM_ROLE"] == role
        assert env["KVGATE_SIM_HOST"] == "0.0.0.0"
        assert env["KVGATE_SIM_ADVERTISE_HOST"] == svc["hostname"] == name
        assert health_url(svc)[1:] == (int(env["KVGATE_SIM_PORT"]), "/health")
        ids = worker_ids("sim", int(env["KVGATE_SIM_COUNT"]), int(env["KVGATE_SIM_FIRST_INDEX"]))
        pairs = dict(p.split("=", 1) for p in env["KVGATE_SIM_WORKER_PASSWORDS"].split(","))
        assert sorted(pairs) == ids
        for wid, password in pairs.items():
            assert password == nats_env[f"NATS_PASSWORD_WORKER_{wid.upper().replace('-', '_')}"]
        seen |= set(ids)
        for dep in ("bus-provision", *NATS_NODES):
            assert dep in svc["depends_on"], name
    assert len(seen) == 4
    assert not seen & set(worker_ids("sim", int(S.ALL_OPTIONS["KVGATE_SIM_COUNT"].default or 4)))
    assert not seen & {f"sim-{i}" for i in range(4)}  # the sim profile's default SIM_WORKERS
    router = environment_of(services["router"])
    assert router["KVGATE_ROUTER_POLICY"] == "slo_aware"  # .env may say pd_slo
