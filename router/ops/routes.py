"""What operators read over HTTP:

GET /openapi.json    the OpenAPI description of this router (router/ops/openapi.py)
GET /metrics         Prometheus exposition (admin or scrape credential once keys exist)
GET /admin/pools     pools, instances, queues and the rebalancer's view (`PoolsView`)
GET /admin/history   the last hour for the status page's plots (?since_s=)
GET /ui, /ui/{asset} the status page (router/ops/ui)
GET /admin/gpus      the latest GPU snapshot (NVML)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gpu_probe.sampler import GpuSampler
from router.identity import OperatorAccess
from router.ops.history import History
from router.ops.pools_view import PoolsView
from router.ops.ui import register_ui
from router.query_params import float_param

__all__ = ["register"]


def register(
    api: FastAPI,
    access: OperatorAccess,
    *,
    document: dict[str, Any],
    pools: PoolsView,
    refresh_metrics: Callable[[], None],
    registry: CollectorRegistry,
    history: History,
    gpu_sampler: GpuSampler,
) -> None:
    """Add the operators' routes to `api`. `document` is the OpenAPI document, built once;
    `refresh_metrics()` sets every gauge `registry` exports before a scrape."""

    @api.get("/openapi.json")
    async def openapi() -> dict[str, Any]:
        return document

    @api.get("/metrics")
    async def metrics(request: Request) -> Response:
        access.authorize_metrics(request.headers.get("authorization"))
        refresh_metrics()
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @api.get("/admin/pools")
    async def admin_pools(request: Request) -> dict[str, Any]:
        access.authorize_admin(request.headers.get("authorization"))
        return pools.view()

    @api.get("/admin/history")
    async def admin_history(request: Request) -> dict[str, Any]:
        access.authorize_admin(request.headers.get("authorization"))
        since_s = float_param(request.query_params.get("since_s"), "since_s")
        return history.view(since_s)

    register_ui(api, access)

    @api.get("/admin/gpus")
    async def admin_gpus(request: Request) -> dict[str, Any]:
        access.authorize_admin(request.headers.get("authorization"))
        latest = gpu_sampler.latest
        return {
            "object": "gpupool.gpus",
            "snapshot": None if latest is None else latest.to_dict(),
        }
