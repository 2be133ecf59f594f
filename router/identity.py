"""Who is calling: API keys map to tenants (`Authorization: Bearer KEY`), and who may operate.

`Tenants` answers "which tenant is this": with no tenant key configured the router is open and
every caller is the tenant `default`. `OperatorAccess` answers "may this caller read /admin/*
or /metrics", which is closed by default:

- /admin/* needs an admin credential: the key in `router.admin_api_key_env` (or
  `router.admin_api_key_sha256`), or the key of a tenant with `admin: true`. With no admin
  credential configured /admin/* answers 403 saying how to configure one, except on a router
  with no key of any kind that listens on a loopback host (127.0.0.0/8, ::1, localhost): there
  it stays open for local development (`make run`), since only local processes reach it.
- /metrics is open while no key of any kind is configured (every caller is `default`; there is
  no tenant to hide). Once any key exists it needs the admin credential or the scrape key
  `router.metrics_api_key_env`: the metrics name tenants and their usage, and stripping the
  labels would also blind the operators, while Prometheus sends a bearer token as easily
  (`authorization: {credentials_file: ...}` in the scrape config).

Keys are never kept or compared as given: each is hashed with SHA-256 and a tenant is found by
its key's digest, then the digests are compared with `hmac.compare_digest`. A dict lookup by
digest leaks nothing useful (timing could only reveal a prefix of a hash, not of a key). Nothing
here logs a key, a header or a digest.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field

from pools.config import RouterConfig, TenantConfig
from router.errors import Forbidden, Unauthorized

__all__ = ["ANONYMOUS", "OperatorAccess", "Tenants", "is_loopback_host", "key_digest"]

ANONYMOUS = TenantConfig(
    name="default",
    api_key=None,
    weight=1.0,
    tokens_per_minute=None,
    max_concurrent_runs=None,
    default_class=None,
    may_set_class=True,
    admin=False,
)

_ADMIN_HOWTO = (
    "set router.admin_api_key_env to the name of an environment variable holding an admin key"
    " (or mark a tenant `admin: true`) and send `Authorization: Bearer <key>`"
)


def key_digest(key: str) -> bytes:
    """The SHA-256 digest keys are looked up and compared by."""
    return hashlib.sha256(key.encode()).digest()


def _tenant_digest(tenant: TenantConfig) -> bytes | None:
    if tenant.api_key_sha256:
        return bytes.fromhex(tenant.api_key_sha256)
    return key_digest(tenant.api_key) if tenant.api_key else None


def _presented_key(authorization: str | None, x_api_key: str | None = None) -> str:
    """The key in an `Authorization: Bearer <key>` value, or the password of `Basic` credentials
    (any user name: a browser asks for them on the status page, `GET /ui`, and then sends them
    with the page's own calls to /admin/*), or, with no `Authorization`, an `x-api-key` value
    (how the Anthropic SDK and Claude Code send `ANTHROPIC_API_KEY`). Raises `Unauthorized`."""
    if not authorization and x_api_key is not None:
        if not x_api_key.strip():
            raise Unauthorized("empty x-api-key header", "invalid_api_key")
        return x_api_key.strip()
    if not authorization:
        raise Unauthorized(
            "missing API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`)",
            "missing_api_key",
        )
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() == "basic":
        key = _basic_password(key.strip())
    elif scheme.lower() != "bearer":
        key = ""
    if not key.strip():
        raise Unauthorized("malformed Authorization header: use `Bearer <key>`", "invalid_api_key")
    return key.strip()


def _basic_password(credentials: str) -> str:
    """The password in base64 `user:password` (empty when it does not decode)."""
    try:
        decoded = base64.b64decode(credentials, validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        return ""
    return decoded.partition(":")[2]


def is_loopback_host(host: str) -> bool:
    """True for an address only local processes reach: 127.0.0.0/8, ::1, `localhost`."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # another host name: it may resolve to anything


@dataclass(frozen=True, slots=True)
class Tenants:
    by_digest: dict[bytes, TenantConfig] = field(repr=False)
    by_name: dict[str, TenantConfig]

    @classmethod
    def from_config(cls, tenants: tuple[TenantConfig, ...]) -> Tenants:
        by_digest = {}
        for tenant in tenants:
            digest = _tenant_digest(tenant)
            if digest is not None:
                by_digest[digest] = tenant
        return cls(by_digest=by_digest, by_name={t.name: t for t in tenants})

    @property
    def open(self) -> bool:
        """True when no tenant key is configured: anyone may call, as tenant `default`."""
        return not self.by_digest

    def find(self, key: str) -> TenantConfig | None:
        """The tenant whose key is `key`, in time independent of how much of it matches."""
        digest = key_digest(key)
        tenant = self.by_digest.get(digest)
        if tenant is None:
            return None
        stored = _tenant_digest(tenant)
        return tenant if stored is not None and hmac.compare_digest(digest, stored) else None

    def authenticate(self, authorization: str | None, x_api_key: str | None = None) -> TenantConfig:
        """The tenant for an `Authorization` header value (or, without one, an `x-api-key`
        value). Raises `Unauthorized`."""
        if self.open:
            return self.by_name.get("default", ANONYMOUS)
        tenant = self.find(_presented_key(authorization, x_api_key))
        if tenant is None:
            raise Unauthorized("invalid API key", "invalid_api_key")
        return tenant

    def caller(self, headers: Mapping[str, str]) -> TenantConfig:
        """The calling tenant of a request with `headers`: `Authorization: Bearer KEY`, or
        `x-api-key` (Anthropic's clients). Raises `Unauthorized`."""
        return self.authenticate(headers.get("authorization"), headers.get("x-api-key"))


@dataclass(frozen=True, slots=True)
class OperatorAccess:
    """Who may read /admin/* and /metrics (see the module docstring for the policy)."""

    tenants: Tenants
    admin_digest: bytes | None = field(repr=False)
    metrics_digest: bytes | None = field(repr=False)
    loopback: bool  # the router listens on a loopback host

    @classmethod
    def from_config(cls, tenants: Tenants, router: RouterConfig) -> OperatorAccess:
        def digest(hex_digest: str | None) -> bytes | None:
            return None if hex_digest is None else bytes.fromhex(hex_digest)

        return cls(
            tenants=tenants,
            admin_digest=digest(router.admin_api_key_sha256),
            metrics_digest=digest(router.metrics_api_key_sha256),
            loopback=is_loopback_host(router.host),
        )

    @property
    def any_key(self) -> bool:
        """True when some key (tenant, admin or metrics) is configured."""
        return (
            not self.tenants.open
            or self.admin_digest is not None
            or self.metrics_digest is not None
        )

    @property
    def admin_configured(self) -> bool:
        return self.admin_digest is not None or any(
            t.admin for t in self.tenants.by_digest.values()
        )

    def authorize_admin(self, authorization: str | None) -> str:
        """Who is operating (`admin` for the router's admin key, else the admin tenant's name).

        Raises `Unauthorized` (no or unknown key) or `Forbidden` (a tenant that is not an admin;
        no admin credential configured)."""
        if not self.admin_configured:
            if not self.any_key and self.loopback:
                return "local"
            raise Forbidden(
                "no admin credential is configured, so /admin/* is closed: "
                + _ADMIN_HOWTO
                + ". (A router with no keys at all that listens on a loopback host, e.g."
                " router.host 127.0.0.1, leaves /admin/* open for local development.)",
                "admin_not_configured",
            )
        key = _presented_key(authorization)
        if self._matches(key, self.admin_digest):
            return "admin"
        tenant = self.tenants.find(key)
        if tenant is None:
            raise Unauthorized("invalid API key", "invalid_api_key")
        if not tenant.admin:
            raise Forbidden(
                f"tenant {tenant.name!r} is not an admin: /admin/* needs the admin key",
                "admin_only",
            )
        return tenant.name

    def authorize_metrics(self, authorization: str | None) -> None:
        """Open while no key exists; then the admin credential or the metrics key.

        Raises `Unauthorized` or `Forbidden`."""
        if not self.any_key:
            return
        key = _presented_key(authorization)
        if self._matches(key, self.metrics_digest) or self._matches(key, self.admin_digest):
            return
        tenant = self.tenants.find(key)
        if tenant is None:
            raise Unauthorized("invalid API key", "invalid_api_key")
        if not tenant.admin:
            raise Forbidden(
                f"tenant {tenant.name!r} may not read /metrics: use the admin key or the key"
                " in router.metrics_api_key_env",
                "metrics_forbidden",
            )

    @staticmethod
    def _matches(key: str, digest: bytes | None) -> bool:
        return digest is not None and hmac.compare_digest(key_digest(key), digest)
