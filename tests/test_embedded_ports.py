"""free_port hands out ports outside the kernel's ephemeral range (no race with the source
ports of outgoing connections) that a server can bind right after."""

from __future__ import annotations

import socket
from pathlib import Path

from services.common.embedded import free_port


def test_free_ports_are_below_the_ephemeral_range_and_bindable() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) > 40  # spread out, not one port again and again
    for port in ports:
        if low > 12000:
            assert 10000 <= port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
            s.listen()
