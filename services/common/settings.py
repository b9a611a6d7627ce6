"""Settings: every option has one declaration that yields a CLI flag and an environment variable.

Invariant: an option's value comes from, in order, its CLI flag, its environment variable
(``KVGATE_<NAME>``), then its default. Every option ever declared is recorded in
``ALL_OPTIONS`` (keyed by env var), so deployment files can be checked against what the code
actually reads.

Each service declares its own options next to its code (``services/<svc>/cli.py``) with
:func:`option`, and shares the :data:`COMMON` ones (bus, database, namespace, logging).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

ENV_PREFIX = "KVGATE_"


@dataclass(frozen=True)
class Option:
    name: str  # python attribute name, e.g. "nats_url"
    default: Any
    help: str
    type: Callable[[str], Any] = str
    choices: Sequence[Any] | None = None
    flag: str = ""  # e.g. "--nats-url"; derived from name when empty
    env: str = ""  # e.g. "KVGATE_NATS_URL"; derived from name when empty

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def env_var(self) -> str:
        return self.env or ENV_PREFIX + self.name.upper()


ALL_OPTIONS: dict[str, Option] = {}


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off", ""}:
        return False
    raise ValueError(f"not a boolean: {text!r}")


def option(
    name: str,
    default: Any,
    help: str,
    type: Callable[[str], Any] | None = None,
    choices: Sequence[Any] | None = None,
    flag: str = "",
    env: str = "",
) -> Option:
    """Declare an option (and record it in ALL_OPTIONS). ``type`` defaults from the default."""
    if type is None:
        if isinstance(default, bool):
            type = _parse_bool
        elif isinstance(default, int):
            type = int
        elif isinstance(default, float):
            type = float
        else:
            type = str
    opt = Option(
        name=name, default=default, help=help, type=type, choices=choices, flag=flag, env=env
    )
    # The same env var may be read by several commands (e.g. the router port by `router`
    # and by `up`); it must mean the same thing in each.
    ALL_OPTIONS[opt.env_var] = opt
    return opt


# Options every service understands.
NATS_URL = option("nats_url", "nats://127.0.0.1:4222", "NATS server URL(s), comma-separated")
DATABASE_URL = option(
    "database_url",
    "postgresql+asyncpg://postgres@127.0.0.1:5432/kvgate",
    "PostgreSQL URL (SQLAlchemy form, asyncpg driver)",
)
DATABASE_PASSWORD_FILE = option(
    "database_password_file",
    "",
    "file holding the database password (a Docker or Kubernetes secret); it is put into "
    "--database-url, which then carries no password itself",
)
SUBJECT_PREFIX = option(
    "subject_prefix",
    "",
    "prefix for every NATS subject and stream name (isolates deployments and test runs)",
)
LOG_LEVEL = option("log_level", "info", "log level", choices=["debug", "info", "warning", "error"])
LOG_FORMAT = option(
    "log_format",
    "auto",
    "log format: json, console, or auto (JSON unless stderr is a terminal)",
    choices=["auto", "json", "console"],
)
STATE_DIR = option("state_dir", ".kvgate", "directory for embedded servers' data and other state")
HASH_SEED = option("hash_seed", 0, "seed of the canonical KV block keys (must match cluster-wide)")


# How a service authenticates to NATS (any one of user/password, token, nkey seed or a .creds
# file), and TLS. Secrets may also sit in the URL (nats://user:password@host); logs and errors
# always show URLs redacted (services.common.redact).
NATS_USER = option("nats_user", "", "NATS user name (with --nats-password)")
NATS_PASSWORD = option("nats_password", "", "NATS password (secret; prefer the env var)")
NATS_TOKEN = option("nats_token", "", "NATS authentication token (secret; prefer the env var)")
NATS_NKEY_SEED = option("nats_nkey_seed", "", "file holding this service's NATS nkey seed (SU...)")
NATS_CREDS = option(
    "nats_creds", "", "NATS .creds file (decentralised JWT auth: user JWT + nkey seed, from nsc)"
)
NATS_TLS_CA = option("nats_tls_ca", "", "CA bundle that signs the NATS server's certificate")
NATS_TLS_CERT = option("nats_tls_cert", "", "client certificate for NATS TLS (mutual TLS)")
NATS_TLS_KEY = option("nats_tls_key", "", "client certificate's private key for NATS TLS")
NATS_AUTH: tuple[Option, ...] = (
    NATS_USER,
    NATS_PASSWORD,
    NATS_TOKEN,
    NATS_NKEY_SEED,
    NATS_CREDS,
    NATS_TLS_CA,
    NATS_TLS_CERT,
    NATS_TLS_KEY,
)

# The api signs policy notices and worker control (services.common.signing); routers accept them
# only signed by a trusted key.
SIGNING_SEED = option(
    "signing_seed", "", "file holding the api's signing nkey seed (kvgate signing-key)"
)
TRUSTED_SIGNERS = option(
    "trusted_signers",
    "",
    "public nkeys (comma-separated) whose signed policy/control messages are accepted; "
    "empty: accept unsigned ones",
)
# A signed policy notice or worker order is acted on only while fresh (services.common.replay_guard)
SIGNED_MAX_AGE_S = option(
    "signed_max_age_s",
    300.0,
    "seconds a signed policy.updated / workers.control message stays valid after the api "
    "signed it (older: rejected as stale; its nonce is remembered this long against replays). "
    "The POLICY stream's stored notice read at start is exempt",
)
SIGNED_MAX_SKEW_S = option(
    "signed_max_skew_s",
    30.0,
    "seconds a signed message may be dated ahead of this clock (api/router clock skew); "
    "further ahead: rejected as future",
)

COMMON: tuple[Option, ...] = (NATS_URL, *NATS_AUTH, SUBJECT_PREFIX, LOG_LEVEL, LOG_FORMAT)


class Settings(argparse.Namespace):
    """Resolved option values, as attributes."""

    def __repr__(self) -> str:  # keep secrets out of logs: only names
        return f"Settings({', '.join(sorted(vars(self)))})"


def placeholder(opt: Option) -> str | None:
    """What ``--help`` shows for an option's value: what it is (URL, PORT, N), not its name."""
    if opt.choices is not None:
        return None  # argparse lists the choices
    name = opt.name
    for suffix, word in (("_url", "URL"), ("_port", "PORT"), ("_dir", "DIR"), ("_path", "PATH")):
        if name.endswith(suffix) or name == suffix[1:]:
            return word
    if name.endswith(("_s", "_timeout", "_interval")) or name in ("timeout", "interval"):
        return "SECONDS"
    if opt.type is _parse_bool:
        return "BOOL"
    if opt.type is int:
        return "N"
    if opt.type is float:
        return "X"
    return "TEXT"


def add_options(parser: argparse.ArgumentParser, options: Iterable[Option]) -> None:
    """Add a flag for each option; the default is None so env/default resolution happens later."""
    for opt in options:
        help_text = f"{opt.help} [env {opt.env_var}; default {opt.default!r}]"
        parser.add_argument(
            opt.cli_flag,
            dest=opt.name,
            default=None,
            type=opt.type,
            choices=opt.choices,
            metavar=placeholder(opt),
            help=help_text,
        )


_SECONDS_PER = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> timedelta:
    """A command-line duration: a number with an optional unit s / m / h / d (90s, 30m, 2h,
    1d; a bare number is seconds)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 90s, 30m, 2h, 1d)")
    return timedelta(seconds=float(m.group(1)) * _SECONDS_PER[m.group(2) or "s"])


def add_options_after_subcommand(
    parser: argparse.ArgumentParser, options: Iterable[Option]
) -> None:
    """Accept the same flags after a subcommand too (``kvgate alerts tail --nats-url ...``):
    SUPPRESS as the default, so a value given before the subcommand is not overwritten."""
    for opt in options:
        parser.add_argument(
            opt.cli_flag,
            dest=opt.name,
            default=argparse.SUPPRESS,
            type=opt.type,
            choices=opt.choices,
            metavar=placeholder(opt),
            help=f"{opt.help} [env {opt.env_var}]",
        )


def resolve(
    args: argparse.Namespace | None,
    options: Iterable[Option],
    environ: dict[str, str] | None = None,
) -> Settings:
    """CLI flag, then environment, then default; a bad environment value is a clear error."""
    env = os.environ if environ is None else environ
    out = Settings()
    for opt in options:
        value = getattr(args, opt.name, None) if args is not None else None
        if value is None and opt.env_var in env:
            raw = env[opt.env_var]
            try:
                value = opt.type(raw)
            except (TypeError, ValueError) as exc:
                raise SystemExit(f"invalid {opt.env_var}={raw!r}: {exc}") from exc
            if opt.choices is not None and value not in opt.choices:
                raise SystemExit(f"invalid {opt.env_var}={raw!r}: choose from {list(opt.choices)}")
        if value is None:
            value = opt.default
        setattr(out, opt.name, value)
    if getattr(out, "database_password_file", "") and getattr(out, "database_url", ""):
        out.database_url = with_password(out.database_url, out.database_password_file)
    return out


def with_password(url: str, password_file: str) -> str:
    """``url`` with the password read from ``password_file`` (URL-quoted) as its password."""
    from urllib.parse import quote, urlsplit, urlunsplit

    try:
        with open(password_file) as f:
            password = f.read().strip()
    except OSError as exc:
        raise SystemExit(
            f"cannot read the database password file {password_file}: {exc.strerror}"
        ) from None
    parts = urlsplit(url)
    user = (parts.username or "").strip()
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    return urlunsplit(parts._replace(netloc=netloc))
