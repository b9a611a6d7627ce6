"""How long moving a prompt's KV cache from a prefill engine to a decode engine takes.

bytes per token = 2 (K and V) x layers x KV heads x head dim x dtype bytes; a transfer costs a
fixed setup latency plus bytes / link bandwidth. Pure functions over small frozen dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The parts of a model's shape that size its KV cache (default: a Llama-3-8B)."""

    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class LinkProfile:
    """A KV transfer path: sustained bandwidth (bytes/s) and per-transfer setup latency (s)."""

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float


# NVLink within a node (H100 NVLink 4: ~450 GB/s per direction peak; ~300 GB/s sustained for
# KV block copies) and RDMA across nodes (400 Gb/s NIC: 50 GB/s peak, ~40 GB/s sustained).
LINK_PROFILES: dict[str, LinkProfile] = {
    "nvlink": LinkProfile("nvlink", 300e9, 0.0002),
    "rdma": LinkProfile("rdma", 40e9, 0.002),
}
DEFAULT_LINK = "rdma"


def transfer_seconds(tokens: int, shape: ModelShape, link: LinkProfile) -> float:
    """Seconds to move ``tokens`` tokens of KV over ``link`` (0 tokens: nothing to move)."""
    if tokens <= 0:
        return 0.0
    return link.latency_s + tokens * shape.kv_bytes_per_token / link.bandwidth_bytes_per_s
