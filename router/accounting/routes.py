"""Accounting over HTTP, read from the ledger:

GET /v1/runs                 the calling tenant's runs (?since_s=&limit=&class=)
GET /v1/runs/{run_id}        one run's summary; a session id: its runs and its current run
GET /admin/accounting        totals, top tenants and the live conservation check (admin)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from router.accounting.accountant import ConservationReport
from router.accounting.ledger import Ledger
from router.errors import NotFound
from router.identity import OperatorAccess, Tenants
from router.query_params import float_param, int_param

__all__ = ["register"]


def register(
    api: FastAPI,
    access: OperatorAccess,
    tenants: Tenants,
    ledger: Ledger,
    *,
    live: Callable[[], ConservationReport],
    session: Callable[[str, str], dict[str, Any] | None],
) -> None:
    """Add accounting's routes to `api`. `live()` is the accountant's conservation report now;
    `session(tenant, id)` what governance knows of a session with that id (None: not one)."""

    @api.get("/v1/runs/{run_id}")
    async def run_detail(run_id: str, request: Request) -> dict[str, Any]:
        tenant = tenants.caller(request.headers)
        summary = await ledger.run_summary(run_id, tenant.name)
        known = None if summary else session(tenant.name, run_id)
        if known is not None:  # a session id: its runs, and its current run's summary
            current = known["current_run"]
            latest = current and await ledger.run_summary(current, tenant.name)
            return {**known, "current": latest or None}
        if summary is None:
            raise NotFound(f"no run {run_id!r} for tenant {tenant.name!r}", "run_not_found")
        return summary

    @api.get("/v1/runs")
    async def runs(request: Request) -> dict[str, Any]:
        tenant = tenants.caller(request.headers)
        q = request.query_params
        since_s = float_param(q.get("since_s", q.get("since")), "since_s")
        limit = int_param(q.get("limit"), "limit", default=50, low=1, high=1000)
        data = await ledger.list_runs(
            tenant.name, since_s=since_s, limit=limit, class_name=q.get("class")
        )
        return {"object": "list", "data": data}

    @api.get("/admin/accounting")
    async def admin_accounting(request: Request) -> dict[str, Any]:
        access.authorize_admin(request.headers.get("authorization"))
        q = request.query_params
        top = int_param(q.get("top"), "top", default=10, low=1, high=1000)
        report: dict[str, Any] = await ledger.admin_report(
            top_n=top,
            tenant=q.get("tenant"),
            since_s=float_param(q.get("since_s"), "since_s"),
            live=live(),
        )
        return report
