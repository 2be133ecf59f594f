"""The SREs' HTTP controls over the pool ratio (admin credential only), next to the read-only
`GET /admin/pools`:

    POST /admin/pools/bounds    {"pool", "floor_frac"?, "ceiling_frac"?, "reset"?}
    POST /admin/pools/pin       {"shares": {pool: frac}} | {"instance", "pool"}
    POST /admin/pools/unpin     {} (the ratio) | {"instance"}
    POST /admin/pools/freeze    {}
    POST /admin/pools/unfreeze  {}
    POST /admin/pools/move      {"from_pool", "to_pool", "share_frac"} | {"instance", "to_pool"}
    GET  /admin/decisions       ?limit=50&since_s=&moves_only=1
    GET  /admin/pools/audit     ?limit=50

Each POST answers the rebalancer's view (`Rebalancer.view`). Bad input is a 400
`invalid_request_error` (router/errors.py); an unknown pool or instance a 404.
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from router.errors import BadRequest
from router.identity import OperatorAccess
from router.rebalancer.rebalancer import Rebalancer

__all__ = ["register"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BoundsBody(_Body):
    pool: str
    floor_frac: float | None = Field(default=None, ge=0.0, le=1.0)
    ceiling_frac: float | None = Field(default=None, ge=0.0, le=1.0)
    reset: bool = False  # back to the config's bounds (and schedule)


class PinBody(_Body):
    shares: dict[str, float] | None = None
    instance: str | None = None
    pool: str | None = None


class UnpinBody(_Body):
    instance: str | None = None


class MoveBody(_Body):
    from_pool: str | None = None
    to_pool: str
    share_frac: float | None = Field(default=None, gt=0.0, le=1.0)
    instance: str | None = None


class EmptyBody(_Body):
    pass


def _limit(raw: str | None) -> int:
    if raw is None or raw == "":
        return 50
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (1 <= value <= 1000) or value != int(value):
        raise BadRequest(
            "query parameter limit must be a whole number from 1 to 1000",
            "invalid_param",
            param="limit",
        )
    return int(value)


def register(api: FastAPI, access: OperatorAccess, rebalancer: Rebalancer) -> None:
    def who(request: Request) -> str:
        return access.authorize_admin(request.headers.get("authorization"))

    @api.post("/admin/pools/bounds")
    async def set_bounds(body: BoundsBody, request: Request) -> dict[str, Any]:
        operator = who(request)
        if body.reset:
            return await rebalancer.set_bounds(operator, body.pool, None, None)
        if body.floor_frac is None and body.ceiling_frac is None:
            raise BadRequest(
                "give floor_frac, ceiling_frac or both (or reset: true)", "invalid_bounds"
            )
        return await rebalancer.set_bounds(operator, body.pool, body.floor_frac, body.ceiling_frac)

    @api.post("/admin/pools/pin")
    async def pin(body: PinBody, request: Request) -> dict[str, Any]:
        operator = who(request)
        if body.shares is not None and body.instance is None and body.pool is None:
            return await rebalancer.pin(operator, body.shares)
        if body.shares is None and body.instance is not None and body.pool is not None:
            return await rebalancer.pin_instance(operator, body.instance, body.pool)
        raise BadRequest(
            'pin a ratio ({"shares": {"agent": 0.4, "normal": 0.6}}) or an instance'
            ' ({"instance": "engine-0", "pool": "agent"})',
            "invalid_pin",
        )

    @api.post("/admin/pools/unpin")
    async def unpin(body: UnpinBody, request: Request) -> dict[str, Any]:
        operator = who(request)
        if body.instance is not None:
            return await rebalancer.pin_instance(operator, body.instance, None)
        return await rebalancer.unpin(operator)

    @api.post("/admin/pools/freeze")
    async def freeze(body: EmptyBody, request: Request) -> dict[str, Any]:
        return await rebalancer.freeze(who(request), True)

    @api.post("/admin/pools/unfreeze")
    async def unfreeze(body: EmptyBody, request: Request) -> dict[str, Any]:
        return await rebalancer.freeze(who(request), False)

    @api.post("/admin/pools/move")
    async def move(body: MoveBody, request: Request) -> dict[str, Any]:
        operator = who(request)
        if body.instance is not None and body.from_pool is None and body.share_frac is None:
            return await rebalancer.move_instance(operator, body.instance, body.to_pool)
        if body.instance is None and body.from_pool is not None and body.share_frac is not None:
            return await rebalancer.move(operator, body.from_pool, body.to_pool, body.share_frac)
        raise BadRequest(
            'move a share ({"from_pool", "to_pool", "share_frac"}) or an instance'
            ' ({"instance", "to_pool"})',
            "invalid_move",
        )

    @api.get("/admin/pools/audit")
    async def audit(request: Request) -> dict[str, Any]:
        who(request)
        rows = await rebalancer.decision_log.audit(limit=_limit(request.query_params.get("limit")))
        return {"object": "list", "data": rows}

    @api.get("/admin/decisions")
    async def decisions(request: Request) -> dict[str, Any]:
        who(request)
        q = request.query_params
        since_raw = q.get("since_s")
        since: float | None = None
        if since_raw not in (None, ""):
            try:
                since = float(since_raw)
            except ValueError:
                since = math.nan
            if not abs(since) <= 2**53:
                raise BadRequest(
                    "query parameter since_s must be a finite number (unix seconds)",
                    "invalid_param",
                    param="since_s",
                )
        moves_only = q.get("moves_only", "") in ("1", "true", "yes")
        rows = await rebalancer.decision_log.decisions(
            limit=_limit(q.get("limit")), since_unix_s=since, moves_only=moves_only
        )
        return {"object": "list", "data": rows}
