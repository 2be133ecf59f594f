"""Which limits apply to a tenant and to one of its runs, from the config (pure lookups).

A tenant's tier (`governance.tiers`) sets its concurrent runs, concurrent requests and queue
weight; the tenant's own `max_concurrent_runs` overrides the tier's. A run's guards are its
class's `run_guards`, then the tenant's overrides; its `max_duration_s` is then replaced by
the task type's (`x-gpupool-task-type`, else the tenant's `task_type`) when one is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pools.config import Config, TenantConfig
from router.governance.guards import RunLimits

__all__ = ["TenantLimits", "run_limit_settings", "run_limits", "tenant_limits"]


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """One tenant's limits; None: none."""

    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    max_concurrent_runs: int | None = None
    max_concurrent_requests: int | None = None
    queue_weight: float = 1.0
    cost_cap_gpu_seconds_per_hour: float | None = None
    daily_budget_gpu_seconds: float | None = None


def tenant_limits(config: Config, tenant: TenantConfig) -> TenantLimits:
    tier = config.governance.tier(tenant.tier)
    runs = tenant.max_concurrent_runs
    if runs is None and tier is not None:
        runs = tier.max_concurrent_runs
    return TenantLimits(
        tokens_per_minute=tenant.tokens_per_minute,
        requests_per_minute=tenant.requests_per_minute,
        max_concurrent_runs=runs,
        max_concurrent_requests=None if tier is None else tier.max_concurrent_requests,
        queue_weight=1.0 if tier is None else tier.queue_weight,
        cost_cap_gpu_seconds_per_hour=tenant.cost_cap_gpu_seconds_per_hour,
        daily_budget_gpu_seconds=tenant.daily_budget_gpu_seconds,
    )


def run_limits(
    config: Config, class_name: str, tenant: TenantConfig, task_type: str | None
) -> RunLimits:
    """The guards of a run of `tenant` whose first step is of `class_name`. `task_type` was
    checked against `governance.task_types_s` by the caller (None: the tenant's, if any)."""
    g = config.class_config(class_name).run_guards
    limits: RunLimits = g
    if tenant.run_guards:
        limits = replace(limits, **dict(tenant.run_guards))  # type: ignore[arg-type]
    chosen = task_type or tenant.task_type
    if chosen is not None:
        duration_s = dict(config.governance.task_types_s).get(chosen)
        if duration_s is not None:
            limits = replace(limits, max_duration_s=duration_s)
    return limits


def run_limit_settings(
    config: Config, class_name: str, tenant: TenantConfig, task_type: str | None
) -> dict[str, str]:
    """Where each of `run_limits`' guards came from, as the config setting to raise (the 403
    of a stopped run names it): `classes.<class>.run_guards.<field>`, the tenant's override,
    or the task type's duration."""
    names = ("max_steps", "max_tokens", "max_gpu_seconds", "max_duration_s", "loop_repeats")
    settings = {name: f"classes.{class_name}.run_guards.{name}" for name in names}
    for name, _ in tenant.run_guards:
        settings[name] = f"tenants[{tenant.name}].run_guards.{name}"
    chosen = task_type or tenant.task_type
    if chosen is not None and chosen in dict(config.governance.task_types_s):
        settings["max_duration_s"] = f"governance.task_types_s.{chosen}"
    return settings
