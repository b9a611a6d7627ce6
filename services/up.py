"""``kvgate up``: the whole control plane on one machine, no Docker.

Starts (unless URLs are given) a real nats-server with JetStream and a real PostgreSQL, both
keeping their data under ``--state-dir``; applies migrations; then runs the services as child
processes: simulated workers, kv_indexer (``--indexers N``: a highly available group of N),
telemetry, api and router (and, with ``--epp-port``, ``kvgate epp``: the router's decision
core as a Gateway API Inference Extension endpoint picker, on the same bus and cluster state).
Prints the URLs, restarts a child that dies (with backoff), and on
Ctrl-C / SIGTERM stops the children (SIGTERM, then SIGKILL after a grace period) before the
embedded servers, so nothing is orphaned and JetStream / Postgres shut down cleanly.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from services.common import settings as S
from services.common import stackfile
from services.common.embedded import (
    EmbeddedNats,
    EmbeddedNatsCluster,
    EmbeddedPostgres,
    env_without_proxy,
    nats_url_reachable,
    port_open,
)
from services.common.logging import configure_logging, get_logger
from services.common.permissions import Grant, render_authorization
from services.common.redact import redact_url
from services.common.signing import Signer, new_seed
from services.common.subjects import Subjects
from services.nats_config import grants as nats_grants
from services.nats_config import worker_grant

OPTIONS = (
    S.option(
        "up_nats_url",
        "",
        "use this NATS instead of starting an embedded one",
        flag="--nats-url",
        env="KVGATE_UP_NATS_URL",
    ),
    S.option(
        "up_database_url",
        "",
        "use this Postgres instead of starting an embedded one",
        flag="--database-url",
        env="KVGATE_UP_DATABASE_URL",
    ),
    S.option(
        "workers",
        -1,
        "number of simulated (colocated) workers to start (0: none; -1: 4, or none when "
        "--prefill-workers / --decode-workers are given)",
        env="KVGATE_UP_WORKERS",
    ),
    S.option(
        "prefill_workers",
        0,
        "disaggregated serving: simulated prefill-only workers (role prefill, ids prefill-<i>, "
        "ports after the --workers ones); with P/D workers the router's default policy is "
        "pd_slo",
        env="KVGATE_UP_PREFILL_WORKERS",
    ),
    S.option(
        "decode_workers",
        0,
        "disaggregated serving: simulated decode-only workers (role decode, ids decode-<i>, "
        "ports after the prefill ones)",
        env="KVGATE_UP_DECODE_WORKERS",
    ),
    S.option("router_port", 8080, "router (OpenAI API) port", env="KVGATE_ROUTER_PORT"),
    S.option("api_port", 8081, "admin API port", env="KVGATE_API_PORT"),
    S.option(
        "epp_port",
        0,
        "also run `kvgate epp` (the Gateway API Inference Extension endpoint picker: Envoy "
        "ext_proc + gRPC health) on this port, beside the router, deciding from the same "
        "cluster state; 0: none",
        env="KVGATE_UP_EPP_PORT",
    ),
    S.option(
        "epp_operator_port",
        8085,
        "the endpoint picker's operator port (/health, /metrics, /debug/*), with --epp-port",
        env="KVGATE_UP_EPP_OPERATOR_PORT",
    ),
    S.option(
        "router_operator_port",
        8084,
        "router's operator port (/metrics, /debug/*)",
        env="KVGATE_ROUTER_OPERATOR_PORT",
    ),
    S.option(
        "indexer_port",
        8082,
        "kv_indexer HTTP (health, metrics, debug) port",
        env="KVGATE_INDEXER_PORT",
    ),
    S.option(
        "telemetry_port", 8083, "telemetry HTTP (health, metrics) port", env="KVGATE_TELEMETRY_PORT"
    ),
    S.option("sim_port", 8100, "first simulated worker port", env="KVGATE_SIM_PORT"),
    S.option(
        "indexers",
        1,
        "kv_indexer processes: 1 = one indexer; 2 or more = a highly available group (one"
        " publishes, elected by a JetStream KV lease; the others stand by with a warm index),"
        " on --indexer-port, --indexer-port + 1, ...",
        env="KVGATE_UP_INDEXERS",
    ),
    S.option(
        "nats_cluster",
        1,
        "embedded NATS nodes: 1 = one server; 3 = a JetStream cluster of three servers"
        " (streams at 3 replicas, any one node may fail)",
        env="KVGATE_UP_NATS_CLUSTER",
    ),
    S.option(
        "bridge",
        "",
        "also run `kvgate bridge <engine>` (vllm, sglang, trtllm) for a local engine; its "
        "endpoints come from KVGATE_BRIDGE_* (see kvgate bridge --help). '' = none",
        choices=["", "vllm", "sglang", "trtllm"],
        env="KVGATE_UP_BRIDGE",
    ),
    S.option("bridge_port", 8090, "bridge HTTP (health, metrics) port", env="KVGATE_BRIDGE_PORT"),
    S.option(
        "embedded_nats_port",
        0,
        "port of the embedded NATS (0: a free one)",
        env="KVGATE_EMBEDDED_NATS_PORT",
    ),
    S.STATE_DIR,
    S.SUBJECT_PREFIX,
    S.LOG_LEVEL,
    S.LOG_FORMAT,
    S.option(
        "open_router",
        False,
        "serve /v1/* without client API keys (insecure: anyone reaching the port may use it);"
        " default: a key is generated, kept in the state dir and printed, or taken from"
        " KVGATE_ROUTER_API_KEYS",
        env="KVGATE_UP_OPEN_ROUTER",
    ),
    S.option(
        "insecure_nats",
        False,
        "start the embedded NATS without authorization (every client may publish anything)",
        env="KVGATE_UP_INSECURE_NATS",
    ),
    S.option(
        "ready_timeout",
        60.0,
        "seconds to wait for the stack to become ready",
        env="KVGATE_UP_READY_TIMEOUT",
    ),
)

_PR_SET_PDEATHSIG = 1
ROUTER_CLOSE_MARGIN_S = 5.0  # after its drain: closing the bus, flushing outcomes


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # pragma: no cover - not Linux
        pass


@dataclass
class Child:
    name: str
    argv: list[str]
    health_url: str | None
    proc: subprocess.Popen | None = None
    restarts: list[float] = field(default_factory=list)
    role: str = ""  # NATS role (services.common.permissions); its credential goes in its env
    env: dict[str, str] = field(default_factory=dict)  # added to the stack's environment

    def start(self, env: dict[str, str], log_dir: Path) -> None:
        out = open(log_dir / f"{self.name}.log", "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            self.argv,
            env={**env, **self.env},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
            # own process group: a terminal's Ctrl-C reaches only the supervisor, which then
            # stops children in order
            start_new_session=True,
        )
        out.close()


def _http_ok(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:  # noqa: S310 - local URL
            if resp.status == 200:
                body = resp.read()
                try:
                    return json.loads(body)
                except ValueError:
                    return {}
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return None


def router_stop_grace_s() -> float:
    """How long the router may take to stop: its drain (--drain-timeout-s, from the
    environment it inherits from this process) and its close, before SIGKILL."""
    from services.router.readiness import DEFAULT_DRAIN_TIMEOUT_S

    try:
        drain = float(os.environ.get("KVGATE_ROUTER_DRAIN_TIMEOUT_S", DEFAULT_DRAIN_TIMEOUT_S))
    except ValueError:  # the router refuses it at start; nothing to drain
        drain = DEFAULT_DRAIN_TIMEOUT_S
    return max(drain, 0.0) + ROUTER_CLOSE_MARGIN_S


class Stack:
    def __init__(self, st: S.Settings) -> None:
        self.st = st
        if st.workers < 0:  # the default: a colocated fleet, unless P/D workers are asked for
            st.workers = 0 if st.prefill_workers > 0 or st.decode_workers > 0 else 4
        self.log = get_logger("up")
        self.state_dir = Path(st.state_dir).resolve()
        self.log_dir = self.state_dir / "logs"
        self.nats: EmbeddedNats | EmbeddedNatsCluster | None = None
        self.pg: EmbeddedPostgres | None = None
        self.children: list[Child] = []
        self.stopping = False
        self.nats_passwords: dict[str, str] = {}  # user -> password (embedded NATS only)
        self.api_secrets: dict[str, str] = {}  # the admin token and database URL: api only
        self.router_secrets: dict[str, str] = {}  # its client API keys (a digest file)
        self.client_key_file = ""
        self.lock = None  # the state dir's lock file, held while this stack runs

    # ------------------------------------------------------------------ infrastructure
    def start_infra(self) -> tuple[str, str]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        nats_url = self.st.up_nats_url
        if nats_url:
            if not nats_url_reachable(nats_url):
                self.log.warning(
                    "given NATS is not reachable yet; services will keep retrying", url=nats_url
                )
        elif self.st.nats_cluster > 1:
            authorization = "" if self.st.insecure_nats else self._nats_authorization()
            self.nats = EmbeddedNatsCluster(
                self.state_dir / "nats", size=self.st.nats_cluster, authorization=authorization
            )
            nats_url = self.nats.start()
        else:
            authorization = "" if self.st.insecure_nats else self._nats_authorization()
            self.nats = EmbeddedNats(
                self.state_dir / "nats",
                port=self.st.embedded_nats_port,
                authorization=authorization,
            )
            nats_url = self.nats.start()
        db_url = self.st.up_database_url
        if not db_url:
            self.pg = EmbeddedPostgres(self.state_dir / "postgres")
            self.pg.start()
            db_url = self.pg.sqlalchemy_url("kvgate")
        return nats_url, db_url

    def sim_groups(self) -> list[tuple[str, str, int, int]]:
        """The simulated worker processes: (child name, role, first port, count); colocated
        workers first, then prefill, then decode workers on the ports after them."""
        st = self.st
        out = []
        port = st.sim_port
        for name, role, n in (
            ("sim-workers", "both", st.workers),
            ("sim-prefill", "prefill", st.prefill_workers),
            ("sim-decode", "decode", st.decode_workers),
        ):
            if n > 0:
                out.append((name, role, port, n))
                port += n
        return out

    @property
    def total_workers(self) -> int:
        return sum(n for *_, n in self.sim_groups())

    @property
    def disaggregated(self) -> bool:
        return self.st.prefill_workers > 0 or self.st.decode_workers > 0

    def _worker_ids(self) -> list[str]:
        from services.worker_sim.app import worker_ids

        ids: list[str] = []
        for _name, role, _port, n in self.sim_groups():
            ids += worker_ids("sim" if role == "both" else role, n)
        return ids

    def _nats_authorization(self) -> str:
        """One NATS user per role with a random password, kept (owner-only) in the state dir
        so a restart reuses them; the server config is generated from the same grants."""
        path = stackfile.nats_passwords_path(self.state_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError):
            stored = {}
        # one user per role, and one per worker (worker-<id>, speaking for that id only)
        workers = self._worker_ids() + ([self.bridge_worker_id()] if self.st.bridge else [])
        grants = nats_grants(0, workers)
        self.nats_passwords = {
            g.user: str(stored.get(g.user) or secrets.token_urlsafe(24)) for g in grants
        }
        stackfile.write_private(path, json.dumps(self.nats_passwords))

        def password(g: Grant) -> str:
            return self.nats_passwords[g.user]

        return render_authorization(grants, Subjects(self.st.subject_prefix), password)

    def role_env(self, user: str) -> dict[str, str]:
        """The NATS credential of a child (nothing when NATS runs without authorization)."""
        if user not in self.nats_passwords:
            return {}
        return {"KVGATE_NATS_USER": user, "KVGATE_NATS_PASSWORD": self.nats_passwords[user]}

    def sim_env(self) -> dict[str, str]:
        """The simulated workers' own credentials: each logs in as worker-<id>."""
        pairs = [
            f"{w}={self.nats_passwords[worker_grant(w).user]}"
            for w in self._worker_ids()
            if worker_grant(w).user in self.nats_passwords
        ]
        return {"KVGATE_SIM_WORKER_PASSWORDS": ",".join(pairs)} if pairs else {}

    def bridge_worker_id(self) -> str:
        """The worker id the bridge publishes as (its own setting, else its default)."""
        from services.kv_indexer.bridges.cli import OPTIONS as BRIDGE_OPTIONS
        from services.kv_indexer.bridges.cli import default_worker_id

        bst = S.resolve(None, BRIDGE_OPTIONS)
        return bst.worker_id or default_worker_id(self.st.bridge, bst.topic)

    def client_keys(self) -> tuple[str, bool]:
        """The router's client API key: KVGATE_ROUTER_API_KEYS if given, else this state dir's
        own (made once, owner-only); the router gets only its digest, in a file. Returns the
        key ("" when given in the environment or --open-router) and whether it was made now."""
        if self.st.open_router:
            return "", False
        given = os.environ.get("KVGATE_ROUTER_API_KEYS", "")
        if given:
            self.router_secrets = {"KVGATE_ROUTER_API_KEYS": given}
            return "", False
        key, created = stackfile.ensure_client_key(self.state_dir)
        self.client_key_file = str(self.state_dir / stackfile.CLIENT_KEY_FILE)
        digest_file = self.state_dir / "router-api-keys.sha256"
        stackfile.write_private(digest_file, f"sha256:{hashlib.sha256(key.encode()).hexdigest()}\n")
        self.router_secrets = {"KVGATE_ROUTER_API_KEYS_FILE": str(digest_file)}
        return key, created

    def provision_bus(self, env: dict[str, str]) -> None:
        """Create kvgate's JetStream streams with the provisioner's credential (held by this
        supervisor only, never by a child)."""
        cmd = [sys.executable, "-m", "services.cli", "bus", "provision"]
        result = subprocess.run(
            cmd,
            env={**env, **self.role_env("provisioner")},
            capture_output=True,
            text=True,
            timeout=120,
        )
        if result.returncode != 0:
            if self.nats is None:  # a NATS of the user's: the provisioner may be someone else
                self.log.warning(
                    "could not provision the streams: run `kvgate bus provision` with the"
                    " provisioner credential; services wait for them",
                    error=result.stderr.strip()[-300:],
                )
                return
            raise RuntimeError(f"stream provisioning failed:\n{result.stdout}\n{result.stderr}")
        self.log.info("streams provisioned", result=result.stdout.strip().replace("\n", "; "))

    def migrate(self, env: dict[str, str]) -> None:
        cmd = [sys.executable, "-m", "services.cli", "migrate", "upgrade"]
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"migrations failed:\n{result.stdout}\n{result.stderr}")
        self.log.info("migrations applied")

    # ------------------------------------------------------------------ children
    def plan(self) -> list[Child]:
        st, py = self.st, [sys.executable, "-m", "services.cli"]
        host = "127.0.0.1"
        kids: list[Child] = []
        for name, role, port, n in self.sim_groups():
            cmd = py + ["sim-worker", "--count", str(n), "--port", str(port)]
            if role != "both":  # P/D: ids prefill-<i> / decode-<i>, the role in heartbeats
                cmd += ["--worker-id", role, "--role", role]
            kids.append(Child(name, cmd, f"http://{host}:{port}/health", role="worker"))
        kids += [
            Child(
                name,
                py + ["indexer", "--port", str(port)],
                f"http://{host}:{port}/health",
                role="indexer",
                env={"KVGATE_INDEXER_HA_ID": name} if st.indexers > 1 else {},
            )
            for name, port in self.indexer_ports().items()
        ]
        kids += [
            Child(
                "telemetry",
                py + ["telemetry", "--port", str(st.telemetry_port)],
                f"http://{host}:{st.telemetry_port}/health",
                role="telemetry",
            ),
            Child(
                "api",
                py + ["api", "--port", str(st.api_port)],
                f"http://{host}:{st.api_port}/api/v1/health",
                role="api",
            ),
            Child(
                "router",
                py + ["router", "--port", str(st.router_port)],
                f"http://{host}:{st.router_port}/health",
                role="router",
            ),
        ]
        if st.epp_port:
            # the same decision core behind Envoy's ext_proc; it logs in as a router (the same
            # subjects) and trusts the same signer; it has no client API of its own
            kids.append(
                Child(
                    "epp",
                    py
                    + ["epp", "--port", str(st.epp_port)]
                    + ["--operator-port", str(st.epp_operator_port)],
                    f"http://{host}:{st.epp_operator_port}/health",
                    role="router",
                )
            )
        if st.bridge:
            # its /health answers 200 once the engine answered and its history is replayed
            kids.append(
                Child(
                    "bridge",
                    py + ["bridge", st.bridge, "--port", str(st.bridge_port)],
                    f"http://{host}:{st.bridge_port}/health",
                    role="bridge",
                )
            )
        signer = self.api_signer()
        for kid in kids:
            if kid.role == "worker":
                kid.env = {**kid.env, **self.sim_env()}
            elif kid.role == "bridge":
                wid = self.bridge_worker_id()
                kid.env = {**kid.env, **self.role_env(worker_grant(wid).user)}
                kid.env["KVGATE_BRIDGE_WORKER_ID"] = wid
            else:
                kid.env = {**kid.env, **self.role_env(kid.role)}
            # each child gets exactly the secrets its role uses: the stack's environment is
            # stripped of every secret (without_secrets), these are added back per role
            if kid.role == "api":
                kid.env["KVGATE_SIGNING_SEED"] = str(self.signing_seed_path)
                kid.env.update(self.api_secrets)
            elif kid.role == "router":
                kid.env["KVGATE_TRUSTED_SIGNERS"] = signer.public_key
            if kid.role == "router" and self.disaggregated:
                # colocated policies route only to role "both" workers: a P/D fleet starts on
                # kvgate's P/D policy (unless one is given)
                kid.env.setdefault(
                    "KVGATE_ROUTER_POLICY", os.environ.get("KVGATE_ROUTER_POLICY", "pd_slo")
                )
            if kid.name == "router":  # its client API keys: the EPP serves no clients
                kid.env["KVGATE_ROUTER_OPERATOR_PORT"] = str(self.st.router_operator_port)
                kid.env.update(self.router_secrets)
        return kids

    def indexer_ports(self) -> dict[str, int]:
        """Child name -> HTTP port of each indexer: ``indexer`` alone, else ``indexer-1``..."""
        n, port = max(1, self.st.indexers), self.st.indexer_port
        if n == 1:
            return {"indexer": port}
        return {f"indexer-{i + 1}": port + i for i in range(n)}

    @property
    def signing_seed_path(self) -> Path:
        return self.state_dir / "api-signing.nk"

    def api_signer(self) -> Signer:
        """The api's signing key (kept in the state dir, owner-only); routers trust only it."""
        path = self.signing_seed_path
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(new_seed())
        return Signer.from_file(path)

    def check_ports(self) -> None:
        st = self.st
        if st.prefill_workers > 0 and st.decode_workers == 0 and st.workers == 0:
            raise SystemExit(
                "kvgate up: --prefill-workers needs a decoder: --decode-workers (or --workers)"
            )
        ports = [st.router_port, st.router_operator_port, st.api_port]
        ports += [*self.indexer_ports().values(), st.telemetry_port]
        ports += [st.bridge_port] if st.bridge else []
        ports += [st.epp_port, st.epp_operator_port] if st.epp_port else []
        ports += [st.sim_port + i for i in range(self.total_workers)]
        busy = [p for p in ports if port_open("127.0.0.1", p, 0.2)]
        if busy:
            raise SystemExit(
                f"kvgate up: port(s) {busy} already in use; choose others (see kvgate up --help)"
            )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.st.ready_timeout
        pending = [c for c in self.children if c.health_url]
        while pending and time.monotonic() < deadline and not self.stopping:
            for c in list(pending):
                if c.proc is not None and c.proc.poll() is not None:
                    raise RuntimeError(
                        f"{c.name} exited with {c.proc.returncode}; see {self.log_dir / (c.name + '.log')}"
                    )
                if _http_ok(c.health_url) is not None:
                    pending.remove(c)
            time.sleep(0.1)
        if pending:
            raise RuntimeError(
                f"not ready in time: {[c.name for c in pending]}; logs in {self.log_dir}"
            )
        # the router is useful once it has seen every worker's heartbeat (its operator port's
        # /health: the public one says only its status)
        router = f"http://127.0.0.1:{self.st.router_operator_port}/health"
        while time.monotonic() < deadline and not self.stopping:
            h = _http_ok(router) or {}
            if int(h.get("workers", 0)) >= self.total_workers:
                return
            time.sleep(0.1)
        self.log.warning("router has not seen every worker yet", expected=self.total_workers)

    def supervise(self, env: dict[str, str]) -> None:
        """Restart a child that died (at most 5 times a minute, then give up on the stack)."""
        while not self.stopping:
            for c in self.children:
                if c.proc is not None and c.proc.poll() is not None and not self.stopping:
                    now = time.monotonic()
                    c.restarts = [t for t in c.restarts if now - t < 60] + [now]
                    if len(c.restarts) > 5:
                        raise RuntimeError(
                            f"{c.name} keeps dying; see {self.log_dir / (c.name + '.log')}"
                        )
                    self.log.warning(
                        "child exited, restarting", child=c.name, code=c.proc.returncode
                    )
                    time.sleep(min(0.5 * len(c.restarts), 3.0))
                    c.start(env, self.log_dir)
            time.sleep(0.2)

    def stop(self) -> None:
        self.stopping = True
        # the router first, alone: it drains its streams while the workers still answer them
        routers = [c for c in self.children if c.role == "router"]
        self._stop_children(routers, router_stop_grace_s())
        self._stop_children([c for c in reversed(self.children) if c not in routers], 10.0)
        if self.nats is not None:
            self.nats.stop()
        if self.pg is not None:
            self.pg.stop()
        if self.lock is not None:
            stackfile.remove_state(self.state_dir)
            self.lock.close()
            self.lock = None

    def _stop_children(self, children: list[Child], grace_s: float) -> None:
        """SIGTERM ``children``, then SIGKILL those still running after ``grace_s``."""
        for c in children:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in children:
            if c.proc is None:
                continue
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.log.warning("child did not stop in time, killing", child=c.name)
                c.proc.kill()
                c.proc.wait()

    def take_state_dir(self) -> None:
        """Refuse while another ``kvgate up`` runs here; stop what a dead one left behind."""
        self.lock = stackfile.acquire_lock(self.state_dir)
        stopped = stackfile.clean_stale(self.state_dir)
        if stopped:
            self.log.warning("stopped leftovers of a previous run", stopped=stopped)

    def write_state(self, nats_url: str, db_url: str, token_file: str) -> Path:
        st, host = self.st, "127.0.0.1"
        # the operator port too: /metrics and /debug/* are where an operator looks next
        ports = {
            "router": st.router_port,
            "router-operator": st.router_operator_port,
            "api": st.api_port,
        }
        ports |= self.indexer_ports()
        ports["telemetry"] = st.telemetry_port
        for name, role, port, _n in self.sim_groups():
            ports["sim" if role == "both" else name] = port
        if st.epp_port:
            ports["epp-operator"] = st.epp_operator_port
        urls = {name: f"http://{host}:{port}" for name, port in ports.items()}
        if st.epp_port:  # gRPC: kvgate status asks its gRPC health service
            ports["epp"] = st.epp_port
            urls["epp"] = f"grpc://{host}:{st.epp_port}"
        pids = {c.name: c.proc.pid for c in self.children if c.proc is not None}
        if isinstance(self.nats, EmbeddedNatsCluster):
            for i, node in enumerate(self.nats.nodes):
                if node.proc is not None:
                    pids[f"nats-server-{i + 1}"] = node.proc.pid
        elif self.nats is not None and self.nats.proc is not None:
            pids["nats-server"] = self.nats.proc.pid
        pg_pid = stackfile.postmaster_pid(self.state_dir / "postgres") if self.pg else None
        if pg_pid is not None:
            pids["postgres"] = pg_pid
        return stackfile.write_state(
            stackfile.StackState(
                pid=os.getpid(),
                started_at=time.time(),
                state_dir=str(self.state_dir),
                nats_url=nats_url,
                database_url=db_url,
                subject_prefix=st.subject_prefix,
                urls=urls,
                ports=ports,
                pids=pids,
                admin_token_file=token_file,
                client_key_file=self.client_key_file,
            )
        )

    def run(self) -> int:
        self.take_state_dir()
        self.check_ports()
        nats_url, db_url = self.start_infra()
        env = without_secrets(env_without_proxy())
        env.update(
            {
                "KVGATE_NATS_URL": nats_url,
                "KVGATE_SUBJECT_PREFIX": self.st.subject_prefix,
                "KVGATE_LOG_LEVEL": self.st.log_level,
                "KVGATE_LOG_FORMAT": "json",
                "PYTHONUNBUFFERED": "1",
            }
        )
        # the admin token: the one given in the environment, else this state dir's own
        token, token_created = os.environ.get("KVGATE_API_ADMIN_TOKEN", ""), False
        token_file = ""
        if not token:
            token, token_created = stackfile.ensure_admin_token(self.state_dir)
            token_file = str(self.state_dir / stackfile.TOKEN_FILE)
        self.api_secrets = {"KVGATE_API_ADMIN_TOKEN": token, "KVGATE_DATABASE_URL": db_url}
        self.api_secrets |= {  # a database of the user's may come with a password file
            k: v for k, v in os.environ.items() if k.startswith("KVGATE_DATABASE_PASSWORD")
        }
        if self.nats is None:  # a NATS of the user's: its credential, as given, for every child
            env |= {k: v for k, v in os.environ.items() if k.startswith("KVGATE_NATS_")}
            env["KVGATE_NATS_URL"] = nats_url
        client_key, key_created = self.client_keys()
        self.migrate({**env, **{k: v for k, v in self.api_secrets.items() if "DATABASE" in k}})
        self.provision_bus(env)
        if self.st.indexers < 1:
            raise RuntimeError("--indexers must be at least 1")
        self.children = self.plan()
        for c in self.children:
            c.start(env, self.log_dir)
        self.wait_ready()
        if self.stopping:
            return 0
        state_file = self.write_state(nats_url, db_url, token_file)
        host = "127.0.0.1"
        page = f"http://{host}:{self.st.api_port}/ui/"
        indexers = " ".join(f"http://{host}:{p}/metrics" for p in self.indexer_ports().values())
        if self.st.indexers > 1:
            indexers += f" ({self.st.indexers}, highly available)"
        if token_created:
            token_line = f"  admin token     : {token}  (shown once; kept in {token_file})\n"
            page_line = f"  operator page   : {page}#token={token}\n"
        elif token_file:
            token_line = f"  admin token     : in {token_file}\n"
            page_line = f"  operator page   : {page}  (paste the admin token)\n"
        else:
            token_line = "  admin token     : from KVGATE_API_ADMIN_TOKEN\n"
            page_line = f"  operator page   : {page}  (paste the admin token)\n"
        if self.st.open_router:
            key_line = "  client API key  : none (--open-router: anyone reaching it may use it)\n"
        elif key_created:
            key_line = (
                f"  client API key  : {client_key}  (shown once; kept in"
                f" {self.state_dir / stackfile.CLIENT_KEY_FILE}; send Authorization: Bearer <key>)\n"
            )
        elif client_key:
            key_line = f"  client API key  : in {self.state_dir / stackfile.CLIENT_KEY_FILE}\n"
        else:
            key_line = "  client API key  : from KVGATE_ROUTER_API_KEYS\n"
        print(
            "\nkvgate is up\n"
            f"  OpenAI base URL : http://{host}:{self.st.router_port}/v1\n"
            + key_line
            + self._epp_line(host)
            + f"  admin API       : http://{host}:{self.st.api_port}/api/v1\n"
            + token_line
            + page_line
            + f"  NATS            : {redact_url(nats_url)}{self._nats_auth_note()}\n"
            f"  database        : {redact_url(db_url)}\n"
            f"  workers         : {self._workers_line()}\n"
            "  metrics         : "
            f"router http://{host}:{self.st.router_operator_port}/metrics (and /debug/*), "
            f"api http://{host}:{self.st.api_port}/metrics,\n"
            f"                    indexer {indexers}, "
            f"telemetry http://{host}:{self.st.telemetry_port}/metrics\n"
            f"  logs            : {self.log_dir}\n"
            f"  state file      : {state_file}  (kvgate status, alerts tail, api token read it)\n"
            "Press Ctrl-C to stop.\n",
            flush=True,
        )
        self.supervise(env)
        return 0

    def _workers_line(self) -> str:
        st = self.st
        if not self.disaggregated:
            return f"{st.workers} simulated"
        return (
            f"{st.workers} colocated, {st.prefill_workers} prefill, {st.decode_workers} decode "
            "simulated (P/D policy pd_slo unless KVGATE_ROUTER_POLICY)"
        )

    def _epp_line(self, host: str) -> str:
        if not self.st.epp_port:
            return ""
        return (
            f"  endpoint picker : {host}:{self.st.epp_port} (Envoy ext_proc, gRPC health; "
            f"/metrics on http://{host}:{self.st.epp_operator_port})\n"
        )

    def _nats_auth_note(self) -> str:
        if self.nats is None:
            return ""
        if not self.nats_passwords:
            return " (no authorization: --insecure-nats)"
        return (
            " (one user per role and per worker; credentials in"
            f" {stackfile.nats_passwords_path(self.state_dir)})"
        )


# Secrets of the environment `kvgate up` was started in: never handed to every child (the
# ones a child's role needs are added back to its own environment in Stack.plan).
_SECRET_VARS = ("KVGATE_DATABASE_URL",)  # may hold a password; the others match _SECRET_WORDS
_SECRET_WORDS = ("PASSWORD", "TOKEN", "SECRET", "SIGNING_SEED", "NKEY_SEED", "API_KEYS", "CREDS")


def without_secrets(env: dict[str, str]) -> dict[str, str]:
    """``env`` less every variable that holds (or names) a secret of kvgate or NATS."""
    return {
        k: v
        for k, v in env.items()
        if k not in _SECRET_VARS
        and not (
            (k.startswith("KVGATE_") or k.startswith("NATS_"))
            and any(w in k for w in _SECRET_WORDS)
        )
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    S.add_options(parser, OPTIONS)


def main(args: argparse.Namespace) -> int:
    st = S.resolve(args, OPTIONS)
    configure_logging("up", st.log_level, st.log_format)
    stack = Stack(st)

    def on_signal(signum, _frame) -> None:
        if not stack.stopping:
            stack.log.info("stopping", signal=signal.Signals(signum).name)
        stack.stopping = True

    # SIGHUP: the terminal was closed; stop everything as on Ctrl-C
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        return stack.run()
    except stackfile.StackRunning as exc:
        print(f"kvgate up: {exc}", file=sys.stderr)
        return 1
    except (RuntimeError, OSError) as exc:
        stack.log.error("kvgate up failed", error=str(exc))
        return 1
    finally:
        stack.stop()
        with contextlib.suppress(OSError, ValueError):  # a closed terminal
            sys.stdout.flush()
