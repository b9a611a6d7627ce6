"""Request bodies and parameters of the admin API, declared once as msgspec types.

The same declarations validate requests (``msgspec.json.decode(..., type=...)``, unknown
fields rejected, every field bounded) and produce the JSON Schemas in the OpenAPI document,
so the document cannot drift from what the server accepts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

# ----------------------------------------------------------------------------- scalars
Name = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=64,
        pattern=r"^[a-z0-9][a-z0-9_\-]{0,63}$",
        description="lower-case letters, digits, '_' and '-'",
    ),
]
WorkerId = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_\-]{1,128}$")]
Kind = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_\-]{1,128}$")]
Uuid = Annotated[
    str,
    Meta(
        min_length=36,
        max_length=36,
        pattern=r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
    ),
]
Text = Annotated[str, Meta(max_length=2000)]
Reason = Annotated[str, Meta(max_length=500)]
Version = Annotated[int, Meta(ge=1, le=1_000_000)]
Fraction = Annotated[float, Meta(gt=0.0, le=1.0)]
Severity = Literal["info", "warning", "critical"]
Role = Literal["viewer", "admin"]
AlertState = Literal["firing", "acknowledged", "resolved"]
CanaryState = Literal["running", "paused", "promoted", "rolled_back", "aborted"]
Limit = Annotated[int, Meta(ge=1, le=1000)]
Offset = Annotated[int, Meta(ge=0, le=1_000_000)]


class Body(Struct, forbid_unknown_fields=True, kw_only=True):
    pass


# ----------------------------------------------------------------------------- policies
class PolicySpec(Body, kw_only=True):
    """A routing policy: one of the router's algorithms and its parameters."""

    name: Annotated[str, Meta(min_length=1, max_length=64, description="algorithm name")]
    params: Annotated[dict[str, Any], Meta(max_length=64)] = {}


# Names that are sub-paths of /api/v1/policies/ (POST /api/v1/policies/validate): a policy
# of that name would be addressed by the same URL as the action, so none may be created.
RESERVED_POLICY_NAMES = ("validate",)
PolicyName = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=64,
        pattern=r"^[a-z0-9][a-z0-9_\-]{0,63}$",
        description="lower-case letters, digits, '_' and '-'; not "
        + ", ".join(RESERVED_POLICY_NAMES),
        extra_json_schema={"not": {"enum": list(RESERVED_POLICY_NAMES)}},
    ),
]


class PolicyCreate(Body, kw_only=True):
    name: PolicyName
    description: Text = ""
    spec: PolicySpec


class PolicyUpdate(Body, kw_only=True):
    """A new spec makes a new version (old versions are kept); description edits in place."""

    description: Text | None = None
    spec: PolicySpec | None = None


class PolicyActivate(Body, kw_only=True):
    version: Version | None = None  # default: the latest version


class ActivePolicySet(Body, kw_only=True):
    name: Name  # the policy to activate
    version: Version | None = None  # default: its latest version


# ----------------------------------------------------------------------------- canaries
class CriteriaBody(Body, kw_only=True):
    max_ttft_p95_ratio: Annotated[float, Meta(ge=1.0, le=100.0)] = 1.25
    max_timeout_rate_delta: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.01
    max_error_rate_delta: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.01
    max_cache_hit_rate_drop: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.10
    min_samples: Annotated[int, Meta(ge=1, le=10_000_000)] = 100


class CanaryCreate(Body, kw_only=True):
    policy: Name
    version: Version | None = None  # default: the candidate's latest version
    # the traffic fractions of the rollout's steps: distinct, taken from smallest to largest
    steps: Annotated[
        list[Fraction],
        Meta(
            min_length=1,
            max_length=20,
            description="distinct traffic fractions, applied in increasing order",
            extra_json_schema={"uniqueItems": True},
        ),
    ] = msgspec.field(default_factory=lambda: [0.05, 0.25, 0.5, 1.0])
    step_duration_s: Annotated[float, Meta(ge=0.1, le=7 * 86400.0)] = 600.0
    criteria: CriteriaBody = msgspec.field(default_factory=CriteriaBody)


class CanaryPromote(Body, kw_only=True):
    to: Literal["full", "next"] = "full"
    reason: Reason = ""


class ActionBody(Body, kw_only=True):
    reason: Reason = ""


# An http(s) URL with a host, in ASCII (RFC 3986: userinfo, a reg-name or bracketed IPv6 host,
# port, then printable characters): exactly the URLs a repin accepts (url_pin.url_host finds
# their host), so the schema never admits a URL the handler refuses. No \s / \S: JSON Schema
# (ECMA-262) and Python disagree on which characters they match.
_H16 = "[0-9A-Fa-f]{1,4}"
_IPV6 = "|".join(
    (
        f"(?:{_H16}:){{7}}{_H16}",
        f"(?:{_H16}:){{1,7}}:",
        f"(?:{_H16}:){{1,6}}:{_H16}",
        f"(?:{_H16}:){{1,5}}(?::{_H16}){{1,2}}",
        f"(?:{_H16}:){{1,4}}(?::{_H16}){{1,3}}",
        f"(?:{_H16}:){{1,3}}(?::{_H16}){{1,4}}",
        f"(?:{_H16}:){{1,2}}(?::{_H16}){{1,5}}",
        f"{_H16}:(?::{_H16}){{1,6}}",
        f":(?:(?::{_H16}){{1,7}}|:)",
    )
)
_SUB = "A-Za-z0-9._~%!$&'()*+,;="
REPIN_URL_PATTERN = (
    rf"^https?://(?:[{_SUB}:-]*@)?(?:\[(?:{_IPV6})\]|[{_SUB}-]+)(?::[0-9]{{1,5}})?"
    r"(?:[/?#][!-~]*)?$"
)


class RepinBody(Body, kw_only=True):
    """Re-pin a worker's URL on every router (services.core.url_pin): to ``url``, or, when it
    is left out, to the URL of the next heartbeat each router sees for the worker (racy while
    someone else heartbeats for it: give the URL)."""

    url: Annotated[
        str,
        Meta(
            max_length=2000,
            pattern=REPIN_URL_PATTERN,
            description="the worker's new base URL (http or https, with a host)",
        ),
    ] = ""
    reason: Reason = ""


# ----------------------------------------------------------------------------- alerts
class SilenceCreate(Body, kw_only=True):
    """Silence alerts matching every given field (none given: all alerts) for a period."""

    duration_s: Annotated[float, Meta(ge=1.0, le=30 * 86400.0)]
    fingerprint: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    kind: Kind | None = None
    worker_id: WorkerId | None = None
    severity: Severity | None = None
    comment: Reason = ""


class AlertSilence(Body, kw_only=True):
    duration_s: Annotated[float, Meta(ge=1.0, le=30 * 86400.0)]
    comment: Reason = ""


# ----------------------------------------------------------------------------- tokens
TOKEN_TTL_RANGE_S = (1.0, 10 * 365 * 86400.0)  # the lifetimes a new token may ask for


class TokenCreate(Body, kw_only=True):
    role: Role
    name: Annotated[str, Meta(max_length=128, pattern=r"^[A-Za-z0-9_.@\- ]*$")] = ""
    # lifetime; none: the token lives until revoked (or the server's maximum, when it has one)
    ttl_s: (
        Annotated[
            float,
            Meta(
                ge=TOKEN_TTL_RANGE_S[0],
                le=TOKEN_TTL_RANGE_S[1],
                description="lifetime in seconds (default: no expiry, or the server's "
                "--token-max-ttl-s when set; more than that is refused)",
            ),
        ]
        | None
    ) = None


ALL_BODIES: tuple[type, ...] = (
    PolicySpec,
    PolicyCreate,
    PolicyUpdate,
    PolicyActivate,
    ActivePolicySet,
    CriteriaBody,
    CanaryCreate,
    CanaryPromote,
    ActionBody,
    SilenceCreate,
    AlertSilence,
    TokenCreate,
    RepinBody,
)


# ----------------------------------------------------------------------------- tenants
Priority = Literal["critical", "standard", "sheddable"]
TenantId = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=64,
        pattern=r"^[a-z0-9][a-z0-9_\-]{0,63}$",
        description="lower-case letters, digits, '_' and '-' (a leading '_' is reserved)",
    ),
]
_PerMin = Annotated[int, Meta(ge=1, le=10**12, description="per minute; null: unlimited")]


class TenantQuota(Body, kw_only=True):
    """Limits enforced by the routers' flow control; null: unlimited."""

    requests_per_min: _PerMin | None = None
    input_tokens_per_min: _PerMin | None = None
    output_tokens_per_min: _PerMin | None = None
    concurrent_requests: Annotated[int, Meta(ge=1, le=10_000_000)] | None = None
    cache_budget_blocks: (
        Annotated[int, Meta(ge=1, le=10**12, description="KV blocks the tenant may hold")] | None
    ) = None


class TenantSpec(Body, kw_only=True):
    """What a tenant may do: its share of a saturated fleet (``weight``), the priority band of
    its requests unless a key says otherwise, its quota, and whether its prompts get a cache
    namespace of their own (``cache_isolation``: no prefix sharing with other tenants)."""

    weight: Annotated[float, Meta(gt=0.0, le=1e6)] = 1.0
    default_priority: Priority = "standard"
    quota: TenantQuota = msgspec.field(default_factory=TenantQuota)
    cache_isolation: bool = False


class TenantCreate(Body, kw_only=True):
    tenant_id: TenantId
    description: Text = ""
    spec: TenantSpec = msgspec.field(default_factory=TenantSpec)


class TenantUpdate(Body, kw_only=True):
    description: Text | None = None
    spec: TenantSpec | None = None


class TenantKeyCreate(Body, kw_only=True):
    name: Annotated[str, Meta(max_length=128, pattern=r"^[A-Za-z0-9_.@\- ]*$")] = ""
    priority: Priority | None = None  # null: the tenant's default_priority
    # may a request name its own band (x-kvgate-priority)
    allow_priority_header: bool = False
    ttl_s: (
        Annotated[
            float,
            Meta(
                ge=TOKEN_TTL_RANGE_S[0],
                le=TOKEN_TTL_RANGE_S[1],
                description="lifetime in seconds (default: until revoked)",
            ),
        ]
        | None
    ) = None


ALL_BODIES += (TenantCreate, TenantUpdate, TenantKeyCreate)
