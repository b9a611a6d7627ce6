"""What every resource module of the admin API shares: the URL prefix and timestamp format.

Invariant: every versioned path starts with :data:`V1`; timestamps leave the API as ISO 8601
strings (or null), never as database-native values.
"""

from __future__ import annotations

from datetime import datetime

V1 = "/api/v1"


def iso(dt: datetime | None) -> str | None:
    return dt.isoformat() if dt else None
