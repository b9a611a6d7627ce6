"""The running embedded stack, as ``kvgate up`` leaves it on disk for the other commands.

``<state_dir>/stack.json`` records where the stack started by ``kvgate up`` listens (URLs,
ports) and which processes it runs (pids); ``<state_dir>/admin-token`` holds the admin token
``kvgate up`` creates on its first start (mode 0600, kept across restarts). Commands such as
``kvgate status``, ``kvgate alerts tail``, ``kvgate index verify`` and ``kvgate api token`` read
the stack file to find the stack when they are given no URL; the operator tools also log in to
its NATS with the ``operator`` password from ``<state_dir>/nats/passwords.json`` (owner-only).

Invariants:
- While a ``kvgate up`` supervises a state dir it holds an exclusive ``flock`` on
  ``<state_dir>/up.lock``; a second one fails to take it and refuses to start.
- ``stack.json`` exists only while its supervisor runs, or after one died without cleaning
  up (a *stale* file: its lock is free). A new supervisor first stops the stale run's
  nats-server and Postgres (checked against the state dir, so no other process is touched).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from services.common.bus import NatsAuth

STACK_FILE = "stack.json"
LOCK_FILE = "up.lock"
TOKEN_FILE = "admin-token"
CLIENT_KEY_FILE = "router-api-key"  # the client API key of the stack's OpenAI endpoint
CLIENT_KEY_PREFIX = "kvc_"
TOKEN_PREFIX = "kvg_"
NATS_PASSWORDS_FILE = "nats/passwords.json"  # role -> password of the embedded NATS's users


@dataclass
class StackState:
    """What a running ``kvgate up`` exposes; written once the stack is ready."""

    pid: int  # the supervisor
    started_at: float
    state_dir: str
    nats_url: str
    database_url: str
    subject_prefix: str = ""
    urls: dict[str, str] = field(default_factory=dict)  # service -> base URL
    ports: dict[str, int] = field(default_factory=dict)  # service -> port
    pids: dict[str, int] = field(default_factory=dict)  # process name -> pid
    admin_token_file: str = ""
    client_key_file: str = ""  # empty: the router's keys came from the environment, or none

    @classmethod
    def from_dict(cls, d: dict) -> StackState:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


def stack_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / STACK_FILE


def write_state(state: StackState) -> Path:
    """Write atomically (rename), readable only by the owner (it names the database)."""
    path = stack_path(state.state_dir)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(state), f, indent=2, sort_keys=True)
    os.replace(tmp, path)
    return path


def read_state(state_dir: str | Path) -> StackState | None:
    path = stack_path(state_dir)
    try:
        return StackState.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def remove_state(state_dir: str | Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        stack_path(state_dir).unlink()


# ---------------------------------------------------------------------- the supervisor's lock
class StackRunning(RuntimeError):
    """Another ``kvgate up`` supervises this state dir."""


def acquire_lock(state_dir: str | Path) -> IO[str]:
    """Take the state dir's lock (kept while the returned file stays open)."""
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    f = open(Path(state_dir) / LOCK_FILE, "a+")  # noqa: SIM115 - held for the stack's lifetime
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        other = read_state(state_dir)
        who = f" (pid {other.pid})" if other else ""
        raise StackRunning(
            f"another 'kvgate up'{who} is running on {Path(state_dir).resolve()}; "
            "stop it first, or use another --state-dir"
        ) from None
    return f


def is_running(state_dir: str | Path) -> bool:
    """True while a supervisor holds the state dir's lock."""
    path = Path(state_dir) / LOCK_FILE
    if not path.exists():
        return False
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def running_stack(state_dir: str | Path) -> StackState | None:
    """The stack file of a *running* stack (None when there is none, or it is stale)."""
    state = read_state(state_dir)
    if state is None or not is_running(state_dir):
        return None
    return state


def nats_passwords_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / NATS_PASSWORDS_FILE


def operator_auth(state_dir: str | Path) -> NatsAuth:
    """The operator credential ``kvgate up`` generated for its embedded NATS (none when it runs
    without authorization). The operator role may read alerts and ask the indexer, no more."""
    from services.common.bus import NatsAuth

    try:
        passwords = json.loads(nats_passwords_path(state_dir).read_text())
    except (OSError, ValueError):
        return NatsAuth()
    if not isinstance(passwords, dict) or "operator" not in passwords:
        return NatsAuth()
    return NatsAuth(user="operator", password=str(passwords["operator"]))


# ---------------------------------------------------------------------- stale runs
def _cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is dead for our purposes
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _stop_pid(pid: int, sig: signal.Signals, timeout_s: float) -> bool:
    """Signal ``pid``, wait for it to go; SIGKILL when it does not. True if it was running."""
    if not _alive(pid):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return True


def postmaster_pid(pgdata: str | Path) -> int | None:
    try:
        return int((Path(pgdata) / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None


def clean_stale(state_dir: str | Path) -> list[str]:
    """Stop what a dead supervisor left on ``state_dir``; returns what was stopped.

    Call with the lock held. Only processes whose command line names this state dir are
    touched (pids get reused). Postgres gets SIGINT (its fast shutdown); nats-server SIGTERM.
    """
    state_dir = Path(state_dir).resolve()
    stopped: list[str] = []
    state = read_state(state_dir)
    if state is not None:
        for name, pid in state.pids.items():
            if name == "postgres":
                continue
            if str(state_dir) in _cmdline(pid) and _stop_pid(pid, signal.SIGTERM, 10.0):
                stopped.append(f"{name} (pid {pid})")
    pgdata = state_dir / "postgres"
    pid = postmaster_pid(pgdata)
    if pid is not None and str(pgdata) in _cmdline(pid) and _stop_pid(pid, signal.SIGINT, 15.0):
        stopped.append(f"postgres (pid {pid})")
    # pgserver counts the processes holding its server here; a dead holder's entry would keep
    # the next run from ever stopping Postgres
    with contextlib.suppress(FileNotFoundError):
        (pgdata / ".handle_pids.json").unlink()
    remove_state(state_dir)
    return stopped


# ---------------------------------------------------------------------- the admin token
def ensure_admin_token(state_dir: str | Path) -> tuple[str, bool]:
    """The state dir's admin token, created on first use; returns (token, created_now)."""
    return _ensure_secret(Path(state_dir) / TOKEN_FILE, TOKEN_PREFIX)


def ensure_client_key(state_dir: str | Path) -> tuple[str, bool]:
    """The state dir's client API key for the router, created on first use."""
    return _ensure_secret(Path(state_dir) / CLIENT_KEY_FILE, CLIENT_KEY_PREFIX)


def read_client_key(state_dir: str | Path) -> str | None:
    try:
        return (Path(state_dir) / CLIENT_KEY_FILE).read_text().strip() or None
    except OSError:
        return None


def _ensure_secret(path: Path, prefix: str) -> tuple[str, bool]:
    with contextlib.suppress(FileNotFoundError):
        secret = path.read_text().strip()
        if secret:
            return secret, False
    secret = prefix + secrets.token_urlsafe(32)
    write_private(path, secret + "\n")
    return secret, True


def write_private(path: str | Path, text: str) -> None:
    """Write ``text`` to a file only its owner may read (created so: never readable first)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def read_admin_token(state_dir: str | Path) -> str | None:
    try:
        return (Path(state_dir) / TOKEN_FILE).read_text().strip() or None
    except OSError:
        return None


def given(args: object, name: str, env_var: str) -> bool:
    """Whether an option was set explicitly (its flag or its environment variable)."""
    return getattr(args, name, None) is not None or env_var in os.environ
