"""Who is calling: API keys from config map to tenants (`Authorization: Bearer KEY`).

With no keys configured the router is open: every caller is the tenant `default`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pools.config import TenantConfig
from router.errors import Forbidden, Unauthorized

__all__ = ["ANONYMOUS", "Tenants"]

ANONYMOUS = TenantConfig(
    name="default",
    api_key=None,
    weight=1.0,
    tokens_per_minute=None,
    max_concurrent_runs=None,
    default_class=None,
    may_set_class=True,
    admin=True,
)


@dataclass(frozen=True, slots=True)
class Tenants:
    by_key: dict[str, TenantConfig]
    by_name: dict[str, TenantConfig]

    @classmethod
    def from_config(cls, tenants: tuple[TenantConfig, ...]) -> Tenants:
        return cls(
            by_key={t.api_key: t for t in tenants if t.api_key},
            by_name={t.name: t for t in tenants},
        )

    @property
    def open(self) -> bool:
        """True when no API key is configured: anyone may call, as tenant `default`."""
        return not self.by_key

    def authenticate(self, authorization: str | None) -> TenantConfig:
        """The tenant for an `Authorization` header value. Raises `Unauthorized`."""
        if self.open:
            if authorization and authorization.startswith("Bearer "):
                tenant = self.by_key.get(authorization[7:].strip())
                if tenant is not None:
                    return tenant
            return self.by_name.get("default", ANONYMOUS)
        if not authorization:
            raise Unauthorized(
                "missing API key: send `Authorization: Bearer <key>`", "missing_api_key"
            )
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthorized(
                "malformed Authorization header: use `Bearer <key>`", "invalid_api_key"
            )
        tenant = self.by_key.get(key.strip())
        if tenant is None:
            raise Unauthorized("invalid API key", "invalid_api_key")
        return tenant

    def authenticate_admin(self, authorization: str | None) -> TenantConfig:
        """Like `authenticate`, and the tenant must be an admin (anyone, when open)."""
        tenant = self.authenticate(authorization)
        if not self.open and not tenant.admin:
            raise Forbidden(f"tenant {tenant.name!r} is not an admin", "admin_only")
        return tenant
