"""Grafana dashboards (deploy/grafana) and the Prometheus that feeds them
(deploy/prometheus.yml): every PromQL expression names only metrics kvgate really exports
(collected from the services' prometheus-client registries), every panel uses the provisioned
data source, and Prometheus scrapes every kvgate service of compose.yaml."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from services.common.schemas import GpuSample, WorkerLoad
from services.telemetry.exporter import TelemetryCollector
from tests.test_deploy_compose import SERVICES

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))

# modules that declare the services' metrics on prometheus-client's default registry
METRIC_MODULES = (
    "services.common.bus",
    "services.common.service",
    "services.router.metrics",
    "services.router.tenant_metrics",
    "services.router.tenant_cache",
    "services.router.cache_budget",
    "services.router.flow_control",
    "services.telemetry.exporter",
    "services.api.alerting",
    "services.api.canary.runner",
    "services.kv_indexer.app",
    "services.common.index_replica",
    "services.kv_indexer.bridges.runtime",
)
PROMQL_WORDS = {
    # aggregations, their modifiers, functions without a following "(" in our use
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset",
}  # fmt: skip


def _sample_names(family_name: str, kind: str) -> set[str]:
    if kind == "counter":
        return {family_name + "_total", family_name + "_created"}
    if kind in ("histogram", "gaugehistogram"):
        return {family_name + s for s in ("_bucket", "_sum", "_count", "_created")}
    if kind == "summary":
        return {family_name, family_name + "_sum", family_name + "_count"}
    return {family_name}


def exported_metric_names() -> set[str]:
    """Every sample name the services can expose, whether or not a sample exists yet."""
    from prometheus_client import REGISTRY

    for module in METRIC_MODULES:
        importlib.import_module(module)
    names: set[str] = set()
    for collector in list(REGISTRY._collector_to_names):  # declared metrics, children or not
        describe = getattr(collector, "describe", None)
        for fam in (describe() if describe else []) or collector.collect():
            names |= _sample_names(fam.name, fam.type)
    # the telemetry agent's custom collector yields its families at scrape time
    gpu = GpuSample(index=0, sm_util_pct=50.0, mem_util_pct=10.0, mem_bw_util_pct=5.0,
                    mem_used_bytes=1, mem_total_bytes=2, mem_free_bytes=1, pcie_rx_bytes_s=1.0,
                    pcie_tx_bytes_s=1.0, sm_clock_mhz=1.0, mem_clock_mhz=1.0,
                    temperature_c=50.0, power_w=100.0, xid_errors=0, ecc_errors=0)  # fmt: skip
    load = WorkerLoad(worker_id="w", ts=0.0, running=1, waiting=0, kv_usage=0.5,
                      cache_hit_rate=0.5)  # fmt: skip
    registry = CollectorRegistry()
    registry.register(TelemetryCollector(lambda: [(gpu, ["w"])], lambda: {"w": load}))
    for fam in registry.collect():
        names |= _sample_names(fam.name, fam.type)
    return names


def metric_names_in(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (labels, functions and keywords removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = m.group(0)
        rest = text[m.end() :].lstrip()
        if rest.startswith("(") or word in PROMQL_WORDS:
            continue  # a function or an aggregation
        names.add(word)
    return names


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return out


def _exprs() -> list[tuple[str, str, str]]:
    found = []
    for path in DASHBOARDS:
        for p in _panels(json.loads(path.read_text())):
            for t in p.get("targets", []):
                found.append((path.name, p["title"], t["expr"]))
    return found


def test_dashboards_exist_and_use_the_provisioned_data_source() -> None:
    assert {p.name for p in DASHBOARDS} >= {"kvgate-overview.json", "kvgate-gpus.json"}
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    uid = ds["datasources"][0]["uid"]
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    titles = set()
    for path in DASHBOARDS:
        d = json.loads(path.read_text())
        assert d["uid"] and d["title"] and d["uid"] not in titles
        titles.add(d["uid"])
        for p in _panels(d):
            if p["type"] == "row":
                continue
            assert p["targets"], (path.name, p["title"])
            assert p["datasource"]["uid"] == uid, (path.name, p["title"])
            assert all(t["datasource"]["uid"] == uid for t in p["targets"])
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "kvgate.yaml").read_text())
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    mounts = [str(v) for v in compose["services"]["grafana"]["volumes"]]
    assert f"./deploy/grafana/dashboards:{provider['providers'][0]['options']['path']}:ro" in mounts


def test_every_promql_expression_names_metrics_kvgate_exports() -> None:
    exported = exported_metric_names()
    exprs = _exprs()
    assert len(exprs) >= 30
    read: set[str] = set()
    for dashboard, title, expr in exprs:
        names = metric_names_in(expr)
        assert names, (dashboard, title, expr)
        unknown = names - exported
        assert not unknown, f"{dashboard} / {title}: {sorted(unknown)} not exported ({expr})"
        read |= names
    # the panels the dashboards promise read the metrics that carry them
    for needed in (
        "kvgate_telemetry_requests_running",  # fleet load
        "kvgate_router_kv_cache_hit_ratio",  # predicted vs reported
        "kvgate_router_ttft_seconds_bucket",  # TTFT by policy
        "kvgate_router_itl_seconds_bucket",  # ITL by policy
        "kvgate_router_arm_ttft_seconds_bucket",  # canary arms
        "kvgate_router_breaker_state",  # breakers
        "kvgate_telemetry_alerts_total",  # alerts
        "kvgate_gpu_sm_utilization_ratio",  # GPU
        "kvgate_tenant_cached_tokens_total",  # tenants: cached vs computed
        "kvgate_tenant_cache_evictions_caused_total",  # tenants: who evicts whom
    ):
        assert needed in read, needed


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (worker) (rate(kvgate_router_requests_total{status!="ok"}[1m]))',
         {"kvgate_router_requests_total"}),
        ("histogram_quantile(0.95, sum by (le, arm) (rate(x_bucket[5m]))) / on (arm) y",
         {"x_bucket", "y"}),
    ],
)  # fmt: skip
def test_metric_name_extraction(expr: str, names: set[str]) -> None:
    assert metric_names_in(expr) == names


def test_the_check_catches_a_metric_kvgate_does_not_export() -> None:
    exported = exported_metric_names()
    assert metric_names_in("rate(vllm_requests_total[1m])") - exported == {"vllm_requests_total"}
    assert "gpu_utilization_percent" in exported  # the seed's alias is still there
    assert "kvgate_gpu_xid_errors_total" in exported


def test_prometheus_scrapes_every_kvgate_service() -> None:
    cfg = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    assert cfg["global"]["scrape_interval"] == "5s"
    targets: set[tuple[str, int]] = set()
    for job in cfg["scrape_configs"]:
        for sc in job.get("static_configs", []):
            for t in sc["targets"]:
                host, port = t.split(":")
                targets.add((host, int(port)))
        for sd in job.get("dns_sd_configs", []):
            for name in sd["names"]:
                targets.add((name, int(sd["port"])))
    compose_env = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    for service, (_, _, port, _) in SERVICES.items():
        # a router serves /metrics on its operator port (the OpenAI port serves clients only)
        env = compose_env[service].get("environment", {})
        port = int(env.get("KVGATE_ROUTER_OPERATOR_PORT", port))
        assert (service, port) in targets, f"Prometheus does not scrape {service}:{port}"
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    prom = compose["services"]["prometheus"]
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]
    assert compose["services"]["grafana"]["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "false"


def _cells(pos: dict) -> set[tuple[int, int]]:
    return {
        (x, y)
        for x in range(pos["x"], pos["x"] + pos["w"])
        for y in range(pos["y"], pos["y"] + pos["h"])
    }


def test_panels_have_unique_ids_and_do_not_overlap() -> None:
    """Grafana keys panels by id (a duplicate id edits or links the wrong panel) and stacks
    overlapping grid positions unpredictably: two rows added at once had both."""
    for path in DASHBOARDS:
        panels = _panels(json.loads(path.read_text()))
        ids = [p["id"] for p in panels]
        assert len(ids) == len(set(ids)), (path.name, sorted(i for i in ids if ids.count(i) > 1))
        taken: dict[tuple[int, int], str] = {}
        for p in panels:
            for cell in _cells(p["gridPos"]):
                assert cell not in taken, (path.name, p["title"], taken.get(cell))
                taken[cell] = p["title"]
