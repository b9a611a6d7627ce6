"""``kvgate api``: the admin REST API (default), and ``kvgate api token create|list|revoke``.

Examples::

    kvgate api --port 8081                         # run the server
    kvgate api token create --role admin --name ci # print a new token (shown once)
    kvgate api token create --role viewer --ttl-s 86400  # one that expires in a day
    kvgate api token list
    kvgate api token revoke 3
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from services.common import settings as S
from services.common.redact import redact_text
from services.common.tracing import OPTIONS as TRACING_OPTIONS

ADMIN_TOKEN = S.option(
    "admin_token",
    "",
    "bootstrap admin token (compose, 'kvgate up'): recorded by its digest as token "
    "'bootstrap-admin', revocable like any other (a revocation survives restarts); "
    "empty: none",
    env="KVGATE_API_ADMIN_TOKEN",
)
TOKEN_MAX_TTL_S = S.option(
    "token_max_ttl_s",
    0.0,
    "longest lifetime of a new API token in seconds, also the lifetime of one created "
    "without a TTL; 0: tokens may live forever (the bootstrap token is not affected)",
    env="KVGATE_API_TOKEN_MAX_TTL_S",
)
OPTIONS = S.COMMON + (
    S.SIGNING_SEED,
    S.SIGNED_MAX_AGE_S,  # how long an uncordon is re-sent (the routers' freshness window)
    S.DATABASE_URL,
    S.DATABASE_PASSWORD_FILE,
    S.option(
        "host", "127.0.0.1", "address of the HTTP (health, metrics) endpoint", env="KVGATE_API_HOST"
    ),
    S.option("port", 8081, "port of the HTTP (health, metrics) endpoint", env="KVGATE_API_PORT"),
    ADMIN_TOKEN,
    TOKEN_MAX_TTL_S,
    S.option(
        "auth_fail_limit",
        20,
        "failed authentications from one client address within --auth-fail-window-s after "
        "which it gets 429 (Retry-After) without its token being checked; 0: no limit. The "
        "address is the TCP peer's (X-Forwarded-For is not trusted): behind a proxy all "
        "clients share one",
        env="KVGATE_API_AUTH_FAIL_LIMIT",
    ),
    S.option(
        "auth_fail_window_s",
        60.0,
        "window (seconds) of --auth-fail-limit",
        env="KVGATE_API_AUTH_FAIL_WINDOW_S",
    ),
    S.option(
        "auth_tracked_addresses",
        10_000,
        "most client addresses whose failed authentications are remembered (the least "
        "recently failing is forgotten first)",
        env="KVGATE_API_AUTH_TRACKED_ADDRESSES",
    ),
    S.option(
        "canary_eval_interval_s",
        1.0,
        "how often the canary evaluator looks at running canaries (seconds)",
    ),
    S.option(
        "republish_s",
        5.0,
        "period of re-publishing worker controls and checking the policy stream (seconds)",
        env="KVGATE_API_REPUBLISH_S",
    ),
)
OPTIONS += TRACING_OPTIONS
TOKEN_OPTIONS = (
    S.DATABASE_URL,
    S.DATABASE_PASSWORD_FILE,
    S.LOG_LEVEL,
    S.LOG_FORMAT,
    S.STATE_DIR,
    TOKEN_MAX_TTL_S,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    S.add_options(parser, OPTIONS)
    sub = parser.add_subparsers(dest="action", metavar="{token}")
    token = sub.add_parser("token", help="manage API tokens (stored hashed)")
    tsub = token.add_subparsers(dest="token_action", metavar="{create,list,revoke}", required=True)
    create = tsub.add_parser("create", help="create a token and print it (shown once)")
    create.add_argument("--role", choices=["viewer", "admin"], required=True)
    create.add_argument("--name", default="", help="label for the audit log")
    create.add_argument(
        "--ttl-s",
        type=float,
        default=None,
        help="lifetime in seconds (default: none, or KVGATE_API_TOKEN_MAX_TTL_S when set)",
    )
    tsub.add_parser("list", help="list tokens (never their secrets)")
    revoke = tsub.add_parser("revoke", help="revoke a token by id")
    revoke.add_argument("id", type=int)
    for p in (create, tsub.choices["list"], revoke):
        # SUPPRESS: a flag given before 'token' is not overwritten by the subparser's default
        p.add_argument(
            "--database-url",
            dest="database_url",
            default=argparse.SUPPRESS,
            help=f"{S.DATABASE_URL.help} [env {S.DATABASE_URL.env_var}; default: the database "
            "of the running 'kvgate up' (its state file), else "
            f"{S.DATABASE_URL.default}]",
        )
        p.add_argument(
            "--state-dir",
            dest="state_dir",
            default=argparse.SUPPRESS,
            help=f"where 'kvgate up' keeps its state file [env {S.STATE_DIR.env_var}; "
            f"default {S.STATE_DIR.default!r}]",
        )


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it wraps (SQLAlchemy's ``orig``, ``__cause__``, ``__context__``)."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [getattr(e, "orig", None), e.__cause__, e.__context__]
    return seen


def explain_database_error(exc: BaseException, database_url: str) -> str:
    """One line naming what really went wrong and what to do: 'run migrate' only when the
    tables are missing (a missing database, no server or a refused login are not that)."""
    from sqlalchemy.engine import make_url

    try:
        url = make_url(database_url)
        where = f"{url.host or 'localhost'}:{url.port or 5432}"
        dbname = url.database or ""
    except Exception:  # an unparsable URL: say so without echoing it (it may hold a password)
        return "the database URL (--database-url / KVGATE_DATABASE_URL) cannot be parsed"
    names = {type(e).__name__ for e in _causes(exc)}
    text = " ".join(str(e) for e in _causes(exc))
    if "InvalidCatalogNameError" in names or "does not exist" in text and "database" in text:
        return (
            f"database {dbname!r} does not exist on the PostgreSQL at {where}: create it "
            f"(createdb {dbname}) and run 'kvgate migrate', or point --database-url / "
            "KVGATE_DATABASE_URL at the right one ('kvgate up' makes its own, found by itself "
            "while it runs)"
        )
    if "UndefinedTableError" in names:
        return (
            f"database {dbname!r} on {where} has no kvgate tables: run 'kvgate migrate' "
            "against it first"
        )
    if names & {"InvalidPasswordError", "InvalidAuthorizationSpecificationError"}:
        return (
            f"PostgreSQL at {where} refused the login for user {url.username!r}: check the "
            "password (--database-password-file / KVGATE_DATABASE_PASSWORD_FILE)"
        )
    if names & {"ConnectionRefusedError", "ConnectionError", "OSError", "gaierror"}:
        return (
            f"no PostgreSQL answers at {where}: start the stack ('kvgate up'; its database is "
            "found by itself) or give --database-url / KVGATE_DATABASE_URL"
        )
    return f"database at {where} unavailable ({type(exc).__name__}: {redact_text(str(exc))[:200]})"


async def _token(args: argparse.Namespace, database_url: str, max_ttl_s: float) -> int:
    from services.api.bodies import TOKEN_TTL_RANGE_S
    from services.api.db import Database, is_unavailable
    from services.api.tokens import create_token, token_dict, token_state

    db = Database(database_url)
    try:
        if args.token_action == "create":
            lo, hi = TOKEN_TTL_RANGE_S
            if args.ttl_s is not None and not lo <= args.ttl_s <= hi:
                print(f"--ttl-s must be between {lo:g} and {hi:.0f} seconds", file=sys.stderr)
                return 2
            try:
                token, record = await create_token(
                    db, args.role, args.name, args.ttl_s, max_ttl_s=max_ttl_s
                )
            except ValueError as exc:
                print(f"kvgate api token create: {exc}", file=sys.stderr)
                return 2
            print(token)
            expiry = f", expires {record['expires_at']}" if record["expires_at"] else ""
            print(
                f"(token id {record['id']}, role {record['role']}{expiry}; store it now, it is "
                "not shown again)",
                file=sys.stderr,
            )
            return 0
        from datetime import UTC, datetime

        from sqlalchemy import select

        from services.api.models import ApiToken

        async with db.transaction() as s:
            if args.token_action == "list":
                for row in (await s.execute(select(ApiToken).order_by(ApiToken.id))).scalars():
                    d = token_dict(row)
                    expires = f"  expires {d['expires_at']}" if d["expires_at"] else ""
                    print(
                        f"{d['id']:>5}  {d['role']:<6}  {token_state(row):<7}  "
                        f"{d['created_at']}  {d['name']}{expires}"
                    )
                return 0
            row = (
                await s.execute(select(ApiToken).where(ApiToken.id == args.id))
            ).scalar_one_or_none()
            if row is None:
                print(f"no token with id {args.id}", file=sys.stderr)
                return 1
            row.revoked_at = row.revoked_at or datetime.now(UTC)
            print(f"token {args.id} revoked")
            return 0
    except Exception as exc:
        if is_unavailable(exc):
            print(f"kvgate api token: {explain_database_error(exc, database_url)}", file=sys.stderr)
            return 1
        raise
    finally:
        await db.close()


def main(args: argparse.Namespace) -> int:
    if getattr(args, "action", None) == "token":
        from services.common import stackfile

        st = S.resolve(args, TOKEN_OPTIONS)
        database_url = st.database_url
        if not stackfile.given(args, "database_url", S.DATABASE_URL.env_var):
            stack = stackfile.running_stack(st.state_dir)
            if stack is not None:  # the embedded database of `kvgate up`
                database_url = stack.database_url
        return asyncio.run(_token(args, database_url, st.token_max_ttl_s))
    from services.api.app import serve
    from services.common.service import run_service

    return run_service("api", serve, S.resolve(args, OPTIONS))
