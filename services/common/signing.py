"""The api's identity on the bus: it signs what it publishes (policy notices, worker control,
alerts) with an nkey (ed25519), and routers accept those messages only with a valid signature
from a trusted key.

NATS permissions (services.common.permissions) already let only the api's credential publish
these subjects; the signature is the second line: a leaked or over-broad credential that can
publish ``policy.updated`` or ``workers.control.*`` still cannot make a router apply its message.

A signature alone would make a captured message valid forever, so every signed message carries
an :class:`Envelope` that makes it unique and dated (checked by services.common.replay_guard):

- ``Kvgate-Issued-At``: unix milliseconds when it was signed;
- ``Kvgate-Nonce``: 16 random bytes (base64url), never reused;
- ``Kvgate-Instance``: the signing *process* (random per start), so two api replicas sharing one
  key have separate sequences and never reject each other's messages;
- ``Kvgate-Seq``: strictly increasing per instance, and ``>= issued-at-ms * 1000``, so it also
  increases across restarts of a replica (as long as its clock does) without being persisted.

Invariant: a signature covers, in one canonical byte string, a version tag, the subject, every
envelope field and the exact payload bytes: it cannot be moved to another subject (a drain for
one worker is not a drain for another) and no envelope field can be changed without breaking it.
Everything travels in NATS headers, so payload schemas are unchanged and JetStream keeps the
envelope with the stored message.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import nacl.exceptions
import nacl.signing
import nkeys

SIGNER_HEADER = "Kvgate-Signer"  # the signer's public nkey
SIGNATURE_HEADER = "Kvgate-Sig"  # base64url ed25519 signature of Envelope.signed_bytes
INSTANCE_HEADER = "Kvgate-Instance"
SEQ_HEADER = "Kvgate-Seq"
ISSUED_AT_HEADER = "Kvgate-Issued-At"  # unix milliseconds
NONCE_HEADER = "Kvgate-Nonce"

# bumped whenever what the signature covers changes: an old signature never verifies as a new one
SIGNATURE_DOMAIN = b"kvgate-sig-v2"
NONCE_BYTES = 16

# field syntax is checked before verifying, so no field can hold the NUL separator (subjects
# cannot either): the canonical form is unambiguous
_INSTANCE_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_DIGITS_RE = re.compile(r"[0-9]{1,20}")
_NONCE_RE = re.compile(r"[A-Za-z0-9_-]{22}")  # 16 bytes, base64url without padding


@dataclass(frozen=True, slots=True)
class Envelope:
    """What makes one signed message unique and dated (all covered by its signature)."""

    signer: str
    instance: str
    seq: int
    issued_at_ms: int
    nonce: str

    def signed_bytes(self, subject: str, data: bytes) -> bytes:
        fields = (subject, self.signer, self.instance, str(self.seq), str(self.issued_at_ms))
        head = b"\0".join((SIGNATURE_DOMAIN, *(f.encode() for f in fields), self.nonce.encode()))
        return head + b"\0" + data

    def headers(self) -> dict[str, str]:
        return {
            SIGNER_HEADER: self.signer,
            INSTANCE_HEADER: self.instance,
            SEQ_HEADER: str(self.seq),
            ISSUED_AT_HEADER: str(self.issued_at_ms),
            NONCE_HEADER: self.nonce,
        }

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> Envelope | None:
        """The envelope in ``headers``; None when a field is missing or malformed."""
        instance = headers.get(INSTANCE_HEADER, "")
        seq, issued = headers.get(SEQ_HEADER, ""), headers.get(ISSUED_AT_HEADER, "")
        nonce = headers.get(NONCE_HEADER, "")
        if not (
            _INSTANCE_RE.fullmatch(instance)
            and _DIGITS_RE.fullmatch(seq)
            and _DIGITS_RE.fullmatch(issued)
            and _NONCE_RE.fullmatch(nonce)
        ):
            return None
        return cls(headers.get(SIGNER_HEADER, ""), instance, int(seq), int(issued), nonce)


def new_seed() -> bytes:
    """A fresh nkey seed (an account-type key: the api's identity)."""
    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT)


def new_instance_id() -> str:
    return secrets.token_hex(8)


def new_nonce() -> str:
    return secrets.token_urlsafe(NONCE_BYTES)  # base64url, no padding


class Signer:
    """Signs with one seed as one instance. ``clock`` (unix seconds) is injectable so tests can
    sign "long ago" or "in the future"."""

    def __init__(
        self,
        seed: bytes,
        *,
        instance: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._kp = nkeys.from_seed(bytearray(seed.strip()))
        self.public_key = self._kp.public_key.decode()
        self.instance = instance or new_instance_id()
        if not _INSTANCE_RE.fullmatch(self.instance):
            raise ValueError(f"signer instance must match {_INSTANCE_RE.pattern}")
        self.clock = clock
        self._last_seq = 0

    @classmethod
    def from_file(cls, path: str | Path) -> Signer:
        try:
            return cls(Path(path).read_bytes())
        except (OSError, nkeys.NkeysError, ValueError) as exc:
            raise SystemExit(f"cannot read the signing seed {path}: {type(exc).__name__}") from None

    def envelope(self) -> Envelope:
        issued_at_ms = int(self.clock() * 1000)
        # a clock-derived floor keeps seq increasing across restarts; +1 keeps it strictly
        # increasing within one process even if the clock steps back
        self._last_seq = max(self._last_seq + 1, issued_at_ms * 1000)
        return Envelope(self.public_key, self.instance, self._last_seq, issued_at_ms, new_nonce())

    def headers(self, subject: str, data: bytes) -> dict[str, str]:
        """The headers that carry a new envelope and its signature over subject and payload."""
        envelope = self.envelope()
        sig = self._kp.sign(envelope.signed_bytes(subject, data))
        return {**envelope.headers(), SIGNATURE_HEADER: base64.urlsafe_b64encode(sig).decode()}


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


@dataclass(frozen=True, slots=True)
class Verdict:
    """``reason`` "" when the signature checks out (``envelope`` then holds what it covered;
    None when no keys are configured and nothing was checked), else why not (a metric label)."""

    reason: str
    envelope: Envelope | None = None


class Verifier:
    """Checks signatures against the trusted public keys (none configured: checks nothing).
    Only authenticity: whether a message is fresh and new is services.common.replay_guard's."""

    def __init__(self, trusted: Iterable[str]) -> None:
        self.keys = {k: _verify_key(k) for k in (t.strip() for t in trusted) if k}

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def verify(self, subject: str, data: bytes, headers: Mapping[str, str] | None) -> Verdict:
        if not self.keys:
            return Verdict("")
        headers = headers or {}
        signer, sig = headers.get(SIGNER_HEADER, ""), headers.get(SIGNATURE_HEADER, "")
        if not signer or not sig:
            return Verdict("unsigned")
        key = self.keys.get(signer)
        if key is None:
            return Verdict("untrusted_signer")
        envelope = Envelope.from_headers(headers)
        if envelope is None:  # e.g. signed by an api from before envelopes: not verifiable
            return Verdict("bad_envelope")
        try:
            key.verify(envelope.signed_bytes(subject, data), base64.urlsafe_b64decode(sig))
        except (nacl.exceptions.BadSignatureError, binascii.Error, ValueError):
            return Verdict("bad_signature")
        return Verdict("", envelope)

    def reject_reason(self, subject: str, data: bytes, headers: Mapping[str, str] | None) -> str:
        """ "" when the signature checks out, else why not (a metric label)."""
        return self.verify(subject, data, headers).reason
