"""Fuzz the admin API from its own OpenAPI document (schemathesis, real Postgres and NATS):
valid and invalid inputs for every operation; no input may produce a 5xx."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.api.openapi import aiohttp_path_names
from services.api.testing import migrate
from services.common.bus import Bus
from services.common.embedded import free_port
from services.common.subjects import Subjects
from tests.conftest import _delete_streams

pytestmark = pytest.mark.slow

BOOT = "fuzz-bootstrap-admin-token"


@pytest.fixture
def api_url(
    fresh_database_url: str, nats_url: str, subject_prefix: str
) -> Iterator[dict[str, str]]:
    """``kvgate api`` in a process of its own, as deployed. In this process it would share
    the GIL with schemathesis's generation (the test calls it synchronously): a database
    connect held up past the API's 1 s bound marks Postgres down, and the 503s that follow
    are what this test counts."""
    asyncio.run(migrate(fresh_database_url))
    port = free_port()
    env = {
        **os.environ,
        "KVGATE_DATABASE_URL": fresh_database_url,
        "KVGATE_NATS_URL": nats_url,
        "KVGATE_SUBJECT_PREFIX": subject_prefix,
        "KVGATE_API_ADMIN_TOKEN": BOOT,  # from the environment, so fuzzing cannot revoke it
        "KVGATE_API_PORT": str(port),
        "KVGATE_LOG_LEVEL": "warning",
        "KVGATE_CANARY_EVAL_INTERVAL_S": "0.2",
        "KVGATE_API_REPUBLISH_S": "1.0",
        "NO_PROXY": "127.0.0.1",
    }
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "api"], env=env)
    url = f"http://127.0.0.1:{port}"
    session = requests.Session()
    session.trust_env = False
    auth = {"Authorization": f"Bearer {BOOT}"}
    try:
        deadline = time.monotonic() + 60
        while True:  # the port answers once the API is up (migrated, NATS connected)
            assert proc.poll() is None, f"kvgate api exited with {proc.returncode}"
            try:
                if session.get(f"{url}/api/v1/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "API did not start"
            time.sleep(0.1)

        def call(path: str, body: dict | None = None) -> dict:
            r = session.post(f"{url}{path}", json=body, headers=auth, timeout=10)
            assert r.status_code < 300, (path, r.status_code, r.text)
            return r.json()

        # a little state so that reads and actions find something
        call("/api/v1/policies", {"name": "base", "spec": {"name": "random"}})
        call("/api/v1/policies/base/activate")
        call("/api/v1/policies", {"name": "cand", "spec": {"name": "prefix"}})
        canary = call("/api/v1/canaries", {"policy": "cand"})
        yield {"url": url, "canary": canary["id"]}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

        async def cleanup() -> None:  # JetStream storage is shared
            bus = Bus(nats_url, "fuzz-cleanup", Subjects(subject_prefix))
            await bus.connect(max_wait_s=10)
            await _delete_streams(bus, bus.subjects)
            await bus.close()

        asyncio.run(cleanup())


def test_no_server_error_and_no_schema_mismatch_for_any_input(api_url: dict[str, str]) -> None:
    import schemathesis
    from schemathesis.checks import (
        content_type_conformance,
        negative_data_rejection,
        positive_data_acceptance,
        response_schema_conformance,
        status_code_conformance,
    )
    from schemathesis.config import SchemathesisConfig

    CONFORMANCE = [
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
        positive_data_acceptance,  # valid input per the schema is not refused
        negative_data_rejection,  # invalid input is refused
    ]
    from schemathesis.core.parameters import ParameterLocation
    from schemathesis.generation import GenerationMode

    TEXT = (ParameterLocation.QUERY, ParameterLocation.PATH, ParameterLocation.HEADER)

    def checks_for(case) -> list:
        """Every check, except "invalid input is refused" for a case made invalid in its query,
        path or headers: there every value travels as text, and an "invalid" one may read as a
        valid one on the wire (the string "0" for an integer: ``?after=0``); the rules of those
        values have their own tests (tests/test_api_rest.py)."""
        comps = case.meta.components if case.meta is not None else {}
        if any(loc in TEXT and c.mode == GenerationMode.NEGATIVE for loc, c in comps.items()):
            return [c for c in CONFORMANCE if c is not negative_data_rejection]
        return CONFORMANCE

    base, canary_id = api_url["url"], api_url["canary"]
    session = requests.Session()
    session.trust_env = False
    doc = session.get(f"{base}/api/v1/openapi.json", timeout=10).json()
    # 412: a schema-valid If-Match that names a version the resource has moved past is refused
    # by the state, as a 404 or a 409 is (the default list has those, not 412)
    accepted = ["2xx", "3xx", "401", "403", "404", "409", "412", "429", "5xx"]
    config = SchemathesisConfig.from_dict(
        {"checks": {"positive_data_acceptance": {"expected-statuses": accepted}}}
    )
    schema = schemathesis.openapi.from_dict(doc, config=config)
    # the bootstrap token is revocable like any token: fuzzing must not revoke its own
    listed = session.get(
        f"{base}/api/v1/tokens", headers={"Authorization": f"Bearer {BOOT}"}, timeout=10
    ).json()
    boot_id = str(next(t["id"] for t in listed["tokens"] if t["bootstrap"]))
    strategies = []
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategy = op.as_strategy(generation_mode=mode)
            if op.method.upper() == "DELETE" and op.path == "/api/v1/tokens/{id}":
                strategy = strategy.filter(
                    lambda case: str((case.path_parameters or {}).get("id")) != boot_id
                )
            strategies.append(strategy)
        # also aim at objects that exist, so handlers past the 404 run too
        names = set(aiohttp_path_names(op.path))
        if names == {"id"} and "canaries" in op.path:
            strategies.append(op.as_strategy(path_parameters={"id": canary_id}))
        elif "name" in names:
            strategies.append(op.as_strategy(path_parameters={"name": "cand"}))
    assert len(strategies) >= 60
    failures: list[str] = []
    mismatches: dict[str, str] = {}  # distinct (operation, status, check) -> an example
    calls = {"n": 0}

    @settings(
        max_examples=25 * len(strategies) // 2,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    @given(case=st.one_of(strategies))
    def check(case) -> None:
        response = case.call(
            base_url=base, session=session, headers={"Authorization": f"Bearer {BOOT}"}
        )
        calls["n"] += 1
        if response.status_code >= 500:
            failures.append(
                f"{case.method} {case.formatted_path} -> {response.status_code} "
                f"{response.text[:300]}\n  {case.as_curl_command()}"
            )
            return
        try:
            case.validate_response(response, checks=checks_for(case))
        except (Exception, BaseExceptionGroup) as exc:  # schemathesis FailureGroup
            text = str(exc)
            kinds = sorted(set(re.findall(r"ST\d+ [^\n]+", text))) or [type(exc).__name__]
            key = f"{case.method} {case.path} -> {response.status_code}: {'; '.join(kinds)}"
            mismatches.setdefault(key, f"{response.text[:200]}\n    {case.as_curl_command()[:400]}")

    check()
    assert calls["n"] >= 500
    assert not failures, "\n".join(failures[:10])
    assert not mismatches, f"{len(mismatches)} distinct schema mismatches:\n" + "\n".join(
        f"{k}\n    {v}" for k, v in sorted(mismatches.items())
    )
