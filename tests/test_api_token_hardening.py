"""Admin API hardening with the real API, real Postgres and real NATS: tokens expire, the
bootstrap admin token is revocable (and stays revoked across restarts), failed
authentications are throttled per client address, and deeply nested JSON is a 400."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import aiohttp
import pytest

from services.api.auth_throttle import AuthThrottle
from services.api.framework import MAX_JSON_DEPTH
from services.api.json_depth import nesting_depth
from services.api.testing import ApiHarness, start_api
from services.common.bus import Bus

BOOT = "bootstrap-secret-token-for-hardening"


@pytest.fixture
async def api(
    fresh_database_url: str, nats_url: str, subject_prefix: str, bus: Bus
) -> AsyncIterator[ApiHarness]:
    h = await start_api(fresh_database_url, nats_url, subject_prefix, admin_token=BOOT)
    try:
        yield h
    finally:
        await h.close()


async def metric(h: ApiHarness, name: str, labels: str = "") -> float:
    """A counter's value from the API's own /metrics (0 before its first increment)."""
    assert h.session is not None
    async with h.session.get(f"{h.url}/metrics") as r:
        text = await r.text()
    pattern = rf"^{re.escape(name)}{re.escape('{' + labels + '}' if labels else '')} (\S+)$"
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


async def get_with_headers(
    session: aiohttp.ClientSession, url: str, token: str
) -> tuple[int, dict[str, Any], dict[str, str]]:
    async with session.get(url, headers={"Authorization": f"Bearer {token}"}) as r:
        return r.status, await r.json(content_type=None), dict(r.headers)


def nested(depth: int, leaf: str = "1") -> str:
    """``depth`` levels of alternating objects and arrays around ``leaf``, as JSON text."""
    opens = "".join('{"k":' if i % 2 == 0 else "[" for i in range(depth))
    closes = "".join("}" if i % 2 == 0 else "]" for i in reversed(range(depth)))
    return opens + leaf + closes


# ----------------------------------------------------------------------------- expiry
async def test_a_token_with_a_ttl_expires_and_is_refused_as_expired(api: ApiHarness) -> None:
    status, err = await api.call("POST", "/api/v1/tokens", {"role": "viewer", "ttl_s": 0.5})
    assert status == 400 and err["error"]["field"] == "ttl_s", err
    status, tok = await api.call(
        "POST", "/api/v1/tokens", {"role": "viewer", "name": "short", "ttl_s": 1}
    )
    assert status == 201, tok
    expires_at = datetime.fromisoformat(tok["expires_at"])
    _, listed = await api.call("GET", "/api/v1/tokens")
    row = next(t for t in listed["tokens"] if t["id"] == tok["id"])
    assert row["expires_at"] == tok["expires_at"] and row["state"] == "active"
    forever = next(t for t in listed["tokens"] if t["name"] == "test-admin")
    assert forever["expires_at"] is None
    assert (await api.call("GET", "/api/v1/policies", token=tok["token"]))[0] == 200
    expired_before = await metric(api, "kvgate_api_auth_failures_total", 'reason="expired"')
    # the token was looked up (and cached) above: expiry must not wait for the cache
    await asyncio.sleep(max(0.0, expires_at.timestamp() - time.time()) + 0.05)  # time passes
    status, err = await api.call("GET", "/api/v1/policies", token=tok["token"])
    assert status == 401, err
    assert err["error"] == {"code": "unauthorized", "message": "token expired"}
    assert await metric(api, "kvgate_api_auth_failures_total", 'reason="expired"') == (
        expired_before + 1
    )
    _, listed = await api.call("GET", "/api/v1/tokens")
    assert next(t for t in listed["tokens"] if t["id"] == tok["id"])["state"] == "expired"


async def test_the_servers_max_ttl_caps_and_defaults_token_lifetimes(
    fresh_database_url: str, nats_url: str, subject_prefix: str, bus: Bus
) -> None:
    h = await start_api(fresh_database_url, nats_url, subject_prefix, token_max_ttl_s=3600.0)
    try:
        status, err = await h.call("POST", "/api/v1/tokens", {"role": "viewer", "ttl_s": 7200})
        assert status == 400 and err["error"]["field"] == "ttl_s", err
        assert "3600" in err["error"]["message"]
        t0 = time.time()
        status, tok = await h.call("POST", "/api/v1/tokens", {"role": "viewer"})
        assert status == 201
        lifetime = datetime.fromisoformat(tok["expires_at"]).timestamp() - t0
        assert 3590 < lifetime < 3610, lifetime
    finally:
        await h.close()


# ----------------------------------------------------------------------------- bootstrap
async def test_the_bootstrap_token_is_revocable_and_stays_revoked_after_restart(
    api: ApiHarness,
) -> None:
    status, _ = await api.call(
        "POST", "/api/v1/policies", {"name": "a", "spec": {"name": "random"}}, token=BOOT
    )
    assert status == 201
    _, listed = await api.call("GET", "/api/v1/tokens")
    boot = [t for t in listed["tokens"] if t["bootstrap"]]
    assert [(t["name"], t["role"], t["state"]) for t in boot] == [
        ("bootstrap-admin", "admin", "active")
    ]
    assert BOOT not in str(listed)
    status, revoked = await api.call("DELETE", f"/api/v1/tokens/{boot[0]['id']}")
    assert status == 200 and revoked["state"] == "revoked"
    status, err = await api.call("GET", "/api/v1/policies", token=BOOT)
    assert status == 401 and err["error"]["code"] == "unauthorized"
    _, audit = await api.call("GET", "/api/v1/audit?actor=bootstrap-admin")
    assert "policy.create" in {e["action"] for e in audit["entries"]}

    # the environment still holds the token: a restarted API must not bring it back
    await api.stop()
    await api.start()
    assert (await api.call("GET", "/api/v1/policies", token=BOOT))[0] == 401
    assert (await api.call("GET", "/api/v1/policies"))[0] == 200  # a stored admin token

    # rotation: a new value in the environment is a new bootstrap token
    await api.stop()
    api.cfg.admin_token = "rotated-bootstrap-token-1"
    await api.start()
    assert (await api.call("GET", "/api/v1/policies", token="rotated-bootstrap-token-1"))[0] == 200
    assert (await api.call("GET", "/api/v1/policies", token=BOOT))[0] == 401
    # changing the environment again (without revoking) retires the previous value as well
    await api.stop()
    api.cfg.admin_token = "rotated-bootstrap-token-2"
    await api.start()
    status, err = await api.call("GET", "/api/v1/policies", token="rotated-bootstrap-token-1")
    assert status == 401, err
    assert (await api.call("GET", "/api/v1/policies", token="rotated-bootstrap-token-2"))[0] == 200
    _, listed = await api.call("GET", "/api/v1/tokens")
    assert [t["state"] for t in listed["tokens"] if t["bootstrap"]] == [
        "revoked",
        "active",
        "active",
    ]


# ----------------------------------------------------------------------------- throttling
async def test_failed_authentications_are_throttled_per_address(
    fresh_database_url: str, nats_url: str, subject_prefix: str, bus: Bus
) -> None:
    h = await start_api(
        fresh_database_url, nats_url, subject_prefix, auth_fail_limit=5, auth_fail_window_s=60.0
    )
    other = aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0)))
    try:
        url = f"{h.url}/api/v1/policies"
        throttled_before = await metric(h, "kvgate_api_auth_throttled_total")
        for i in range(5):
            status, body = await h.call("GET", "/api/v1/policies", token=f"kvg_wrong{i}")
            assert status == 401 and body["error"]["code"] == "unauthorized", (i, body)
        # the sixth request is refused without its (valid) token being looked at
        assert h.session is not None
        status, body, headers = await get_with_headers(h.session, url, h.admin)
        assert status == 429, body
        assert body["error"]["code"] == "throttled"
        assert 1 <= int(headers["Retry-After"]) <= 60
        assert await metric(h, "kvgate_api_auth_throttled_total") == throttled_before + 1
        assert (await h.call("GET", "/api/v1/health", token=None))[0] == 200  # public
        # another address is not affected, and has a budget of its own
        status, _, _ = await get_with_headers(other, url, h.admin)
        assert status == 200
        for i in range(4):
            status, body, _ = await get_with_headers(other, url, f"kvg_other{i}")
            assert status == 401, body
        status, _, _ = await get_with_headers(other, url, h.viewer)
        assert status == 200
    finally:
        await other.close()
        await h.close()


async def test_a_throttled_address_may_try_again_after_the_window(
    fresh_database_url: str, nats_url: str, subject_prefix: str, bus: Bus
) -> None:
    h = await start_api(
        fresh_database_url, nats_url, subject_prefix, auth_fail_limit=2, auth_fail_window_s=1.0
    )
    try:
        assert h.session is not None
        url = f"{h.url}/api/v1/policies"
        for _ in range(2):
            assert (await h.call("GET", "/api/v1/policies", token="kvg_wrong"))[0] == 401
        status, body, headers = await get_with_headers(h.session, url, h.admin)
        assert status == 429 and headers["Retry-After"] == "1", (body, headers)
        await asyncio.sleep(1.0)  # the window must pass: time is what is awaited
        assert (await h.call("GET", "/api/v1/policies"))[0] == 200
    finally:
        await h.close()


def test_the_throttle_tracks_a_bounded_number_of_addresses() -> None:
    now = [0.0]
    throttle = AuthThrottle(limit=3, window_s=10.0, max_addresses=100, clock=lambda: now[0])
    for _ in range(3):
        throttle.failed("10.0.0.1")
    assert throttle.retry_after("10.0.0.1") == 10.0
    for i in range(10_000):  # an attacker rotating addresses
        throttle.failed(f"10.1.{i // 256}.{i % 256}")
    assert throttle.tracked() == 100
    assert throttle.retry_after("10.0.0.1") == 0.0  # forgotten: failed least recently
    assert throttle.retry_after("10.1.39.15") == 0.0  # one failure: far from blocked
    now[0] = 5.0
    for _ in range(3):
        throttle.failed("10.0.0.9")
    now[0] = 14.0
    assert throttle.retry_after("10.0.0.9") == pytest.approx(1.0)
    now[0] = 15.0
    assert throttle.retry_after("10.0.0.9") == 0.0


# ----------------------------------------------------------------------------- JSON nesting
async def test_deeply_nested_json_is_a_400_on_every_body(api: ApiHarness) -> None:
    assert api.session is not None
    headers = {"Authorization": f"Bearer {api.admin}", "Content-Type": "application/json"}
    refused_before = await metric(api, "kvgate_api_bodies_refused_total", 'reason="too_deep"')
    deep = '{"name": "random", "params": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}"
    for method, path, body in (
        ("POST", "/api/v1/policies/validate", deep),
        ("POST", "/api/v1/policies", "[" * 100_000 + "]" * 100_000),
        ("POST", "/api/v1/tokens", nested(MAX_JSON_DEPTH + 1)),
    ):
        async with api.session.request(
            method, api.url + path, data=body.encode(), headers=headers
        ) as r:
            err = await r.json()
            assert r.status == 400, (path, r.status, err)
        assert err["error"]["code"] == "too_deep", err
        assert str(MAX_JSON_DEPTH) in err["error"]["message"]
    assert await metric(api, "kvgate_api_bodies_refused_total", 'reason="too_deep"') == (
        refused_before + 3
    )
    # exactly at the limit the body is decoded and validated as usual
    at_limit = '{"name": "random", "params": {"x": ' + nested(MAX_JSON_DEPTH - 2) + "}}"
    async with api.session.post(
        api.url + "/api/v1/policies/validate", data=at_limit.encode(), headers=headers
    ) as r:
        err = await r.json()
        assert r.status == 400 and err["error"]["code"] == "invalid_policy", err
    # brackets inside strings are text, not nesting
    status, _ = await api.call(
        "POST", "/api/v1/policies", {"name": "p", "spec": {"name": "random"}}
    )
    assert status == 201
    description = "[{" * 900 + '\\"'
    async with api.session.put(
        api.url + "/api/v1/policies/p",
        data=('{"description": "' + description + '"}').encode(),
        headers=headers,
    ) as r:
        out = await r.json()
        assert r.status == 200, out
    assert out["description"] == "[{" * 900 + '"'


def test_nesting_depth_ignores_brackets_in_strings() -> None:
    assert nesting_depth(b"1") == 0
    assert nesting_depth(b'"[[["') == 0
    assert nesting_depth(b"[]") == 1
    assert nesting_depth(b'[{"a": [1, {"b": []}]}, []]') == 5
    assert nesting_depth(rb'{"a": "\"[[[", "b": "\\", "c": [[]]}') == 3
    assert nesting_depth(b"[" * 100_000 + b"]" * 100_000) == 100_000
    assert nesting_depth(nested(10).encode()) == 10
