"""The admin API's route table: one module per resource, registered here in a fixed order.

Each module (:mod:`.meta`, :mod:`.policies`, :mod:`.canaries`, :mod:`.workers`,
:mod:`.alerts`, :mod:`.audit`, :mod:`.tokens`, :mod:`.tenants`) exposes ``routes(ctx)`` returning its
:class:`~services.api.framework.Route` list. Every mutating handler runs in one transaction
that also writes the audit log, and publishes to the bus only after the commit (the periodic
resync covers a NATS outage).

Invariant: the order below is the order of the OpenAPI ``paths`` and of aiohttp's matching;
changing it changes the published document.
"""

from __future__ import annotations

from services.api import ui
from services.api.context import ApiContext
from services.api.framework import Route
from services.api.routes import (
    alerts,
    audit,
    canaries,
    meta,
    policies,
    tenants,
    tokens,
    workers,
)


def build_routes(ctx: ApiContext) -> list[Route]:
    table: list[Route] = []
    table += meta.routes(ctx, table)
    for resource in (policies, canaries, workers, alerts, audit, tokens, tenants):
        table += resource.routes(ctx)
    table += ui.routes(ctx.decisions)  # the operator page's decision feed
    return table
