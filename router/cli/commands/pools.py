"""`gpupool pools`: read and steer the pool ratio of a running router (its admin API).

    gpupool pools show       [--json]
    gpupool pools set-bounds POOL [--floor F] [--ceiling C] [--reset]
    gpupool pools pin        POOL=FRAC [POOL=FRAC ...] | --instance ID --pool POOL
    gpupool pools unpin      [--instance ID]
    gpupool pools freeze | unfreeze
    gpupool pools move       --from POOL --to POOL --share F | --instance ID --to POOL
    gpupool pools decisions  [--limit N] [--moves-only] [--json]

Common options: `--url` (default: http://{router.host}:{router.port} of `--config`, else
http://127.0.0.1:8000) and `--api-key` (default `$GPUPOOL_API_KEY`; the admin key). Changes
are audited under the credential's name (`admin`, or the admin tenant's).

Exit codes: 0 success; 1 the router is unreachable or failed; 2 bad input (options, a refused
change: the router's error message is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import httpx

from pools.config import ConfigError, load_config

__all__ = ["pools_command", "register"]

API_KEY_ENV = "GPUPOOL_API_KEY"
HTTP_TIMEOUT_S = 10.0


class _Failure(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("pools", help="show and steer the pool ratio of a running router")
    p.set_defaults(func=pools_command, pools_command=None)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help="router base URL (default from --config)")
    common.add_argument("--config", metavar="FILE", help="config naming the router's address")
    common.add_argument("--api-key", help=f"admin key (default ${API_KEY_ENV})")
    common.add_argument("--json", action="store_true", help="print JSON")
    sub = p.add_subparsers(dest="pools_command", metavar="COMMAND")
    sub.add_parser("show", parents=[common], help="shares, bounds, pressure, drains, decisions")
    b = sub.add_parser("set-bounds", parents=[common], help="override a pool's floor/ceiling")
    b.add_argument("pool")
    b.add_argument("--floor", type=float, help="floor_frac in [0, 1]")
    b.add_argument("--ceiling", type=float, help="ceiling_frac in [0, 1]")
    b.add_argument("--reset", action="store_true", help="back to the config's bounds")
    pin = sub.add_parser("pin", parents=[common], help="pin the ratio, or an instance to a pool")
    pin.add_argument("shares", nargs="*", metavar="POOL=FRAC")
    pin.add_argument("--instance", help="pin this instance (with --pool)")
    pin.add_argument("--pool", help="the pool to pin --instance to")
    unpin = sub.add_parser("unpin", parents=[common], help="unpin the ratio, or an instance")
    unpin.add_argument("--instance", help="unpin this instance (default: the ratio)")
    sub.add_parser("freeze", parents=[common], help="stop the loop from moving the ratio")
    sub.add_parser("unfreeze", parents=[common], help="let the loop move the ratio again")
    m = sub.add_parser("move", parents=[common], help="move share (or one instance) now")
    m.add_argument("--from", dest="from_pool", help="the pool giving share")
    m.add_argument("--to", dest="to_pool", required=True, help="the pool receiving it")
    m.add_argument("--share", type=float, help="share of total capacity to move, (0, 1]")
    m.add_argument("--instance", help="move this whole instance (it drains first)")
    d = sub.add_parser("decisions", parents=[common], help="the decision log, newest first")
    d.add_argument("--limit", type=int, default=20)
    d.add_argument("--moves-only", action="store_true")


def pools_command(args: argparse.Namespace, *, transport: httpx.BaseTransport | None = None) -> int:
    """The entry point. `transport` is the HTTP seam (tests)."""
    if args.pools_command is None:
        print(
            "gpupool pools: give a command (show, set-bounds, pin, unpin, freeze, unfreeze,"
            " move, decisions)",
            file=sys.stderr,
        )
        return 2
    try:
        method, path, body = _request(args)
        data = _call(args, method, path, body, transport)
        if args.json:
            print(json.dumps(data, indent=2))
        elif args.pools_command == "decisions":
            print(_format_decisions(data["data"]))
        elif args.pools_command == "show":
            print(_format_show(data))
        else:
            print(_format_rebalancer(data))
    except _Failure as failure:
        print(f"gpupool pools: {failure}", file=sys.stderr)
        return failure.code
    return 0


def _shares(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        pool, sep, value = item.partition("=")
        try:
            out[pool] = float(value)
        except ValueError:
            raise _Failure(f"expected POOL=FRAC, got {item!r}", 2) from None
        if not sep or not pool:
            raise _Failure(f"expected POOL=FRAC, got {item!r}", 2)
    return out


def _request(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None]:
    cmd = args.pools_command
    if cmd == "show":
        return "GET", "/admin/pools", None
    if cmd == "decisions":
        if not 1 <= args.limit <= 1000:
            raise _Failure("--limit must be from 1 to 1000", 2)
        query = f"?limit={args.limit}" + ("&moves_only=1" if args.moves_only else "")
        return "GET", f"/admin/decisions{query}", None
    if cmd == "set-bounds":
        if args.reset:
            return "POST", "/admin/pools/bounds", {"pool": args.pool, "reset": True}
        if args.floor is None and args.ceiling is None:
            raise _Failure("set-bounds needs --floor, --ceiling or --reset", 2)
        body: dict[str, Any] = {"pool": args.pool}
        if args.floor is not None:
            body["floor_frac"] = args.floor
        if args.ceiling is not None:
            body["ceiling_frac"] = args.ceiling
        return "POST", "/admin/pools/bounds", body
    if cmd == "pin":
        if args.instance is not None or args.pool is not None:
            if args.shares or args.instance is None or args.pool is None:
                raise _Failure("pin an instance with --instance ID --pool POOL (no shares)", 2)
            return "POST", "/admin/pools/pin", {"instance": args.instance, "pool": args.pool}
        if not args.shares:
            raise _Failure("pin needs POOL=FRAC ... or --instance ID --pool POOL", 2)
        return "POST", "/admin/pools/pin", {"shares": _shares(args.shares)}
    if cmd == "unpin":
        return "POST", "/admin/pools/unpin", ({"instance": args.instance} if args.instance else {})
    if cmd in ("freeze", "unfreeze"):
        return "POST", f"/admin/pools/{cmd}", {}
    # move
    if args.instance is not None:
        if args.from_pool is not None or args.share is not None:
            raise _Failure("move --instance ID --to POOL takes no --from or --share", 2)
        return "POST", "/admin/pools/move", {"instance": args.instance, "to_pool": args.to_pool}
    if args.from_pool is None or args.share is None:
        raise _Failure("move needs --from POOL --to POOL --share F, or --instance ID --to POOL", 2)
    return (
        "POST",
        "/admin/pools/move",
        {
            "from_pool": args.from_pool,
            "to_pool": args.to_pool,
            "share_frac": args.share,
        },
    )


def _base_url(args: argparse.Namespace) -> str:
    if args.url:
        return str(args.url).rstrip("/")
    if args.config:
        try:
            rc = load_config(args.config).router
        except ConfigError as err:
            raise _Failure(f"invalid config {err.source}: {'; '.join(err.problems)}", 2) from None
        host = "127.0.0.1" if rc.host in ("0.0.0.0", "::") else rc.host
        return f"http://{host}:{rc.port}"
    return "http://127.0.0.1:8000"


def _call(
    args: argparse.Namespace,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    transport: httpx.BaseTransport | None,
) -> Any:
    key = args.api_key or os.environ.get(API_KEY_ENV)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = _base_url(args)
    try:
        with httpx.Client(transport=transport, timeout=HTTP_TIMEOUT_S) as client:
            resp = client.request(method, f"{url}{path}", json=body, headers=headers)
    except httpx.HTTPError as err:
        raise _Failure(f"cannot reach the router at {url}: {err}", 1) from None
    if resp.status_code >= 400:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text[:200]
        raise _Failure(f"{resp.status_code}: {message}", 2 if resp.status_code < 500 else 1)
    return resp.json()


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * float(value):.1f}%"


def _format_rebalancer(r: dict[str, Any]) -> str:
    lines = [
        f"rebalancer: {'on' if r['enabled'] else 'off (SRE moves only)'}"
        f"{', FROZEN' if r['frozen'] else ''}"
        f"{', ratio pinned' if r['pinned_shares'] else ''}"
        f"; moves {r['moves']}; interval {r['interval_s']:g} s, cooldown {r['cooldown_s']:g} s"
        f" (left {r['cooldown_left_s'] if r['cooldown_left_s'] is not None else '-'} s)",
        f"{'pool':<12}{'target':>8}{'placed':>8}{'floor':>8}{'ceiling':>8}{'pressure':>10}",
    ]
    smoothed = r.get("smoothed_pressure") or {}
    for pool in sorted(r["target_shares"]):
        lo, hi = r["bounds"][pool]
        p = smoothed.get(pool)
        lines.append(
            f"{pool:<12}{_pct(r['target_shares'][pool]):>8}{_pct(r['placed_shares'][pool]):>8}"
            f"{_pct(lo):>8}{_pct(hi):>8}{'-' if p is None else f'{p:.2f}':>10}"
        )
    for pool, by_signal in (r.get("pressure") or {}).items():
        parts = ", ".join(f"{s} {v:.2f}" for s, v in by_signal.items())
        lines.append(f"  {pool} pressure by signal: {parts}")
    leader = r.get("leader")
    if leader is not None and leader.get("election") != "embedded":
        lines.append(
            f"answered by replica {leader['replica']}: "
            + (
                "it leads (decides the ratio)"
                if leader["leading"]
                else f"leader {leader['leader']}"
            )
        )
    if r["pinned_instances"]:
        pins = ", ".join(f"{i} -> {p}" for i, p in sorted(r["pinned_instances"].items()))
        lines.append(f"pinned instances: {pins}")
    for iid, d in r["draining"].items():
        lines.append(
            f"draining {iid}: {d['from_pool']} -> {d['to_pool']} for {d['for_s']} s,"
            f" {d['old_sequences_left']} old sequences left, deadline in {d['deadline_in_s']} s"
        )
    return "\n".join(lines)


def _format_show(view: dict[str, Any]) -> str:
    lines = [_format_rebalancer(view["rebalancer"]), ""]
    lines.append(f"{'pool':<12}{'queue':>7}{'instances'}")
    for name, pool in view["pools"].items():
        inst = ", ".join(f"{i} {f:.2f}" for i, f in pool["instances"].items())
        lines.append(f"{name:<12}{pool['queue']['depth']:>7}  {inst}")
    lines.append("")
    lines.append("last decisions:")
    lines.append(_format_decisions(view["rebalancer"]["last_decisions"]))
    return "\n".join(lines)


def _format_decisions(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "  (none yet)"
    out = []
    for row in rows:
        move = row.get("move")
        what = (
            f"{move['from_pool']} -> {move['to_pool']} {_pct(move['share_frac'])}" if move else ""
        )
        if row.get("reason") == "drain_done":
            what = (
                f"{row['instance']} joined {row['to_pool']} ({row['ended_by']}, {row['drain_s']} s)"
            )
        shares = ", ".join(f"{p} {_pct(v)}" for p, v in sorted(row.get("shares", {}).items()))
        out.append(f"  {row.get('at_unix_s', 0):.0f} {row['reason']:<18} {what:<32} {shares}")
    return "\n".join(out)
