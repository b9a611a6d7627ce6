"""Keep secrets out of everything kvgate prints: logs, ``/debug/*`` views, error messages and
``kvgate up``'s banner.

Invariant: :func:`redact_url` never returns the userinfo (``user:password@`` or ``token@``) of
a URL, nor the value of a secret-looking query parameter (``password=``, ``token=`` ...); the
rest (scheme, host, port, path) stays readable, so an operator still sees *where* a service
connects. :func:`redact_text` does the same for every URL inside free text (an exception's
message, a log field), and the logging pipeline applies it to every string it renders.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

MASK = "***"

# Query parameters whose values are secrets (libpq/asyncpg and common token names).
_SECRET_PARAMS = {"password", "pass", "passwd", "token", "secret", "sslpassword", "auth_token"}

# scheme://userinfo@ : userinfo runs to the last '@' before the host part ends
_USERINFO_RE = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/@\s,\"']+)@")
_QUERY_SECRET_RE = re.compile(
    r"(?P<key>[?&](?:" + "|".join(sorted(_SECRET_PARAMS)) + r"))=(?P<value>[^&\s,\"']*)",
    re.IGNORECASE,
)


def _redact_one(url: str) -> str:
    try:
        parts = urlsplit(url)
    except ValueError:
        return redact_text(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, sep, _password = userinfo.partition(":")
        # user:password -> user:***; a lone token (token@host) -> ***
        netloc = f"{user}:{MASK}@{hostport}" if sep else f"{MASK}@{hostport}"
    query = parts.query
    if query:
        query = _QUERY_SECRET_RE.sub(lambda m: f"{m.group('key')}={MASK}", "?" + query)[1:]
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_url(url: str) -> str:
    """A URL (or a comma-separated list of them, as NATS takes) with its secrets masked."""
    if not url:
        return url
    return ",".join(_redact_one(u.strip()) if u.strip() else u for u in url.split(","))


def redact_text(text: str) -> str:
    """Free text with the secrets of every URL in it masked."""
    if "@" not in text and "=" not in text:
        return text

    def userinfo(m: re.Match[str]) -> str:
        user, sep, _ = m.group("userinfo").partition(":")
        return f"{m.group('scheme')}{user}:{MASK}@" if sep else f"{m.group('scheme')}{MASK}@"

    text = _USERINFO_RE.sub(userinfo, text)
    return _QUERY_SECRET_RE.sub(lambda m: f"{m.group('key')}={MASK}", text)


def redact_event(_logger: object, _method: str, event: dict[str, object]) -> dict[str, object]:
    """structlog processor: every string value of a log event goes through :func:`redact_text`
    (a safety net: code that logs a URL should still call :func:`redact_url` itself)."""
    for key, value in event.items():
        if isinstance(value, str):
            event[key] = redact_text(value)
    return event
