"""Every NATS authentication method the services accept, against a real nats-server configured
for it: user/password (options and URL), token, nkey seed file, ``.creds`` file (operator mode,
decentralised JWT), and mutual TLS. A wrong credential is refused and its secret is not in the
error."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import nkeys
import pytest

from services.common.bus import Bus, NatsAuth
from services.common.embedded import EmbeddedNats


def _server(tmp_path: Path, conf: str) -> EmbeddedNats:
    srv = EmbeddedNats(tmp_path / "nats", authorization=conf)
    srv.start()
    return srv


@pytest.fixture
def started() -> Iterator[list[EmbeddedNats]]:
    servers: list[EmbeddedNats] = []
    yield servers
    for s in servers:
        s.stop()


async def _round_trip(url: str, auth: NatsAuth) -> None:
    """Connect, subscribe, publish, receive: the credential works end to end."""
    bus = Bus(url, "auth-test", auth=auth)
    await bus.connect(max_wait_s=5)
    try:
        sub = await bus.client.subscribe("auth.check")
        await bus.client.publish("auth.check", b"ok")
        msg = await sub.next_msg(timeout=5)
        assert msg.data == b"ok"
    finally:
        await bus.close()


async def _refused(url: str, auth: NatsAuth, secret: str = "") -> None:
    bus = Bus(url, "auth-test", auth=auth)
    with pytest.raises(ConnectionError) as err:
        await bus.connect(max_wait_s=1.0)
    assert not secret or secret not in str(err.value)


async def test_user_password_options_and_url(tmp_path: Path, started: list) -> None:
    srv = _server(tmp_path, 'authorization { user: "svc", password: "S3cret-pw" }')
    started.append(srv)
    await _round_trip(srv.url, NatsAuth(user="svc", password="S3cret-pw"))
    await _round_trip(srv.url.replace("nats://", "nats://svc:S3cret-pw@"), NatsAuth())
    await _refused(srv.url, NatsAuth(user="svc", password="Wrong-pw"), "Wrong-pw")
    await _refused(srv.url.replace("nats://", "nats://svc:Wrong-pw@"), NatsAuth(), "Wrong-pw")


async def test_token(tmp_path: Path, started: list) -> None:
    srv = _server(tmp_path, 'authorization { token: "T0ken-s3cret" }')
    started.append(srv)
    await _round_trip(srv.url, NatsAuth(token="T0ken-s3cret"))
    await _round_trip(srv.url.replace("nats://", "nats://T0ken-s3cret@"), NatsAuth())
    await _refused(srv.url, NatsAuth(token="Wrong-token"), "Wrong-token")


def _keypair(prefix: int) -> nkeys.KeyPair:
    return nkeys.from_seed(nkeys.encode_seed(os.urandom(32), prefix))


async def test_nkey_seed_file(tmp_path: Path, started: list) -> None:
    user = _keypair(nkeys.PREFIX_BYTE_USER)
    srv = _server(
        tmp_path, f'authorization {{ users = [ {{nkey: "{user.public_key.decode()}"}} ] }}'
    )
    started.append(srv)
    seed_file = tmp_path / "svc.nk"
    seed_file.write_bytes(user.seed)
    await _round_trip(srv.url, NatsAuth(nkey_seed=str(seed_file)))
    other = tmp_path / "other.nk"
    other.write_bytes(_keypair(nkeys.PREFIX_BYTE_USER).seed)
    await _refused(srv.url, NatsAuth(nkey_seed=str(other)), other.read_text())


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _jwt(issuer: nkeys.KeyPair, subject: str, name: str, nats_claims: dict) -> str:
    """A NATS JWT (ed25519-nkey), as nsc writes them."""
    claims = {
        "iat": int(time.time()),
        "iss": issuer.public_key.decode(),
        "name": name,
        "sub": subject,
        "nats": {**nats_claims, "version": 2},
    }
    claims["jti"] = (
        base64.b32encode(hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest())
        .decode()
        .rstrip("=")
    )
    header = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = _b64(json.dumps(claims).encode())
    signature = issuer.sign(f"{header}.{body}".encode())
    return f"{header}.{body}.{_b64(signature)}"


async def test_creds_file_decentralised_jwt(tmp_path: Path, started: list) -> None:
    operator = _keypair(nkeys.PREFIX_BYTE_OPERATOR)
    account = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    system = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)  # JetStream needs a system account
    user = _keypair(nkeys.PREFIX_BYTE_USER)
    op_pub, acc_pub = operator.public_key.decode(), account.public_key.decode()
    sys_pub = system.public_key.decode()
    unlimited = {"subs": -1, "data": -1, "payload": -1}
    op_jwt = _jwt(operator, op_pub, "kvgate-op", {"type": "operator", "system_account": sys_pub})
    sys_jwt = _jwt(operator, sys_pub, "SYS", {"type": "account", "limits": {**unlimited}})
    acc_jwt = _jwt(
        operator,
        acc_pub,
        "kvgate",
        {
            "type": "account",
            "limits": {**unlimited, "imports": -1, "exports": -1, "wildcards": True, "conn": -1},
        },
    )
    user_jwt = _jwt(
        account,
        user.public_key.decode(),
        "router",
        {"type": "user", "pub": {}, "sub": {}, **unlimited},
    )
    srv = _server(
        tmp_path,
        f'operator: "{op_jwt}"\nsystem_account: {sys_pub}\nresolver: MEMORY\n'
        f'resolver_preload: {{ {acc_pub}: "{acc_jwt}", {sys_pub}: "{sys_jwt}" }}\n',
    )
    started.append(srv)
    creds = tmp_path / "router.creds"
    creds.write_text(
        "-----BEGIN NATS USER JWT-----\n"
        f"{user_jwt}\n"
        "------END NATS USER JWT------\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{user.seed.decode()}\n"
        "------END USER NKEY SEED------\n"
    )
    await _round_trip(srv.url, NatsAuth(creds=str(creds)))
    await _refused(srv.url, NatsAuth())  # operator mode: no anonymous clients


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


async def test_mutual_tls(tmp_path: Path, started: list) -> None:
    d = tmp_path / "pki"
    d.mkdir()
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.pem", "-days", "1", "-subj", "/CN=kvgate-test-ca", cwd=d)  # fmt: skip
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                 f"{name}.csr", "-subj", f"/CN={name}", cwd=d)  # fmt: skip
        (d / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile",
                 f"{name}.ext", cwd=d)  # fmt: skip
    srv = _server(
        tmp_path,
        f'tls {{ cert_file: "{d}/server.pem", key_file: "{d}/server.key", '
        f'ca_file: "{d}/ca.pem", verify: true }}\n',
    )
    started.append(srv)
    url = srv.url.replace("nats://", "tls://")
    auth = NatsAuth(tls_ca=str(d / "ca.pem"), tls_cert=str(d / "client.pem"),
                    tls_key=str(d / "client.key"))  # fmt: skip
    await _round_trip(url, auth)
    await _refused(url, NatsAuth(tls_ca=str(d / "ca.pem")))  # no client certificate


def test_auth_methods_are_exclusive_and_files_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="choose one"):
        NatsAuth(token="a", user="u", password="p").connect_kwargs()
    with pytest.raises(ValueError, match="not found"):
        NatsAuth(creds=str(tmp_path / "missing.creds")).connect_kwargs()
    assert "s3cret" not in repr(NatsAuth(user="u", password="s3cret"))
