"""Local process lookup for pid-based GPU mapping (Linux /proc; empty results elsewhere).

- :func:`listening_pids` finds the processes with a listening TCP socket on a port.
- :func:`with_descendants` adds every descendant (vLLM runs its GPU work in a child process).
- :func:`is_local_host` tells whether a host name or address is this node (``--local-only``).

Both are best effort and bounded: a /proc entry that vanishes or is unreadable (another
user's process) is skipped, never an error.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

PROC = Path("/proc")


def _listening_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("net/tcp", "net/tcp6"):
        try:
            lines = (PROC / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10 or cols[3] != "0A":  # 0A = LISTEN
                continue
            if int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes


def listening_pids(port: int) -> set[int]:
    """Pids of processes holding a listening socket on ``port``."""
    inodes = _listening_inodes(port)
    if not inodes:
        return set()
    wanted = {f"socket:[{i}]" for i in inodes}
    pids: set[int] = set()
    for entry in PROC.iterdir() if PROC.exists() else ():
        if not entry.name.isdigit():
            continue
        fd_dir = entry / "fd"
        try:
            for fd in os.scandir(fd_dir):
                try:
                    if os.readlink(fd.path) in wanted:
                        pids.add(int(entry.name))
                        break
                except OSError:
                    continue
        except OSError:
            continue
    return pids


def with_descendants(pids: set[int]) -> set[int]:
    """``pids`` plus all their descendants (by parent pid in /proc/<pid>/stat)."""
    if not pids:
        return set()
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir() if PROC.exists() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # comm may contain spaces/parens: the ppid is the 2nd field after the last ')'
        rest = stat.rsplit(")", 1)[-1].split()
        if len(rest) >= 2:
            children.setdefault(int(rest[1]), []).append(int(entry.name))
    out = set(pids)
    stack = list(pids)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in out:
                out.add(child)
                stack.append(child)
    return out


def is_local_host(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this node: a loopback name or address, or
    an address assigned to one of its interfaces -- tested by binding a UDP socket to it,
    which the kernel allows only for local addresses. Blocking (name resolution): call it
    off the event loop. An unresolvable host is not local."""
    if host in ("localhost", "") or host == socket.gethostname():
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        ip = addr[0]
        if ip.startswith("127.") or ip == "::1":
            return True
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.bind((ip, 0) if family == socket.AF_INET else (ip, 0, 0, addr[3]))
        except OSError:
            continue
        return True
    return False
