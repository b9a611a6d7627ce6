"""Paths an operator configures as routes (``--passthrough-paths``): each must be the one
spelling of itself that every HTTP component reads the same way.

Invariant: a path accepted here is absolute, has no empty, ``.`` or ``..`` segment, no
percent-encoding, no query or fragment, and only printable ASCII without spaces or
backslashes; so no normaliser (the router's, a gateway's, the engine's) maps it onto another
path, and the request-time check in services.router.http_server (dot segments refused with
400) leaves no second spelling of it to match.
"""

from __future__ import annotations

import re

# RFC 3986 path characters (pchar and "/") minus "%": unreserved, sub-delims, ":", "@"
_PATH_CHARS = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@/]*")


def check_route_path(path: str) -> None:
    """Raise ValueError naming what is wrong with ``path`` as a configured route."""
    if not path.startswith("/"):
        raise ValueError(f"path {path!r} must be absolute (start with '/')")
    for ch in path:
        if not ch.isprintable() or ch.isspace() or not ch.isascii():
            raise ValueError(f"path {path!r} has a control, space or non-ASCII character")
    if "?" in path or "#" in path:
        raise ValueError(f"path {path!r} has a query or fragment ('?' or '#')")
    if "%" in path:
        raise ValueError(f"path {path!r} has a percent-encoding; write the character itself")
    if "\\" in path:
        raise ValueError(f"path {path!r} has a backslash")
    if "//" in path:
        raise ValueError(f"path {path!r} has an empty segment ('//')")
    segments = path.split("/")[1:]
    if any(seg in (".", "..") for seg in segments):
        raise ValueError(f"path {path!r} has a '.' or '..' segment")
    if not _PATH_CHARS.fullmatch(path):
        raise ValueError(f"path {path!r} has a character not allowed in a URL path")
