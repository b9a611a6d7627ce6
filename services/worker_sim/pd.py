"""Prefill/decode disaggregation in the simulated worker: the two engines' handshakes and the
simulated KV transfer between a prefill worker and a decode worker.

Handshakes (field names as the engines' own code reads and writes them; checked against the
wheels by tests/test_pd_conformance.py):

- vLLM NIXL (``kv_transfer_params``). The prefill request carries ``do_remote_decode: true``;
  the prefill worker computes the prompt, keeps its blocks (``Engine.held``) and answers with
  ``kv_transfer_params`` naming them (``remote_engine_id``, ``remote_request_id``,
  ``remote_block_ids``, ``remote_host``, ``remote_port``, ``tp_size``, ...). The decode
  request carries those with ``do_remote_prefill: true``; the decoder reserves blocks for the
  prompt, pulls the KV from ``remote_host:remote_port`` and decodes. The prefill blocks are
  freed when the decoder has read them, or when the lease runs out (vLLM 0.33:
  ``kv_connector_extra_config.kv_lease_duration``, 30 s). A decoder whose pull fails
  recomputes the prompt (vLLM's ``kv_load_failure_policy: recompute``).
- SGLang bootstrap (``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room``). The router
  sends the same request to both at once; the decoder asks the prefill worker's bootstrap
  address for the room's KV and waits for the prefill to finish (up to the bootstrap
  timeout); a failed transfer fails the decode request, as SGLang's does.

The simulated transfer runs over the workers' HTTP ports: ``POST /kvgate/pd/pull`` on the
prefill worker (its ``remote_host:remote_port`` and its bootstrap address) waits for the
prefill, holds the connection for the transfer time (``services.core.pd.transfer``: the
prompt's KV bytes over the link), frees the held blocks and answers the token count.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, Literal

from services.core.pd.transfer import LINK_PROFILES, ModelShape, transfer_seconds
from services.worker_sim.openai_api import ApiError

Role = Literal["both", "prefill", "decode"]
ROLES: tuple[str, ...] = ("both", "prefill", "decode")
PULL_PATH = "/kvgate/pd/pull"
# vLLM's NIXL connector reads these from a decode request's kv_transfer_params; without all of
# them it logs "Got invalid KVTransferParams" and prefills locally
NIXL_DECODE_REQUIRED = (
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "remote_block_ids",
    "tp_size",
)
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


@dataclass(frozen=True)
class PdSettings:
    role: str = "both"
    link: str = "rdma"
    shape: ModelShape = field(default_factory=ModelShape)
    # simulated seconds: vLLM 0.33's kv_lease_duration (held prefill blocks are freed after
    # it) and how long a decoder's pull waits for its bootstrap room's prefill
    lease_s: float = 30.0
    bootstrap_timeout_s: float = 30.0

    def transfer_s(self, tokens: int) -> float:
        return transfer_seconds(tokens, self.shape, LINK_PROFILES[self.link])


@dataclass(frozen=True)
class Handshake:
    """What a request asks of P/D: ``side`` "prefill" (compute and keep the KV for a decoder)
    or "decode" (receive the KV); ``kind`` "nixl" or "bootstrap"; ``pull`` the prefill
    worker's transfer address (decode side) and ``key`` what names the KV there."""

    kind: Literal["nixl", "bootstrap"]
    side: Literal["prefill", "decode"]
    key: str  # nixl: remote_request_id (decode) ; bootstrap: the room
    pull_url: str = ""
    engine_id: str = ""


def parse_handshake(body: dict[str, Any], role: str) -> Handshake | None:
    """The request's P/D part, or None (a colocated request). A malformed one is an ApiError."""
    params = body.get("kv_transfer_params")
    if params is not None:
        if not isinstance(params, dict):
            raise ApiError(400, "'kv_transfer_params' must be an object", "kv_transfer_params")
        if params.get("do_remote_decode"):
            return Handshake("nixl", "prefill", key="")
        if params.get("do_remote_prefill"):
            if any(params.get(k) is None for k in NIXL_DECODE_REQUIRED):
                return None  # like vLLM: invalid params -> the prompt is prefilled here
            host, port = params["remote_host"], params["remote_port"]
            if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int):
                raise ApiError(
                    400, "kv_transfer_params: remote_host / remote_port", "kv_transfer_params"
                )
            return Handshake(
                "nixl",
                "decode",
                key=str(params["remote_request_id"]),
                pull_url=f"http://{host}:{port}{PULL_PATH}",
                engine_id=str(params["remote_engine_id"]),
            )
        return None
    room = body.get("bootstrap_room")
    if room is None or role == "both":  # SGLang without --disaggregation-mode ignores them
        return None
    if isinstance(room, bool) or not isinstance(room, int) or room < 0:
        raise ApiError(400, "'bootstrap_room' must be a non-negative integer", "bootstrap_room")
    if role == "prefill":
        return Handshake("bootstrap", "prefill", key=str(room))
    host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
    if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int):
        raise ApiError(
            400, "a decode request needs 'bootstrap_host' and 'bootstrap_port'", "bootstrap_host"
        )
    return Handshake(
        "bootstrap", "decode", key=str(room), pull_url=f"http://{host}:{port}{PULL_PATH}"
    )


def nixl_response_params(
    engine_id: str, request_id: str, block_ids: list[int], host: str, port: int, tokens: int
) -> dict[str, Any]:
    """The ``kv_transfer_params`` a vLLM 0.33 prefill (NIXL, pull mode) answers with
    (``NixlConnectorScheduler.request_finished``); the router passes them to the decoder."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(block_ids)],  # one list per KV cache group
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": tokens,
        "remote_blocks_expiry_time": None,
        "remote_registration_generation": 0,
        "transfer_mode": "pull",
    }


@dataclass
class HeldKv:
    """A finished prefill's KV, held for its decoder."""

    engine_rid: str
    tokens: int
    lease: asyncio.TimerHandle | None = None


class PrefillSide:
    """The prefill worker's half: what it holds, by key, and the waits of early decoders.

    ``release`` is the engine's ``release_held`` (frees the blocks); every held KV is released
    exactly once: by a pull, by its lease, or when the worker stops."""

    def __init__(self, settings: PdSettings, release: Any, speedup: float = 1.0) -> None:
        self.settings = settings
        self.speedup = speedup  # leases and waits run on the simulated clock
        self._release = release
        self.held: dict[str, HeldKv] = {}
        self._ready: dict[str, asyncio.Future[HeldKv | None]] = {}
        self.lease_expired = 0
        self.pulled = 0

    def _future(self, key: str) -> asyncio.Future[HeldKv | None]:
        f = self._ready.get(key)
        if f is None:
            f = self._ready[key] = asyncio.get_running_loop().create_future()
        return f

    def finished(self, key: str, engine_rid: str, tokens: int, held: bool) -> None:
        """The keyed prefill finished; ``held``: its blocks are in the engine's held set."""
        kv = HeldKv(engine_rid, tokens) if held else None
        if kv is not None:
            self.held[key] = kv
            loop = asyncio.get_running_loop()
            kv.lease = loop.call_later(self.settings.lease_s / self.speedup, self._expire, key)
        f = self._future(key)
        if not f.done():
            f.set_result(kv)

    def failed(self, key: str) -> None:
        """The keyed prefill ended without KV (aborted, error): a waiting decoder fails."""
        f = self._future(key)
        if not f.done():
            f.set_result(None)

    def _expire(self, key: str) -> None:
        kv = self.held.pop(key, None)
        self._ready.pop(key, None)
        if kv is not None:
            self.lease_expired += 1
            self._release(kv.engine_rid)

    async def pull(self, key: str, wait: bool) -> int | None:
        """A decoder reads the keyed KV: wait for its prefill when ``wait`` (bootstrap: the
        decoder may come first; NIXL: the prefill answered before the decode request was
        sent), transfer, free. None: nothing to read (unknown, expired, or failed)."""
        if not wait and key not in self.held:
            return None
        f = self._future(key)
        try:
            timeout = self.settings.bootstrap_timeout_s / self.speedup
            kv = await asyncio.wait_for(asyncio.shield(f), timeout)
        except TimeoutError:
            self._ready.pop(key, None)
            return None
        if kv is None or self.held.get(key) is not kv:
            self._ready.pop(key, None)
            return None
        if kv.lease is not None:
            kv.lease.cancel()
        await asyncio.sleep(self.settings.transfer_s(kv.tokens) / self.speedup)  # the KV transfer
        self.held.pop(key, None)
        self._ready.pop(key, None)
        self._release(kv.engine_rid)
        self.pulled += 1
        return kv.tokens

    def close(self) -> None:
        for key in list(self.held):
            kv = self.held.pop(key)
            if kv.lease is not None:
                kv.lease.cancel()
        for f in self._ready.values():
            if not f.done():
                f.set_result(None)
        self._ready.clear()


async def pull_kv(session: Any, h: Handshake, timeout_s: float) -> int | None:
    """The decoder's read of its prompt's KV from the prefill worker: the token count, or None
    when the prefill worker cannot give it (gone, expired, failed)."""
    import aiohttp

    body = {"kind": h.kind, "key": h.key, "engine_id": h.engine_id}
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
        async with session.post(
            h.pull_url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status == 200:
                out = await resp.json()
                return int(out["tokens"])
    return None
