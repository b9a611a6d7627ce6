"""``kvgate tenants``: manage tenants, their client keys and read their usage, through the
admin API (``/api/v1/tenants``; docs/api.md, Tenants).

Where and as whom: ``--api-url`` (``KVGATE_API_URL``; default: the API of the running
``kvgate up``, else http://127.0.0.1:8081) and an admin API token (a viewer token is enough
for list, show and usage) from ``KVGATE_API_TOKEN``, or the file ``--api-token-file``
(``KVGATE_API_TOKEN_FILE``), else the running ``kvgate up``'s admin token. A token is never
taken on the command line (other users could read it in the process list).

Examples::

    kvgate tenants list
    kvgate tenants create search --weight 2 --priority critical --rpm 600 \\
        --input-tpm 2000000 --cache-budget-blocks 50000
    kvgate tenants update search --cache-budget-blocks 80000 --rpm none   # none: unlimited
    kvgate tenants show search
    kvgate tenants keys create search --name prod --ttl-s 7776000  # prints the key once
    kvgate tenants keys list search
    kvgate tenants keys revoke search 3
    kvgate tenants usage search --since 1h
    kvgate tenants usage search --since 1d --per-minute --json
    kvgate tenants delete search --yes

Errors: the API's own error (code, message, field) on stderr and exit status 1; bad
arguments exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from email.message import Message
from pathlib import Path
from typing import Any

from services.common import settings as S
from services.common import stackfile

API_URL = S.option(
    "api_url",
    "",
    "admin API base URL (default: the API of a running 'kvgate up', else http://127.0.0.1:8081)",
)
API_TOKEN_FILE = S.option(
    "api_token_file",
    "",
    "file holding the API token (else env KVGATE_API_TOKEN, else the admin token of a "
    "running 'kvgate up')",
)
OPTIONS = (API_URL, API_TOKEN_FILE, S.STATE_DIR)
TOKEN_ENV = "KVGATE_API_TOKEN"
DEFAULT_API_URL = "http://127.0.0.1:8081"
PRIORITIES = ("critical", "standard", "sheddable")
# flag -> quota field (per minute, concurrent, cache budget); "none" clears one
QUOTA_FLAGS = {
    "rpm": "requests_per_min",
    "input_tpm": "input_tokens_per_min",
    "output_tpm": "output_tokens_per_min",
    "concurrent": "concurrent_requests",
    "cache_budget_blocks": "cache_budget_blocks",
}


class CliError(Exception):
    """A failure to print on stderr (exit status 1); ``status``: the API's HTTP status."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


# ----------------------------------------------------------------------------- arguments
def quota_value(text: str) -> int | None:
    """A quota flag's value: a whole number, or ``none`` (unlimited). Range checks are the
    API's (its error is shown)."""
    if text.strip().lower() in {"none", "null", "unlimited"}:
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number or 'none': {text!r}") from None


def when(text: str) -> float:
    """``--since`` / ``--until``: unix seconds, or an age like 90s, 30m, 2h, 1d."""
    try:
        return float(text)  # a bare number is unix seconds
    except ValueError:
        pass
    try:
        return time.time() - S.parse_duration(text).total_seconds()
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"not unix seconds nor an age: {text!r} (e.g. 1732780800, 90s, 30m, 2h, 1d)"
        ) from None


def _common(p: argparse.ArgumentParser) -> None:
    """The connection flags, also after the subcommand (SUPPRESS keeps one given before)."""
    S.add_options_after_subcommand(p, OPTIONS)
    p.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print the API's JSON answer instead of a table",
    )


def _spec_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--description", default=None, help="free text")
    p.add_argument("--weight", type=float, default=None, help="share of a saturated fleet")
    p.add_argument(
        "--priority",
        choices=PRIORITIES,
        default=None,
        help="default band of its requests (spec.default_priority)",
    )
    for flag, field in QUOTA_FLAGS.items():
        p.add_argument(
            "--" + flag.replace("_", "-"),
            dest=flag,
            type=quota_value,
            default=argparse.SUPPRESS,
            metavar="N|none",
            help=f"quota.{field} (none: unlimited)",
        )
    p.add_argument(
        "--cache-isolation",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a cache namespace of its own (no prefix shared with other tenants)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    where = __doc__.split("Examples::")[0].split("\n\n", 1)[1].strip()
    parser.description = f"{parser.description}\n\n{where}"
    parser.epilog = "examples:" + __doc__.split("Examples::", 1)[1]
    S.add_options(parser, OPTIONS)
    parser.add_argument("--json", action="store_true", help="print the API's JSON answer")
    sub = parser.add_subparsers(
        dest="action",
        metavar="{list,show,create,update,delete,keys,usage}",
        required=True,
    )
    _common(sub.add_parser("list", help="list tenants"))
    show = sub.add_parser("show", help="a tenant: its spec, keys count and every version")
    show.add_argument("tenant_id")
    _common(show)
    create = sub.add_parser("create", help="create a tenant (version 1)")
    create.add_argument("tenant_id")
    _spec_flags(create)
    _common(create)
    update = sub.add_parser(
        "update",
        help="change a tenant: the given fields change, the others stay (a new version)",
    )
    update.add_argument("tenant_id")
    _spec_flags(update)
    _common(update)
    delete = sub.add_parser("delete", help="delete a tenant and its keys (its usage is kept)")
    delete.add_argument("tenant_id")
    delete.add_argument("--yes", action="store_true", help="do it (required)")
    _common(delete)

    keys = sub.add_parser("keys", help="a tenant's client API keys: list, create, revoke")
    ksub = keys.add_subparsers(dest="keys_action", metavar="{list,create,revoke}", required=True)
    klist = ksub.add_parser("list", help="list keys (never their secrets)")
    klist.add_argument("tenant_id")
    _common(klist)
    kcreate = ksub.add_parser("create", help="issue a key and print it (shown once)")
    kcreate.add_argument("tenant_id")
    kcreate.add_argument("--name", default="", help="a label")
    kcreate.add_argument(
        "--priority", choices=PRIORITIES, default=None, help="its band (default: the tenant's)"
    )
    kcreate.add_argument(
        "--allow-priority-header",
        action="store_true",
        help="requests may choose their band (x-kvgate-priority)",
    )
    kcreate.add_argument("--ttl-s", type=float, default=None, help="lifetime in seconds")
    _common(kcreate)
    krevoke = ksub.add_parser("revoke", help="revoke a key (routers refuse it within a second)")
    krevoke.add_argument("tenant_id")
    krevoke.add_argument("key_id", type=int)
    _common(krevoke)

    usage = sub.add_parser("usage", help="what the tenant used (chargeback) and its cache now")
    usage.add_argument("tenant_id")
    usage.add_argument(
        "--since", type=when, default=None, help="unix seconds or an age (1h); default 24 h ago"
    )
    usage.add_argument("--until", type=when, default=None, help="unix seconds or an age")
    usage.add_argument("--per-minute", action="store_true", help="also each minute's figures")
    _common(usage)


# ----------------------------------------------------------------------------- the client
class Client:
    def __init__(self, base_url: str, token: str | None, timeout_s: float = 30.0) -> None:
        self.base = base_url.rstrip("/") + "/api/v1"
        self.token = token
        self.timeout_s = timeout_s

    def call(self, method: str, path: str, body: Any = None) -> Any:
        return self.exchange(method, path, body)[0]

    def exchange(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[Any, Message]:
        """(the JSON answer, the response headers) of one call with extra ``headers``."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        for name, value in (headers or {}).items():
            req.add_header(name, value)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:  # noqa: S310
                return json.loads(r.read() or b"null"), r.headers
        except urllib.error.HTTPError as exc:
            raise CliError(api_error(exc.code, exc.read()), exc.code) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise CliError(f"no admin API answers at {self.base}: {reason}") from None


def api_error(status: int, raw: bytes) -> str:
    """One line from the API's error body (``{"error": {code, message, field}}``)."""
    try:
        err = json.loads(raw)["error"]
        text = f"{status} {err.get('code', '')}: {err.get('message', '')}"
        if err.get("field"):
            text += f" (field {err['field']})"
    except (ValueError, KeyError, TypeError):
        text = f"{status}: {raw[:300].decode(errors='replace')}"
    if status == 401:
        text += f"; give a valid API token ({TOKEN_ENV} or --api-token-file)"
    elif status == 403:
        text += "; this needs an admin token"
    return text


def connection(args: argparse.Namespace) -> Client:
    st = S.resolve(args, OPTIONS)
    stack = stackfile.running_stack(st.state_dir)
    url = st.api_url or (stack.urls.get("api") if stack else None) or DEFAULT_API_URL
    token = os.environ.get(TOKEN_ENV) or None
    if st.api_token_file:
        try:
            token = Path(st.api_token_file).read_text().strip()
        except OSError as exc:
            raise CliError(f"cannot read --api-token-file: {exc.strerror}") from None
    elif token is None:
        token = stackfile.read_admin_token(st.state_dir) if stack else None
    return Client(url, token)


# ----------------------------------------------------------------------------- pure parts
def spec_from(args: argparse.Namespace, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """``spec`` (the current one, for update) with the flags given applied."""
    out = json.loads(json.dumps(spec or {}))
    if args.weight is not None:
        out["weight"] = args.weight
    if args.priority is not None:
        out["default_priority"] = args.priority
    if args.cache_isolation is not None:
        out["cache_isolation"] = args.cache_isolation
    quota = dict(out.get("quota") or {})
    for flag, field in QUOTA_FLAGS.items():
        if hasattr(args, flag):
            quota[field] = getattr(args, flag)
    out["quota"] = quota
    return out


def _n(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def quota_text(quota: dict[str, Any] | None) -> str:
    short = {
        "requests_per_min": "rpm",
        "input_tokens_per_min": "in/min",
        "output_tokens_per_min": "out/min",
        "concurrent_requests": "concurrent",
        "cache_budget_blocks": "cache blocks",
    }
    parts = [f"{name}={_n(quota[f])}" for f, name in short.items() if (quota or {}).get(f)]
    return " ".join(parts) or "unlimited"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = [headers, *rows]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def tenants_table(tenants: list[dict[str, Any]]) -> str:
    rows = [
        [
            t["tenant_id"],
            str(t["version"]),
            _n(t["spec"].get("weight", 1.0)),
            t["spec"].get("default_priority", "standard"),
            str(t["keys"]),
            "yes" if t["spec"].get("cache_isolation") else "no",
            quota_text(t["spec"].get("quota")),
            t.get("description") or "",
        ]
        for t in tenants
    ]
    head = ["TENANT", "VERSION", "WEIGHT", "PRIORITY", "KEYS", "ISOLATED", "QUOTA", "DESCRIPTION"]
    return table(head, rows) if rows else "no tenants"


def tenant_text(t: dict[str, Any]) -> str:
    spec = t["spec"]
    lines = [
        f"tenant        {t['tenant_id']}",
        f"description   {t.get('description') or ''}",
        f"version       {t['version']} (of {len(t.get('versions') or [1])})",
        f"weight        {_n(spec.get('weight', 1.0))}",
        f"priority      {spec.get('default_priority', 'standard')}",
        f"isolation     {'yes' if spec.get('cache_isolation') else 'no'}",
        f"quota         {quota_text(spec.get('quota'))}",
        f"keys          {t['keys']} (not revoked)",
        f"created       {t.get('created_at')} by {t.get('created_by')}",
        f"updated       {t.get('updated_at')}",
    ]
    return "\n".join(lines)


def keys_table(keys: list[dict[str, Any]]) -> str:
    rows = [
        [
            str(k["id"]),
            k.get("name") or "",
            k["state"],
            k.get("priority") or "(tenant's)",
            "yes" if k.get("allow_priority_header") else "no",
            k.get("created_at") or "",
            k.get("expires_at") or "-",
        ]
        for k in keys
    ]
    head = ["ID", "NAME", "STATE", "PRIORITY", "HEADER", "CREATED", "EXPIRES"]
    return table(head, rows) if rows else "no keys"


USAGE_FIELDS = (
    "requests",
    "errors",
    "prompt_tokens",
    "cached_tokens",
    "computed_prompt_tokens",
    "unreported_prompt_tokens",
    "completion_tokens",
    "cache_hit_ratio",
)


def usage_text(u: dict[str, Any]) -> str:
    def iso(ts: float) -> str:
        return time.strftime("%Y-%m-%d %H:%MZ", time.gmtime(ts))

    lines = [f"tenant {u['tenant_id']}, {iso(u['since'])} .. {iso(u['until'])}"]
    lines += [f"  {f:<26}{_n(u.get(f))}" for f in USAGE_FIELDS]
    over = " (OVER BUDGET: its requests are sheddable)" if u.get("over_cache_budget") else ""
    lines.append(
        f"  {'cache_blocks_held':<26}{_n(u.get('cache_blocks_held'))} of "
        f"{_n(u.get('cache_budget_blocks'))} budget{over}"
    )
    minutes = u.get("minutes")
    if minutes:
        head = ["MINUTE", "REQUESTS", "ERRORS", "PROMPT", "CACHED", "COMPLETION"]
        rows = [
            [
                iso(m["minute"]),
                _n(m["requests"]),
                _n(m["errors"]),
                _n(m["prompt_tokens"]),
                _n(m["cached_tokens"]),
                _n(m["completion_tokens"]),
            ]
            for m in minutes
        ]
        lines += ["", table(head, rows)]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- commands
def run(args: argparse.Namespace, client: Client) -> tuple[Any, str]:
    """(the API's answer, its text form) of one command."""
    tid = urllib.parse.quote(getattr(args, "tenant_id", "") or "", safe="")
    action = args.action
    if action == "list":
        out = client.call("GET", "/tenants")
        return out, tenants_table(out["tenants"])
    if action == "show":
        out = client.call("GET", f"/tenants/{tid}")
        return out, tenant_text(out)
    if action == "create":
        body: dict[str, Any] = {"tenant_id": args.tenant_id, "spec": spec_from(args)}
        if args.description is not None:
            body["description"] = args.description
        out = client.call("POST", "/tenants", body)
        return out, f"created tenant {out['tenant_id']} (version {out['version']})"
    if action == "update":
        current, headers = client.exchange("GET", f"/tenants/{tid}")
        spec = spec_from(args, current["spec"])
        body = {} if spec == current["spec"] else {"spec": spec}
        if args.description is not None:
            body["description"] = args.description
        if not body:
            raise CliError("nothing to change: give a flag (see --help)")
        # only over the version read: another writer's change in between is a 412, not lost
        tag = headers.get("ETag")
        try:
            out, _ = client.exchange(
                "PUT", f"/tenants/{tid}", body, {"If-Match": tag} if tag else None
            )
        except CliError as exc:
            if exc.status != 412:
                raise
            raise CliError(
                f"tenant {args.tenant_id} was changed by someone else since it was read "
                f"(version {current['version']}); nothing was changed: run it again",
                412,
            ) from None
        return out, f"updated tenant {out['tenant_id']} (version {out['version']})"
    if action == "delete":
        if not args.yes:
            raise CliError(f"deleting tenant {args.tenant_id} removes its keys: add --yes")
        out = client.call("DELETE", f"/tenants/{tid}")
        return out, f"deleted tenant {out['deleted']} and its keys"
    if action == "keys":
        if args.keys_action == "list":
            out = client.call("GET", f"/tenants/{tid}/keys")
            return out, keys_table(out["keys"])
        if args.keys_action == "create":
            body = {"name": args.name, "allow_priority_header": args.allow_priority_header}
            if args.priority is not None:
                body["priority"] = args.priority
            if args.ttl_s is not None:
                body["ttl_s"] = args.ttl_s
            out = client.call("POST", f"/tenants/{tid}/keys", body)
            return out, out["key"]
        out = client.call("DELETE", f"/tenants/{tid}/keys/{args.key_id}")
        return out, f"key {out['id']} of tenant {out['tenant_id']}: {out['state']}"
    # usage
    query: dict[str, Any] = {}
    if args.since is not None:
        query["since"] = f"{args.since:.0f}"
    if args.until is not None:
        query["until"] = f"{args.until:.0f}"
    if args.per_minute:
        query["per_minute"] = "true"
    qs = "?" + urllib.parse.urlencode(query) if query else ""
    out = client.call("GET", f"/tenants/{tid}/usage{qs}")
    return out, usage_text(out)


def main(args: argparse.Namespace) -> int:
    try:
        out, text = run(args, connection(args))
    except CliError as exc:
        print(f"kvgate tenants: {exc}", file=sys.stderr)
        return 1
    if getattr(args, "json", False):
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        print(text)
    if args.action == "keys" and args.keys_action == "create":
        expiry = f", expires {out['expires_at']}" if out.get("expires_at") else ""
        print(
            f"(key id {out['id']} of tenant {out['tenant_id']}{expiry}; store it now, it is "
            "not shown again)",
            file=sys.stderr,
        )
    return 0
