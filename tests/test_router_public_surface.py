"""The router's public port: body limit (Content-Length and chunked), prompt size before
tokenizing, client API keys, every error in OpenAI's shape, operator endpoints on their own
port. Real router, real NATS, a fake engine behind it."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from services.common.bus import Bus
from services.common.embedded import free_port
from services.router.public_surface import start_operator_http
from tests.test_router_support import Beats, FakeWorker, RouterProc, wait_until

LIMIT = 64 * 1024
KEY = "sk-kvgate-test-0123456789"


def _assert_openai_error(body: dict, status: int) -> dict:
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    return err


@pytest.fixture
async def stack(nats_url, subjects, bus: Bus, tmp_path: Path) -> AsyncIterator[RouterProc]:
    keys_file = tmp_path / "keys"
    # one key in plain text, one stored only as its digest
    keys_file.write_text(f"# client keys\nsha256:{hashlib.sha256(b'sk-hashed-key').hexdigest()}\n")
    workers = [await FakeWorker("w0").start(bus)]
    beats = Beats(bus, workers).start()
    router = await RouterProc(
        nats_url,
        subjects,
        max_body_bytes=LIMIT,
        max_prompt_chars=1000,
        api_keys=KEY,
        api_keys_file=str(keys_file),
        operator_port=free_port(),
        passthrough_paths="/pooling",
    ).start()
    await router.wait_workers(1)
    yield router
    await router.stop()
    await beats.stop()
    for w in workers:
        await w.stop()


def _auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_api_keys(stack: RouterProc) -> None:
    url = stack.url + "/v1/completions"
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        for headers in ({}, _auth("sk-wrong"), {"Authorization": KEY}, _auth("")):
            async with s.post(url, json=body, headers=headers) as r:
                assert r.status == 401, headers
                err = _assert_openai_error(await r.json(), 401)
                assert err["code"] == 401
        for key in (KEY, "sk-hashed-key"):
            async with s.post(url, json=body, headers=_auth(key)) as r:
                assert r.status == 200, await r.text()
        async with s.get(stack.url + "/health") as r:  # load balancers need no key
            assert r.status == 200


async def test_paths_outside_v1_that_tokenize_or_reach_a_worker_need_the_key(
    stack: RouterProc,
) -> None:
    """/tokenize and /detokenize spend the router's CPU and a passthrough path is served by a
    worker: without a key they were open to anyone who could reach the port."""
    calls = {
        "/tokenize": {"model": "m", "prompt": "hello"},
        "/detokenize": {"model": "m", "tokens": [104, 105]},
        "/pooling": {"model": "m", "input": "hello"},
    }
    async with aiohttp.ClientSession() as s:
        for path, body in calls.items():
            async with s.post(stack.url + path, json=body) as r:
                assert r.status == 401, path
                _assert_openai_error(await r.json(), 401)
            async with s.post(stack.url + path, json=body, headers=_auth()) as r:
                assert r.status != 401, (path, await r.text())
        for path in ("/ping", "/version"):  # probes and the version stay open
            async with s.get(stack.url + path) as r:
                assert r.status == 200, path


async def test_body_limit_from_content_length_and_while_reading(stack: RouterProc) -> None:
    url = stack.url + "/v1/completions"
    big = b'{"model": "m", "prompt": "' + b"x" * (LIMIT + 10) + b'"}'
    async with aiohttp.ClientSession() as s:
        async with s.post(url, data=big, headers=_auth()) as r:
            assert r.status == 413
            err = _assert_openai_error(await r.json(), 413)
            assert str(LIMIT) in err["message"]

        async def chunked():  # no Content-Length: the limit applies while reading
            for i in range(0, len(big), 8192):
                yield big[i : i + 8192]

        async with s.post(url, data=chunked(), headers=_auth()) as r:
            assert r.status == 413
            _assert_openai_error(await r.json(), 413)


async def test_prompt_size_is_checked_before_tokenizing(stack: RouterProc) -> None:
    async with aiohttp.ClientSession() as s:
        long_chat = {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "y" * 1500}]}],
        }
        async with s.post(stack.url + "/v1/chat/completions", json=long_chat, headers=_auth()) as r:
            assert r.status == 400
            err = _assert_openai_error(await r.json(), 400)
            assert "1000 characters" in err["message"]


async def test_aiohttp_errors_are_openai_shaped(stack: RouterProc) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(stack.url + "/v1/no-such-thing", json={}, headers=_auth()) as r:
            assert r.status == 404
            _assert_openai_error(await r.json(), 404)
        async with s.get(stack.url + "/v1/completions", headers=_auth()) as r:
            assert r.status == 405
            assert "POST" in r.headers["Allow"]
            _assert_openai_error(await r.json(), 405)


async def test_operator_endpoints_only_on_the_operator_port(stack: RouterProc, bus: Bus) -> None:
    assert stack.router is not None
    st = stack.router.st
    # an engine URL with credentials in it is shown redacted
    hb = FakeWorker("wc").heartbeat()
    hb.url = "http://engine:Pw0rdInUrl@127.0.0.1:9"
    await bus.publish(bus.subjects.heartbeat("wc"), hb)
    await wait_until(lambda: "wc" in stack.router.state.states, what="wc seen")
    runner = await start_operator_http(st, stack.router.operator_routes())
    assert runner is not None
    try:
        async with aiohttp.ClientSession() as s:
            for path in ("/metrics", "/debug/state", "/debug/route?prompt=hi"):
                async with s.get(stack.url + path, headers=_auth()) as r:
                    assert r.status == 404, path
                    _assert_openai_error(await r.json(), 404)
                async with s.get(f"http://127.0.0.1:{st.operator_port}{path}") as r:
                    assert r.status == 200, path
                    assert "Pw0rdInUrl" not in await r.text(), path
    finally:
        await runner.stop()


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 made by openssl, as an operator would make one."""
    import subprocess

    cert, key = tmp_path / "router.crt", tmp_path / "router.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
        + [
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ]
        + ["-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return cert, key


async def test_tls_on_the_openai_port(nats_url, subjects, bus: Bus, tmp_path: Path) -> None:
    """With --tls-cert / --tls-key the OpenAI port speaks https only: a client trusting the
    certificate gets its completion proxied; a plain-http client gets no answer."""
    import ssl

    cert, key = _self_signed(tmp_path)
    workers = [await FakeWorker("w0").start(bus)]
    beats = Beats(bus, workers).start()
    router = await RouterProc(nats_url, subjects, tls_cert=str(cert), tls_key=str(key)).start()
    try:
        await router.wait_workers(1)
        assert router.url.startswith("https://")
        trust = ssl.create_default_context(cafile=str(cert))
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=trust)) as s:
            async with s.post(router.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                assert r.headers["x-kvgate-worker"] == "w0"
        plain = f"http://127.0.0.1:{router.port}/health"
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.ClientError):
                async with s.get(plain, timeout=aiohttp.ClientTimeout(total=5)) as r:
                    await r.read()
    finally:
        await router.stop()
        await beats.stop()
        for w in workers:
            await w.stop()


def test_tls_settings_refuse_half_or_unreadable_config(tmp_path: Path) -> None:
    from services.router.public_surface import server_ssl_context

    cert, key = _self_signed(tmp_path)
    (tmp_path / "other").mkdir()
    _, other_key = _self_signed(tmp_path / "other")
    assert server_ssl_context("", "") is None
    with pytest.raises(SystemExit, match="go together"):
        server_ssl_context(str(cert), "")
    with pytest.raises(SystemExit, match="go together"):
        server_ssl_context("", str(key))
    for bad in (tmp_path / "missing.key", other_key):  # absent; a key of another certificate
        with pytest.raises(SystemExit, match="cannot load") as exc:
            server_ssl_context(str(cert), str(bad))
        assert "PRIVATE KEY" not in str(exc.value)
    assert server_ssl_context(str(cert), str(key)) is not None
