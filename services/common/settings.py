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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
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

COMMON: tuple[Option, ...] = (NATS_URL, SUBJECT_PREFIX, LOG_LEVEL, LOG_FORMAT)


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
    return out
