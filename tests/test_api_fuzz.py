"""Fuzz the admin API from its own OpenAPI document (schemathesis, real Postgres and NATS):
valid and invalid inputs for every operation; no input may produce a 5xx."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.api.openapi import aiohttp_path_names
from services.api.testing import start_api
from services.common.bus import Bus
from services.common.subjects import Subjects
from tests.conftest import _delete_streams

pytestmark = pytest.mark.slow

BOOT = "fuzz-bootstrap-admin-token"  # from the environment, so fuzzing cannot revoke it


@pytest.fixture
def api_url(
    fresh_database_url: str, nats_url: str, subject_prefix: str
) -> Iterator[dict[str, str]]:
    """The API on its own event loop in a thread (schemathesis calls it synchronously)."""
    ready: dict[str, str] = {}
    started = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def main() -> None:
        h = await start_api(fresh_database_url, nats_url, subject_prefix, admin_token=BOOT)
        # a little state so that reads and actions find something
        await h.call("POST", "/api/v1/policies", {"name": "base", "spec": {"name": "random"}})
        await h.call("POST", "/api/v1/policies/base/activate")
        await h.call("POST", "/api/v1/policies", {"name": "cand", "spec": {"name": "prefix"}})
        _, canary = await h.call("POST", "/api/v1/canaries", {"policy": "cand"})
        ready["url"] = h.url
        ready["canary"] = canary["id"]
        started.set()
        try:
            await stop.wait()
        finally:
            await h.close()
            cleanup = Bus(nats_url, "fuzz-cleanup", Subjects(subject_prefix))
            await cleanup.connect(max_wait_s=10)
            await _delete_streams(cleanup, cleanup.subjects)  # JetStream storage is shared
            await cleanup.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(60), "API did not start"
    try:
        yield ready
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)


def test_no_server_error_and_no_schema_mismatch_for_any_input(api_url: dict[str, str]) -> None:
    import schemathesis
    from schemathesis.checks import (
        content_type_conformance,
        negative_data_rejection,
        positive_data_acceptance,
        response_schema_conformance,
        status_code_conformance,
    )

    CONFORMANCE = [
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
        positive_data_acceptance,  # valid input per the schema is not refused
        negative_data_rejection,  # invalid input is refused
    ]
    from schemathesis.generation import GenerationMode

    base, canary_id = api_url["url"], api_url["canary"]
    session = requests.Session()
    session.trust_env = False
    doc = session.get(f"{base}/api/v1/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_dict(doc)
    strategies = []
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategies.append(op.as_strategy(generation_mode=mode))
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
            case.validate_response(response, checks=CONFORMANCE)
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
