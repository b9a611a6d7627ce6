"""Which tenant a request is for (from its API key, or a trusted gateway's header), and its
priority band: one call per request, answering a :class:`RequestTenancy`."""

from __future__ import annotations

from collections.abc import Mapping

from services.common.tenancy import NO_TENANT, RequestTenancy


def request_tenancy(headers: Mapping[str, str], api_key: str | None = None) -> RequestTenancy:
    """The tenancy of one request. Without a tenant directory every request is tenant-less."""
    return NO_TENANT
