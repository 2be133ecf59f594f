"""Governance over HTTP:

GET  /v1/budget                  the calling tenant's budgets, tier and cost cap
POST /v1/runs/{run_id}/end       end a run (or a session's current run) now
POST /admin/governance/reload    re-read the config file's tenants (admin credential)
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request

from pools.config import ConfigError, contract_problems, load_config
from router.errors import BadRequest, NotFound
from router.governance.governor import Governor
from router.identity import OperatorAccess, Tenants

__all__ = ["register"]


def register(
    api: FastAPI,
    access: OperatorAccess,
    tenants: Tenants,
    governor: Governor,
    *,
    config_source: str,
) -> None:
    """Add governance's routes to `api`; `config_source` is the file the router started from
    (`Config.source`; `<...>` when it started from no file)."""

    @api.post("/admin/governance/reload")
    async def governance_reload(request: Request) -> dict[str, Any]:
        """Re-read the config file the router started from and apply its tenants' budgets,
        tiers, cost caps and run guards (for new runs) without dropping a request."""
        access.authorize_admin(request.headers.get("authorization"))
        source = config_source
        if not source or source.startswith("<"):
            raise BadRequest(
                "the router was started without a config file: nothing to reload",
                "no_config_file",
            )
        try:
            fresh = await asyncio.to_thread(load_config, source)
        except ConfigError as err:
            raise BadRequest("; ".join(err.problems)[:2000], "invalid_config") from None
        problems = contract_problems(fresh)
        if problems:
            raise BadRequest("; ".join(problems)[:2000], "inconsistent_config")
        reloaded = governor.reload(fresh)
        return {"object": "gpupool.governance_reload", "source": source, "tenants": reloaded}

    @api.get("/v1/budget")
    async def budget(request: Request) -> dict[str, Any]:
        tenant = tenants.caller(request.headers)
        return await governor.budget_now(tenant)  # shared store: one read of its buckets

    @api.post("/v1/runs/{run_id}/end")
    async def end_run(run_id: str, request: Request) -> dict[str, Any]:
        tenant = tenants.caller(request.headers)
        run = governor.end_run(tenant.name, run_id)
        if run is None:
            raise NotFound(
                f"no active or recent run {run_id[:64]!r} for tenant {tenant.name!r}",
                "run_not_found",
            )
        return {
            "object": "gpupool.run_end",
            "run_id": run.run_id,  # a session's id ends its current run, `<session>:<n>`
            "reason": run.ended,
            "steps": run.steps,
            "tokens": run.tokens,
            "gpu_seconds": round(run.gpu_seconds, 6),
        }
