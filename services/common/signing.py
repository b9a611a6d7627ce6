"""The api's identity on the bus: it signs what it publishes (policy notices, worker control,
alerts) with an nkey (ed25519), and routers accept those messages only with a valid signature
from a trusted key.

NATS permissions (services.common.permissions) already let only the api's credential publish
these subjects; the signature is the second line: a leaked or over-broad credential that can
publish ``policy.updated`` or ``workers.control.*`` still cannot make a router apply its message.

Invariant: a signature covers the exact payload bytes and the subject, so it cannot be replayed on
another subject (a drain for one worker is not a drain for another). Signatures travel in NATS
headers, so the payload schema is unchanged and JetStream keeps them with the stored message.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import nacl.exceptions
import nacl.signing
import nkeys

SIGNER_HEADER = "Kvgate-Signer"  # the signer's public nkey
SIGNATURE_HEADER = "Kvgate-Sig"  # base64url ed25519 signature of subject + NUL + payload


def _signed_bytes(subject: str, data: bytes) -> bytes:
    return subject.encode() + b"\0" + data


def new_seed() -> bytes:
    """A fresh nkey seed (an account-type key: the api's identity)."""
    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT)


class Signer:
    def __init__(self, seed: bytes) -> None:
        self._kp = nkeys.from_seed(bytearray(seed.strip()))
        self.public_key = self._kp.public_key.decode()

    @classmethod
    def from_file(cls, path: str | Path) -> Signer:
        try:
            return cls(Path(path).read_bytes())
        except (OSError, nkeys.NkeysError, ValueError) as exc:
            raise SystemExit(f"cannot read the signing seed {path}: {type(exc).__name__}") from None

    def headers(self, subject: str, data: bytes) -> dict[str, str]:
        sig = self._kp.sign(_signed_bytes(subject, data))
        return {
            SIGNER_HEADER: self.public_key,
            SIGNATURE_HEADER: base64.urlsafe_b64encode(sig).decode(),
        }


def _verify_key(public_key: str) -> nacl.signing.VerifyKey:
    """The ed25519 key inside a public nkey (base32: prefix byte, 32 key bytes, CRC16)."""
    try:
        raw = base64.b32decode(public_key + "=" * (-len(public_key) % 8))
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not a public nkey: {public_key!r}") from exc
    if len(raw) != 35 or not nkeys.valid_public_prefix_byte(raw[0]):
        raise ValueError(f"not a public nkey: {public_key!r}")
    if nkeys.crc16_checksum(raw[:33]) != raw[33:]:
        raise ValueError(f"public nkey with a bad checksum: {public_key!r}")
    return nacl.signing.VerifyKey(raw[1:33])


class Verifier:
    """Checks signatures against the trusted public keys (none configured: checks nothing)."""

    def __init__(self, trusted: Iterable[str]) -> None:
        self.keys = {k: _verify_key(k) for k in (t.strip() for t in trusted) if k}

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def reject_reason(self, subject: str, data: bytes, headers: Mapping[str, str] | None) -> str:
        """ "" when the message is acceptable, else why not (a metric label)."""
        if not self.keys:
            return ""
        headers = headers or {}
        signer, sig = headers.get(SIGNER_HEADER, ""), headers.get(SIGNATURE_HEADER, "")
        if not signer or not sig:
            return "unsigned"
        key = self.keys.get(signer)
        if key is None:
            return "untrusted_signer"
        try:
            key.verify(_signed_bytes(subject, data), base64.urlsafe_b64decode(sig))
        except (nacl.exceptions.BadSignatureError, binascii.Error, ValueError):
            return "bad_signature"
        return ""
