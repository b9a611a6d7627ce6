"""deploy/k8s (Kustomize base + overlays), checked without a cluster or a ``kubectl`` binary.

Invariant: what ``kubectl apply -k`` would create is valid Kubernetes, runs only commands
the installed kvgate has, with settings those commands read, probes on the services' health
paths, every secret from a Secret and each pod holding exactly its role's secrets (the
security table of docs/deploy.md).

The manifests are rendered the way kustomize builds them, for the features they use
(resources, namespace, images, config map and secret generators, strategic-merge patches);
a kustomization using anything else is refused, so the renderer cannot silently ignore what
kustomize would do. Its output was compared with ``kubectl kustomize`` (kustomize v5.5.0) for
the base and both overlays: identical but for the generated names' hash suffixes. Built-in kinds are validated with kubernetes-validate (its bundled
schemas, strict: unknown fields fail); the CRDs (InferencePool, Gateway, HTTPRoute,
CloudNativePG's Cluster) are checked for the fields these manifests rely on.
"""

from __future__ import annotations

import base64
import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from services.common import settings as S
from tests.test_deploy_helpers import (
    ROOT,
    TEST_SECRETS,
    command_env_vars,
    import_all_commands,
    read_env_file,
)

K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
OVERLAYS = ("cloudnativepg", "gateway-example", "autoscaling-keda", "autoscaling-hpa")
KUBERNETES_VERSIONS = ("1.31.0", kubernetes_validate.latest_version())
CLUSTER_SCOPED = {"Namespace"}
CRDS = {
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("gateway.networking.k8s.io/v1", "Gateway"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    ("postgresql.cnpg.io/v1", "Cluster"),
    ("keda.sh/v1alpha1", "ScaledObject"),  # tests/test_scaling_signal.py checks its fields
}
KVGATE_IMAGE = "kvgate:latest"
SECRET_ENV = re.compile(r"PASSWORD|TOKEN|SECRET|API_KEYS|SIGNING_SEED|DATABASE_URL")

# What each kvgate workload is, independently of the manifests: its command, HTTP port,
# health path (liveness; the router's readiness is /ready).
WORKLOADS = {
    ("StatefulSet", "kv-indexer"): (["indexer"], 8082, "/health"),
    ("DaemonSet", "telemetry"): (["telemetry"], 8083, "/health"),
    ("Deployment", "router"): (["router"], 8080, "/health"),
    ("Deployment", "api"): (["api"], 8081, "/api/v1/health"),
    ("Deployment", "epp"): (["epp", "--port", "9002"], 9002, None),  # gRPC health
    ("Job", "bus-provision"): (["bus", "provision"], None, None),
    ("Job", "migrate"): (["migrate", "upgrade"], None, None),
}

# docs/deploy.md's security table, per pod: (Secret, key) pairs each workload may hold.
NATS_ROLE_KEYS = {f"NATS_PASSWORD_{r}" for r in ("API", "ROUTER", "INDEXER", "TELEMETRY")}
NATS_ALL_KEYS = NATS_ROLE_KEYS | {"NATS_PASSWORD_OPERATOR", "NATS_PASSWORD_PROVISIONER"}
HOLDERS: dict[str, set[tuple[str, str]]] = {
    "nats": {("kvgate-nats", k) for k in NATS_ALL_KEYS},
    "bus-provision": {("kvgate-nats", "NATS_PASSWORD_PROVISIONER")},
    "migrate": {("kvgate-postgres", "url")},
    "kv-indexer": {("kvgate-nats", "NATS_PASSWORD_INDEXER")},
    "telemetry": {("kvgate-nats", "NATS_PASSWORD_TELEMETRY")},
    "router": {
        ("kvgate-nats", "NATS_PASSWORD_ROUTER"),
        ("kvgate-api-signing", "API_SIGNING_PUBLIC_KEY"),  # public: the key routers trust
        ("kvgate-credentials", "KVGATE_ROUTER_API_KEYS"),
    },
    "epp": {
        ("kvgate-nats", "NATS_PASSWORD_ROUTER"),
        ("kvgate-api-signing", "API_SIGNING_PUBLIC_KEY"),
    },
    "api": {
        ("kvgate-nats", "NATS_PASSWORD_API"),
        ("kvgate-api-signing", "API_SIGNING_SEED"),
        ("kvgate-credentials", "KVGATE_API_ADMIN_TOKEN"),
        ("kvgate-postgres", "url"),
    },
}


# ------------------------------------------------------------------------------ rendering


class UnsupportedKustomization(ValueError):
    """The kustomization uses a feature this renderer does not implement."""


_KUSTOMIZATION_KEYS = {
    "apiVersion",
    "kind",
    "namespace",
    "resources",
    "images",
    "configMapGenerator",
    "secretGenerator",
    "patches",
}
# strategic merge: lists of these keys merge item by item on the named field
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}


def _load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _generated(kind: str, spec: dict[str, Any], where: Path) -> dict[str, Any]:
    unknown = set(spec) - {"name", "files", "literals", "envs"}
    if unknown:
        raise UnsupportedKustomization(f"{where}: {kind} generator keys {unknown}")
    data: dict[str, str] = {}
    for literal in spec.get("literals", []):
        key, _, value = literal.partition("=")
        data[key] = value
    for env in spec.get("envs", []):
        data.update(read_env_file(where / env))
    for item in spec.get("files", []):
        key, sep, rel = item.partition("=")
        if not sep:
            key, rel = Path(item).name, item
        data[key] = (where / rel).read_text()
    meta = {"name": spec["name"]}
    if kind == "Secret":
        encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": meta,
            "type": "Opaque",
            "data": encoded,
        }
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def strategic_merge(base: Any, patch: Any, key: str = "") -> Any:
    """Kubernetes' strategic merge for the fields the patches use, as kustomize applies it:
    maps merge, ``null`` deletes, lists of containers / env / volumes / mounts merge by their
    merge key (new items first), other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, value in patch.items():
            if value is None:
                out.pop(k, None)
            else:
                out[k] = strategic_merge(base[k], value, k) if k in base else value
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in _MERGE_KEYS:
        field = _MERGE_KEYS[key]
        out = list(base)
        added = []
        for item in patch:
            idx = next((i for i, b in enumerate(out) if b.get(field) == item[field]), None)
            if idx is None:
                added.append(item)
            else:
                out[idx] = strategic_merge(out[idx], item)
        return added + out  # kustomize puts a patch's new items first
    return patch


def _pod_specs(resource: dict[str, Any]) -> list[dict[str, Any]]:
    spec = resource.get("spec", {})
    if resource["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "Job"}:
        return [spec["template"]["spec"]]
    return []


def render(directory: Path) -> list[dict[str, Any]]:
    """What ``kubectl kustomize directory`` builds (without the generators' name hashes)."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kust) - _KUSTOMIZATION_KEYS
    if unknown:
        raise UnsupportedKustomization(f"{directory}: kustomization keys {unknown}")
    resources: list[dict[str, Any]] = []
    for entry in kust.get("resources", []):
        path = directory / entry
        resources += render(path) if path.is_dir() else _load_docs(path)
    for spec in kust.get("configMapGenerator", []):
        resources.append(_generated("ConfigMap", spec, directory))
    for spec in kust.get("secretGenerator", []):
        resources.append(_generated("Secret", spec, directory))
    for patch_ref in kust.get("patches", []):
        if set(patch_ref) != {"path"}:
            raise UnsupportedKustomization(f"{directory}: patch {patch_ref}")
        for patch in _load_docs(directory / patch_ref["path"]):
            matches = [
                i
                for i, r in enumerate(resources)
                if (r["kind"], r["metadata"]["name"]) == (patch["kind"], patch["metadata"]["name"])
            ]
            assert len(matches) == 1, f"patch {patch['kind']}/{patch['metadata']['name']}"
            resources[matches[0]] = strategic_merge(resources[matches[0]], patch)
    images = {i["name"]: i for i in kust.get("images", [])}
    for resource in resources:
        if "namespace" in kust and resource["kind"] not in CLUSTER_SCOPED:
            resource.setdefault("metadata", {})["namespace"] = kust["namespace"]
        for pod in _pod_specs(resource):
            for container in pod["containers"]:
                name = container["image"].split(":")[0]
                if name in images:
                    new = images[name]
                    container["image"] = f"{new.get('newName', name)}:{new['newTag']}"
    return resources


def _write_test_secrets(base: Path) -> None:
    """The files secrets/README.md tells the user to create, with throwaway values."""
    secrets = base / "secrets"
    nats = {k: TEST_SECRETS[k] for k in sorted(NATS_ALL_KEYS)}
    (secrets / "nats.env").write_text("".join(f"{k}={v}\n" for k, v in nats.items()))
    signing = ("API_SIGNING_SEED", "API_SIGNING_PUBLIC_KEY")
    (secrets / "api-signing.env").write_text("".join(f"{k}={TEST_SECRETS[k]}\n" for k in signing))
    creds = ("KVGATE_API_ADMIN_TOKEN", "KVGATE_ROUTER_API_KEYS")
    (secrets / "credentials.env").write_text("".join(f"{k}={TEST_SECRETS[k]}\n" for k in creds))
    url = f"postgresql+asyncpg://kvgate:{TEST_SECRETS['POSTGRES_PASSWORD']}@db.example:5432/kvgate"
    (secrets / "postgres-url").write_text(url)


@pytest.fixture(scope="module")
def k8s_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deploy/k8s copied with the user's secret files created (the repo has none)."""
    dest = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, dest)
    _write_test_secrets(dest / "base")
    return dest


@pytest.fixture(scope="module")
def base(k8s_copy: Path) -> list[dict[str, Any]]:
    return render(k8s_copy / "base")


@pytest.fixture(scope="module")
def builds(k8s_copy: Path, base: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    return {"base": base} | {o: render(k8s_copy / "overlays" / o) for o in OVERLAYS}


@pytest.fixture(scope="module", autouse=True)
def _all_options_loaded() -> None:
    import_all_commands()


def find(resources: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def workloads(resources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in resources if _pod_specs(r)]


def kvgate_containers(resources: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (w["metadata"]["name"], c)
        for w in workloads(resources)
        for c in _pod_specs(w)[0]["containers"]
        if c["image"] == KVGATE_IMAGE
    ]


def container_env(
    container: dict[str, Any], resources: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """name -> the env entry, with envFrom config maps' keys as literal values."""
    env: dict[str, dict[str, Any]] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            cm = find(resources, "ConfigMap", source["configMapRef"]["name"])
            env |= {k: {"name": k, "value": v} for k, v in cm["data"].items()}
    env |= {e["name"]: e for e in container.get("env", [])}
    return env


def held_secrets(pod: dict[str, Any], resources: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """(Secret, key) pairs a pod's containers can read: secretKeyRef env, envFrom secretRef,
    secret volumes (their items, or every key)."""

    def keys(name: str) -> set[str]:
        secret = [r for r in resources if r["kind"] == "Secret" and r["metadata"]["name"] == name]
        return set(secret[0]["data"]) if secret else {"*"}

    held: set[tuple[str, str]] = set()
    for container in pod["containers"] + pod.get("initContainers", []):
        for source in container.get("envFrom", []):
            if "secretRef" in source:
                name = source["secretRef"]["name"]
                held |= {(name, k) for k in keys(name)}
        for entry in container.get("env", []):
            ref = entry.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                held.add((ref["name"], ref["key"]))
    for volume in pod.get("volumes", []):
        if "secret" in volume:
            name = volume["secret"]["secretName"]
            items = volume["secret"].get("items")
            held |= {(name, i["key"]) for i in items} if items else {(name, k) for k in keys(name)}
    return held


# ------------------------------------------------------------------------------ tests


def test_every_resource_validates_against_kubernetes_schemas(builds: dict) -> None:
    checked = 0
    for build, resources in builds.items():
        for resource in resources:
            if (resource["apiVersion"], resource["kind"]) in CRDS:
                continue  # test_custom_resources_have_the_fields_kvgate_relies_on
            for version in KUBERNETES_VERSIONS:
                try:
                    kubernetes_validate.validate(resource, version, strict=True)
                except kubernetes_validate.ValidationError as e:
                    where = f"{build}: {resource['kind']}/{resource['metadata']['name']}"
                    pytest.fail(f"{where} invalid for Kubernetes {version}: {e.message}")
            checked += 1
    assert checked >= 3 * 25


def test_the_validation_rejects_broken_resources(base: list[dict[str, Any]]) -> None:
    """The check above is not vacuous: a misspelt field and a wrongly typed port fail."""
    router = copy.deepcopy(find(base, "Deployment", "router"))
    container = router["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["httpGet"]["paht"] = "/ready"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(router, KUBERNETES_VERSIONS[-1], strict=True)
    service = copy.deepcopy(find(base, "Service", "router"))
    service["spec"]["ports"][0]["port"] = "eighty"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, KUBERNETES_VERSIONS[-1], strict=True)


def test_the_renderer_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(UnsupportedKustomization, match="namePrefix"):
        render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text("patches:\n- {path: p.yaml, target: {}}\n")
    with pytest.raises(UnsupportedKustomization, match="patch"):
        render(tmp_path)


def test_custom_resources_have_the_fields_kvgate_relies_on(builds: dict) -> None:
    gw = builds["gateway-example"]
    pool = find(gw, "InferencePool", "vllm-llama3-8b")
    spec = pool["spec"]
    assert set(spec) == {"selector", "targetPorts", "endpointPickerRef"}
    assert spec["selector"]["matchLabels"]
    assert 1 <= len(spec["targetPorts"]) <= 8
    assert all(set(p) == {"number"} and 0 < p["number"] < 65536 for p in spec["targetPorts"])
    picker = spec["endpointPickerRef"]
    assert set(picker) <= {"group", "kind", "name", "port", "failureMode"}
    assert picker["failureMode"] == "FailClose"
    # the picker is the EPP Service on its gRPC port, in the pool's namespace
    epp_service = find(gw, "Service", picker["name"])
    assert picker.get("kind", "Service") == "Service"
    assert epp_service["metadata"]["namespace"] == pool["metadata"]["namespace"]
    assert picker["port"]["number"] in {p["port"] for p in epp_service["spec"]["ports"]}
    assert epp_service["spec"]["selector"] == {"app.kubernetes.io/name": "epp"}
    gateway = find(gw, "Gateway", "inference-gateway")
    assert gateway["spec"]["gatewayClassName"]
    assert all({"name", "protocol", "port"} <= set(li) for li in gateway["spec"]["listeners"])
    route = find(gw, "HTTPRoute", "llm")
    assert [p["name"] for p in route["spec"]["parentRefs"]] == ["inference-gateway"]
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "vllm-llama3-8b"}
    ]
    cluster = find(builds["cloudnativepg"], "Cluster", "kvgate-pg")
    assert cluster["spec"]["instances"] >= 1
    assert cluster["spec"]["bootstrap"]["initdb"] == {"database": "kvgate", "owner": "kvgate"}
    assert cluster["spec"]["storage"]["size"]


def test_nats_config_is_generated_from_the_code() -> None:
    from services.nats_config import render as render_nats

    conf = (BASE / "nats.conf").read_text()
    assert conf == render_nats(sim_workers=0), (
        "deploy/k8s/base/nats.conf is stale: "
        "kvgate nats-config --sim-workers 0 > deploy/k8s/base/nats.conf"
    )
    assert "authorization {" in conf


def test_shipped_nats_config_is_valid_for_nats_server() -> None:
    from services.common.embedded import nats_server_binary

    result = subprocess.run(
        [nats_server_binary(), "-c", str(BASE / "nats.conf"), "-t"],
        env={k: TEST_SECRETS[k] for k in NATS_ALL_KEYS},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_nats_is_a_three_node_jetstream_cluster(base: list[dict[str, Any]]) -> None:
    from services.nats_config import password_vars

    conf = (BASE / "nats.conf").read_text()
    route_port = int(re.search(r"cluster\s*\{[^}]*port:\s*(\d+)", conf).group(1))
    http_port = int(re.search(r"^http_port:\s*(\d+)", conf, re.M).group(1))
    store = re.search(r"store_dir:\s*(\S+)", conf).group(1)
    sts = find(base, "StatefulSet", "nats")
    assert sts["spec"]["replicas"] == 3
    headless = find(base, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    pod = sts["spec"]["template"]["spec"]
    (nats,) = pod["containers"]
    args = nats["args"]
    assert args[args.index("--config") + 1] == "/etc/nats/kvgate.conf"
    assert args[args.index("--name") + 1] == "$(POD_NAME)"
    pod_name = next(e for e in nats["env"] if e["name"] == "POD_NAME")
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    routes = args[args.index("--routes") + 1].split(",")
    hosts = [f"nats-{i}.{headless['metadata']['name']}" for i in range(3)]
    assert routes == [f"nats://{h}:{route_port}" for h in hosts]
    ports = {p["name"]: p["containerPort"] for p in nats["ports"]}
    assert ports == {"client": 4222, "cluster": route_port, "monitor": http_port}
    for probe in ("readinessProbe", "livenessProbe"):
        assert nats[probe]["httpGet"] == {
            "path": "/healthz?js-enabled-only=true",
            "port": "monitor",
        }
    mounts = {m["name"]: m["mountPath"] for m in nats["volumeMounts"]}
    assert store.startswith(mounts["data"] + "/"), "JetStream must store on the volume"
    assert [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]] == ["data"]
    config = next(v for v in pod["volumes"] if v["name"] == "config")
    cm = find(base, "ConfigMap", config["configMap"]["name"])
    assert cm["data"]["kvgate.conf"] == conf
    assert mounts["config"] == "/etc/nats"
    # every user's password, from the Secret; the example lists every one nats.conf reads
    assert nats["envFrom"] == [{"secretRef": {"name": "kvgate-nats"}}]
    example = read_env_file(BASE / "secrets" / "nats.env.example")
    assert set(password_vars(sim_workers=0)) <= set(example) == NATS_ALL_KEYS
    # every kvgate service reaches the three nodes by their stable names
    common = find(base, "ConfigMap", "kvgate-common")["data"]
    assert common["KVGATE_NATS_URL"] == ",".join(f"nats://{h}:4222" for h in hosts)


def test_every_command_answers_help_in_the_installed_package(base: list) -> None:
    from services.cli import COMMANDS

    seen = {}
    for workload in workloads(base):
        for container in _pod_specs(workload)[0]["containers"]:
            key = (workload["kind"], workload["metadata"]["name"])
            if key in WORKLOADS:
                assert container["image"] == KVGATE_IMAGE, key
                assert "command" not in container, "the image's entrypoint is kvgate"
                assert container["args"] == WORKLOADS[key][0], key
                seen[key] = container["args"]
    assert set(seen) == set(WORKLOADS)
    runnable = {k: a for k, a in seen.items() if a[0] in COMMANDS}
    assert runnable == seen, f"not kvgate commands: {set(seen) - set(runnable)}"
    kvgate = Path(sys.executable).parent / "kvgate"
    procs = {
        key: subprocess.Popen(
            [str(kvgate), *args, "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for key, args in runnable.items()
    }
    for key, proc in procs.items():
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, f"{key}: --help failed: {err.decode()}"
        assert out.decode().startswith(f"usage: kvgate {runnable[key][0]}"), out.decode()[:200]


def test_every_kvgate_variable_is_read_by_the_service_command(builds: dict) -> None:
    from services.cli import COMMANDS

    checked = 0
    for build, resources in builds.items():
        for name, container in kvgate_containers(resources):
            command = container["args"][0]
            assert command in COMMANDS, f"{build}:{name}: no `kvgate {command}`"
            reads = command_env_vars(command)
            for var, entry in container_env(container, resources).items():
                if not var.startswith("KVGATE_"):
                    assert var in {
                        "NODE_NAME",
                        "NVIDIA_VISIBLE_DEVICES",
                        "NVIDIA_DRIVER_CAPABILITIES",
                    }
                    continue
                assert var in S.ALL_OPTIONS, f"{build}:{name}: {var} is no kvgate setting"
                assert var in reads, f"{build}:{name}: `kvgate {command}` ignores {var}"
                if "value" in entry:  # a literal: a valid value for the option
                    opt = S.ALL_OPTIONS[var]
                    S.resolve(None, [opt], environ={var: entry["value"]})
                checked += 1
    assert checked >= 3 * 30


def test_probes_ports_and_draining(base: list[dict[str, Any]]) -> None:
    for (kind, name), (_, port, path) in WORKLOADS.items():
        if port is None:
            continue
        (container,) = _pod_specs(find(base, kind, name))[0]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert port in ports.values(), f"{name} listens on {port}"
        for probe in ("readinessProbe", "livenessProbe"):
            assert probe in container, f"{name} has no {probe}"
            spec = container[probe]
            if path is None:  # the EPP: gRPC health on its own port
                assert spec["grpc"]["port"] == port
                continue
            get = spec["httpGet"]
            assert ports[get["port"]] == port, f"{name}: {probe} on another port"
            want = "/ready" if (name, probe) == ("router", "readinessProbe") else path
            assert get["path"] == want, f"{name}: {probe} on {get['path']}"
        env = container_env(container, base)
        host_var = {
            "router": "KVGATE_ROUTER_HOST",
            "epp": "KVGATE_EPP_HOST",
            "api": "KVGATE_API_HOST",
            "kv-indexer": "KVGATE_INDEXER_HOST",
            "telemetry": "KVGATE_TELEMETRY_HOST",
        }.get(name)
        if host_var:
            assert env[host_var]["value"] == "0.0.0.0", f"{name} must listen on the pod IP"
            port_var = host_var.replace("_HOST", "_PORT")
            assert S.ALL_OPTIONS[port_var].default == port, f"{port_var} default changed"
            assert port_var not in env or int(env[port_var]["value"]) == port
    # the router and the EPP drain within their grace period, after the preStop sleep, and
    # serve /metrics on the operator port, reachable from the pod network
    for deployment, operator_port_var in (
        ("router", "KVGATE_ROUTER_OPERATOR_PORT"),
        ("epp", "KVGATE_EPP_OPERATOR_PORT"),
    ):
        workload = find(base, "Deployment", deployment)
        pod = workload["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = container_env(container, base)
        grace = pod["terminationGracePeriodSeconds"]
        sleep = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        drain = float(env["KVGATE_ROUTER_DRAIN_TIMEOUT_S"]["value"])
        assert (grace, sleep, drain) == (30, 5, 25.0), deployment
        assert sleep + drain <= grace
        assert env[operator_port_var]["value"] == "8084", deployment
        assert env["KVGATE_ROUTER_OPERATOR_HOST"]["value"] == "0.0.0.0", deployment
        assert {"name": "operator", "containerPort": 8084} in container["ports"]
        assert workload["spec"]["replicas"] >= 2
    # the OpenAI Service reaches the routers' port, the API Service the api's
    for svc, port in (("router", 8080), ("api", 8081), ("kvgate-epp", 9002)):
        assert [p["port"] for p in find(base, "Service", svc)["spec"]["ports"]] == [port]


def test_the_indexers_are_a_highly_available_pair(base: list[dict[str, Any]]) -> None:
    sts = find(base, "StatefulSet", "kv-indexer")
    assert sts["spec"]["replicas"] == 2
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    ha_id = container_env(container, base)["KVGATE_INDEXER_HA_ID"]
    # each member its own id: the pod name (kv-indexer-0, kv-indexer-1)
    assert ha_id["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert "KVGATE_INDEXER_HA_ID" in S.ALL_OPTIONS


def test_replicated_workloads_lose_one_member_at_a_time(base: list[dict[str, Any]]) -> None:
    budgets = {
        r["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]: r["spec"]
        for r in base
        if r["kind"] == "PodDisruptionBudget"
    }
    for workload in workloads(base):
        if workload["kind"] in {"Deployment", "StatefulSet"} and workload["spec"]["replicas"] > 1:
            name = workload["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
            assert budgets.get(name, {}).get("maxUnavailable") == 1, name
    assert set(budgets) == {"nats", "kv-indexer", "router", "epp"}


def test_telemetry_runs_on_gpu_nodes_only(base: list[dict[str, Any]]) -> None:
    ds = find(base, "DaemonSet", "telemetry")
    pod = ds["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert not pod.get("hostNetwork"), "NetworkPolicies must see its pod address"


def test_every_secret_comes_from_a_secret(builds: dict) -> None:
    for build, resources in builds.items():
        secrets = {
            r["metadata"]["name"]: set(r["data"]) for r in resources if r["kind"] == "Secret"
        }
        for name, container in kvgate_containers(resources):
            for var, entry in container_env(container, resources).items():
                if not SECRET_ENV.search(var):
                    continue
                if "value" in entry:  # only a path to a mounted secret file
                    mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
                    assert any(entry["value"].startswith(m + "/") for m in mounts), (
                        f"{build}:{name}: {var} is a literal"
                    )
                    continue
                ref = entry["valueFrom"]["secretKeyRef"]
                assert ref["key"] in secrets.get(ref["name"], set()), f"{build}:{name}: {ref}"
        # no Secret is written in the manifests: every one is generated from a user's file
        for path in K8S.rglob("*.yaml"):
            for doc in _load_docs(path):
                assert doc.get("kind") != "Secret", f"{path} commits a Secret"


def test_each_pod_holds_exactly_its_roles_secrets(builds: dict) -> None:
    for build, resources in builds.items():
        for workload in workloads(resources):
            name = workload["metadata"]["name"]
            held = held_secrets(_pod_specs(workload)[0], resources)
            expected = set(HOLDERS[name])
            if build == "cloudnativepg" and name in {"migrate", "api"}:
                expected.add(("kvgate-pg-app", "password"))
            assert held == expected, f"{build}:{name} holds {held ^ expected} unexpectedly"
    # only the one-shot job (and NATS itself) holds the provisioner's password
    provisioner = ("kvgate-nats", "NATS_PASSWORD_PROVISIONER")
    assert sorted(n for n, held in HOLDERS.items() if provisioner in held) == [
        "bus-provision",
        "nats",
    ]


def test_the_api_signs_and_routers_trust_its_key(base: list[dict[str, Any]]) -> None:
    api = find(base, "Deployment", "api")["spec"]["template"]["spec"]
    (container,) = api["containers"]
    seed_path = container_env(container, base)["KVGATE_SIGNING_SEED"]["value"]
    volume = next(v for v in api["volumes"] if v["secret"]["secretName"] == "kvgate-api-signing")
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    items = volume["secret"]["items"]
    assert items == [{"key": "API_SIGNING_SEED", "path": seed_path.rsplit("/", 1)[1]}]
    assert seed_path == f"{mount['mountPath']}/{items[0]['path']}"
    # readable by the non-root user through the pod's fsGroup
    assert api["securityContext"]["fsGroup"] == api["securityContext"]["runAsUser"]
    assert volume["secret"]["defaultMode"] & 0o040
    for deployment in ("router", "epp"):
        (c,) = find(base, "Deployment", deployment)["spec"]["template"]["spec"]["containers"]
        ref = container_env(c, base)["KVGATE_TRUSTED_SIGNERS"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "kvgate-api-signing", "key": "API_SIGNING_PUBLIC_KEY"}
    # `kvgate signing-key`'s output is the file the Secret is generated from
    out = subprocess.run(
        [str(Path(sys.executable).parent / "kvgate"), "signing-key"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    lines = [ln for ln in out.splitlines() if ln and not ln.startswith("#")]
    example = read_env_file(BASE / "secrets" / "api-signing.env.example")
    assert [ln.split("=", 1)[0] for ln in lines] == list(example)


def test_nats_roles_match_the_services(base: list[dict[str, Any]]) -> None:
    conf = (BASE / "nats.conf").read_text()
    users = set(re.findall(r'\{user: "([^"]+)"', conf))
    expected = {
        "kv-indexer": "indexer",
        "telemetry": "telemetry",
        "router": "router",
        "epp": "router",
        "api": "api",
        "bus-provision": "provisioner",
    }
    for name, container in kvgate_containers(base):
        env = container_env(container, base)
        if name == "migrate":
            assert "KVGATE_NATS_USER" not in env and "KVGATE_NATS_URL" not in env
            continue
        user = env["KVGATE_NATS_USER"]["value"]
        assert user == expected[name] and user in users, name
        ref = env["KVGATE_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "kvgate-nats", "key": f"NATS_PASSWORD_{user.upper()}"}, name


def test_network_policies(base: list[dict[str, Any]]) -> None:
    policies = {r["metadata"]["name"]: r["spec"] for r in base if r["kind"] == "NetworkPolicy"}
    assert policies["default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    # NATS: client port from kvgate's pods (this namespace) and labelled bridges only
    nats_rules = policies["nats"]["ingress"]
    client = next(r for r in nats_rules if {"port": 4222, "protocol": "TCP"} in r["ports"])
    assert client["from"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "kvgate"}}},
        {
            "namespaceSelector": {},
            "podSelector": {"matchLabels": {"kvgate.io/nats-client": "true"}},
        },
    ]
    assert all("from" in r for r in nats_rules), "NATS must not be open to everyone"
    # every kvgate pod carries the label that admits it to NATS
    for workload in workloads(base):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/part-of"] == "kvgate", workload["metadata"]["name"]
    # the admin API: operators' namespaces only
    (api_rule,) = policies["api"]["ingress"]
    assert api_rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kvgate.io/operators": "true"}}}
    ]
    assert api_rule["ports"] == [{"port": 8081, "protocol": "TCP"}]
    # the router's OpenAI port is public, its operator port is not
    public = [r for r in policies["router"]["ingress"] if "from" not in r]
    assert public == [{"ports": [{"port": 8080, "protocol": "TCP"}]}]
    for name, spec in policies.items():
        for rule in spec.get("ingress", []):
            if "from" not in rule:
                assert (name, rule["ports"]) == ("router", [{"port": 8080, "protocol": "TCP"}])


def test_secret_files_are_never_committed() -> None:
    secrets = BASE / "secrets"
    real = ["nats.env", "api-signing.env", "credentials.env", "postgres-url"]
    ignored = subprocess.run(
        ["git", "check-ignore", *(str(secrets / f) for f in real)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ignored.stdout.split() == [str(secrets / f) for f in real]
    tracked = subprocess.run(
        ["git", "ls-files", str(secrets)], cwd=ROOT, capture_output=True, text=True, timeout=30
    ).stdout.split()
    assert all(
        Path(t).name in {".gitignore", "README.md"} or t.endswith(".example") for t in tracked
    )
    # the examples carry the format, never a value
    for example in secrets.glob("*.env.example"):
        assert all(v == "" for v in read_env_file(example).values()), example.name
    # the generators read exactly the files the README tells the user to create
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    sources = [
        src.split("=", 1)[-1]
        for gen in kust["secretGenerator"]
        for src in gen.get("envs", []) + gen.get("files", [])
    ]
    assert sorted(sources) == sorted(f"secrets/{f}" for f in real)
    readme = (secrets / "README.md").read_text()
    assert all(f"`{f}`" in readme for f in real)


def test_cloudnativepg_overlay_gives_the_password_as_a_file(builds: dict) -> None:
    resources = builds["cloudnativepg"]
    for kind, name in (("Job", "migrate"), ("Deployment", "api")):
        pod = _pod_specs(find(resources, kind, name))[0]
        (container,) = pod["containers"]
        env = container_env(container, resources)
        path = env["KVGATE_DATABASE_PASSWORD_FILE"]["value"]
        assert "KVGATE_DATABASE_PASSWORD_FILE" in command_env_vars(container["args"][0])
        volume = next(v for v in pod["volumes"] if v["name"] == "postgres-password")
        assert volume["secret"]["secretName"] == "kvgate-pg-app"  # CloudNativePG's app Secret
        mount = next(m for m in container["volumeMounts"] if m["name"] == "postgres-password")
        assert path == f"{mount['mountPath']}/{volume['secret']['items'][0]['path']}"
        # the base's containers are kept whole (the patch merged, did not replace)
        assert container["args"] == WORKLOADS[(kind, name)][0]
        assert env["KVGATE_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "kvgate-postgres"
    # the password file is spliced into the URL by the settings (the URL carries none)
    opts = [S.ALL_OPTIONS["KVGATE_DATABASE_URL"], S.ALL_OPTIONS["KVGATE_DATABASE_PASSWORD_FILE"]]
    assert all(opts)


def test_strategic_merge_follows_kubernetes_rules() -> None:
    base = {"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}], "image": "i"}]}
    patch = {"containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}], "image": None}]}
    assert strategic_merge(base, patch) == {
        "containers": [
            {"name": "a", "env": [{"name": "Y", "value": "2"}, {"name": "X", "value": "1"}]}
        ]
    }
    assert strategic_merge({"args": ["a", "b"]}, {"args": ["c"]}) == {"args": ["c"]}


def test_keda_and_hpa_examples_scale_the_engines_on_the_signal(builds: dict) -> None:
    """The autoscaling overlays scale the engines' Deployment to the routers' summed
    kvgate_fleet_engines_needed (docs/deploy.md, "Scaling the engines")."""
    from tests.test_dashboards import exported_metric_names, metric_names_in

    exported = exported_metric_names()
    keda = builds["autoscaling-keda"]
    so = find(keda, "ScaledObject", "vllm-llama3-8b")
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    spec = so["spec"]
    assert spec["scaleTargetRef"]["name"] == "vllm-llama3-8b"
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    meta = trigger["metadata"]
    assert set(meta) >= {"serverAddress", "query", "threshold"}
    assert metric_names_in(meta["query"]) == {"kvgate_fleet_engines_needed"} <= exported
    assert meta["query"].startswith("sum(") and float(meta["threshold"]) == 1.0
    hpa_build = builds["autoscaling-hpa"]
    hpa = find(hpa_build, "HorizontalPodAutoscaler", "vllm-llama3-8b")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == "kvgate_fleet_engines_needed"
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    assert hpa["spec"]["scaleTargetRef"]["name"] == "vllm-llama3-8b"
    # the prometheus-adapter rule the HPA example needs is the one docs/deploy.md shows
    docs = (ROOT / "docs" / "deploy.md").read_text()
    assert 'seriesQuery: "kvgate_fleet_engines_needed"' in docs
