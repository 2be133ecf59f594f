"""`gpupool top`: the status page's live view in a terminal, for a box without a browser.

    gpupool top [--url URL] [--api-key K] [--interval S] [--top N] [--once] [--width COLS]

Reads a running router's admin JSON (`/admin/pools`, `/admin/accounting?top=N`,
`/admin/history` for the latest latency figures and the last hour's ratio, and
`/admin/decisions` when the router has a rebalancer) with the key from `--api-key` or
`$GPUPOOL_API_KEY`, and draws pools, instances, latency by class, the costliest runs and tenants
and the rebalancer's last decisions with `rich`. It redraws every `--interval` seconds until
Ctrl-C; `--once` prints one frame and exits (scripts, tests, a pipe).

Exit codes: 0 success; 1 the router is unreachable or failed; 2 bad input or a refused key.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

__all__ = ["Snapshot", "fetch", "register", "render", "top_command"]

API_KEY_ENV = "GPUPOOL_API_KEY"
URL_ENV = "GPUPOOL_URL"
DEFAULT_URL = "http://127.0.0.1:8000"
HTTP_TIMEOUT_S = 10.0
SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 24
DASH = "–"


class TopError(Exception):
    """Stop with a message and an exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One frame's data: the admin JSON as the router answered it."""

    url: str
    taken_at_s: float
    top_n: int
    pools: dict[str, Any]
    accounting: dict[str, Any] | None
    history: dict[str, Any] | None
    decisions: dict[str, Any] | None


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("top", help="live pools, instances, queues and top runs")
    p.add_argument(
        "--url",
        default=os.environ.get(URL_ENV, DEFAULT_URL),
        help=f"router base URL (default ${URL_ENV} or {DEFAULT_URL})",
    )
    p.add_argument("--api-key", default=None, help=f"admin key (default ${API_KEY_ENV})")
    p.add_argument("--interval", type=float, default=2.0, metavar="S", help="seconds per redraw")
    p.add_argument("--top", type=int, default=5, metavar="N", help="runs and tenants to list")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--width", type=int, default=None, metavar="COLS", help="output width")
    p.set_defaults(func=top_command)


def top_command(args: argparse.Namespace, *, transport: httpx.BaseTransport | None = None) -> int:
    """The entry point. `transport` is the HTTP seam (tests)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per request
    try:
        if args.interval <= 0 or args.top < 1:
            raise TopError("--interval must be > 0 and --top at least 1", 2)
        key = args.api_key or os.environ.get(API_KEY_ENV)
        headers = {"authorization": f"Bearer {key}"} if key else {}
        with httpx.Client(
            base_url=args.url.rstrip("/"),
            headers=headers,
            transport=transport,
            timeout=HTTP_TIMEOUT_S,
        ) as client:
            if args.once:
                width = args.width or (None if sys.stdout.isatty() else 160)
                Console(width=width, soft_wrap=False).print(render(fetch(client, args.top)))
                return 0
            return _live(client, args)
    except TopError as err:
        print(f"gpupool top: {err}", file=sys.stderr)
        return err.code


def _live(client: httpx.Client, args: argparse.Namespace) -> int:
    console = Console(width=args.width)
    frame: RenderableType = Text("connecting to " + args.url)
    with Live(frame, console=console, screen=False, auto_refresh=False) as live:
        try:
            while True:
                try:
                    frame = render(fetch(client, args.top))
                except TopError as err:
                    if err.code == 2:
                        raise
                    frame = Text(f"{time.strftime('%H:%M:%S')} {err} (retrying)", style="red")
                live.update(frame, refresh=True)
                time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0


# --- data ----------------------------------------------------------------------------------


def _get(client: httpx.Client, path: str, params: dict[str, Any] | None = None) -> Any:
    try:
        response = client.get(path, params=params)
    except httpx.HTTPError as err:
        raise TopError(f"cannot reach {client.base_url}: {err}", 1) from None
    if response.status_code == 404:
        return None
    if response.status_code in (401, 403):
        raise TopError(
            f"{client.base_url}{path}: the router refused the API key ({response.status_code});"
            f" give the admin key with --api-key or ${API_KEY_ENV}",
            2,
        )
    if response.status_code >= 400:
        raise TopError(f"{path}: HTTP {response.status_code}: {response.text[:200]}", 1)
    try:
        return response.json()
    except ValueError:
        raise TopError(f"{path}: the answer is not JSON", 1) from None


def fetch(client: httpx.Client, top_n: int, *, now_s: float | None = None) -> Snapshot:
    """One frame's data from the router behind `client`."""
    pools = _get(client, "/admin/pools")
    if pools is None:
        raise TopError(f"{client.base_url} has no /admin/pools: is it a gpupool router?", 1)
    return Snapshot(
        url=str(client.base_url),
        taken_at_s=time.time() if now_s is None else now_s,
        top_n=top_n,
        pools=pools,
        accounting=_get(client, "/admin/accounting", {"top": top_n}),
        history=_get(client, "/admin/history"),
        decisions=_get(client, "/admin/decisions", {"limit": 5}) if "rebalancer" in pools else None,
    )


# --- drawing (pure: a Snapshot in, rich renderables out) ----------------------------------


def _pct(v: Any) -> str:
    return f"{v * 100:.1f} %" if isinstance(v, int | float) else DASH


def _num(v: Any, digits: int = 0) -> str:
    return f"{v:.{digits}f}" if isinstance(v, int | float) else DASH


def _secs(v: Any) -> str:
    if not isinstance(v, int | float):
        return DASH
    return f"{v:.2f} s" if v >= 1 else f"{v * 1000:.0f} ms"


def sparkline(values: list[float | None], lo: float = 0.0, hi: float = 1.0) -> str:
    """The last `SPARK_WIDTH` values as block characters between `lo` and `hi`; gaps blank."""
    out = []
    for v in values[-SPARK_WIDTH:]:
        if v is None:
            out.append(" ")
            continue
        frac = 0.0 if hi <= lo else min(1.0, max(0.0, (v - lo) / (hi - lo)))
        out.append(SPARK[round(frac * (len(SPARK) - 1))])
    return "".join(out)


def _samples(snap: Snapshot) -> list[dict[str, Any]]:
    return list((snap.history or {}).get("samples") or [])


def _latest(samples: list[dict[str, Any]], group: str, name: str) -> dict[str, Any]:
    """The newest non-null figure per key of `sample[group][name]`."""
    found: dict[str, Any] = {}
    for sample in reversed(samples):
        for key, value in (sample.get(group, {}).get(name) or {}).items():
            if value is not None and key not in found:
                found[key] = value
    return found


def render(snap: Snapshot) -> RenderableType:
    view = snap.pools
    reb = view.get("rebalancer")
    samples = _samples(snap)
    ratio = " · ".join(f"{n} {_pct(p['share_frac'])}" for n, p in view["pools"].items())
    header = Text.assemble(
        ("gpupool top ", "bold"),
        f"{snap.url} {time.strftime('%H:%M:%S', time.localtime(snap.taken_at_s))}  ",
        (ratio, "bold"),
        f" · admission {view.get('admission')} · allocation v{view.get('allocation_version')}",
        _rebalancer_line(reb),
    )
    parts: list[RenderableType] = [header, _pools_table(view, samples), _instances_table(view)]
    latency = _latency_table(samples)
    if latency is not None:
        parts.append(latency)
    if snap.accounting is not None:
        parts.extend(_cost_tables(snap.accounting, snap.top_n))
    if reb is not None and snap.decisions is not None:
        parts.append(_decisions_table(snap.decisions))
    return Group(*parts)


def _table(title: str) -> Table:
    return Table(box=box.SIMPLE_HEAD, title=title, title_justify="left")


def _rebalancer_line(reb: dict[str, Any] | None) -> str:
    if reb is None:
        return ""
    state = "off" if reb.get("enabled") is False else "frozen" if reb.get("frozen") else "on"
    line = f" · rebalancer {state}, {reb.get('moves', 0)} moves"
    if reb.get("draining"):
        line += ", draining " + ", ".join(
            f"{i} {d['from_pool']}→{d['to_pool']}" for i, d in reb["draining"].items()
        )
    return line


def _pools_table(view: dict[str, Any], samples: list[dict[str, Any]]) -> Table:
    reb = view.get("rebalancer") or {}
    smoothed = reb.get("smoothed_pressure") or {}
    rates = _latest(samples[-1:], "rates", "requests_per_s") if samples else {}
    t = _table("pools")
    for col in ("pool", "share", "floor–ceiling", "share, last hour", "pressure", "healthy"):
        t.add_column(col, justify="left" if col in ("pool", "share, last hour") else "right")
    for col in ("queue", "drain /s", "req /s", "SLO TTFT / TPOT"):
        t.add_column(col, justify="right")
    for name, p in view["pools"].items():
        shares = [s.get("pools", {}).get(name, {}).get("share_frac") for s in samples]
        q = p.get("queue") or {}
        slo = p.get("slo") or {}
        t.add_row(
            name,
            _pct(p["share_frac"]),
            f"{_pct(p.get('floor_frac'))} – {_pct(p.get('ceiling_frac'))}",
            sparkline(shares),
            _num(smoothed.get(name), 2) if reb else DASH,
            f"{p['healthy_instances']} / {len(p.get('instances') or {})}",
            f"{q.get('depth', 0)} / {q.get('max_depth', DASH)}",
            _num(q.get("drain_rate_per_s"), 2),
            _num(rates.get(name), 2),
            f"{_num(slo.get('ttft_p95_ms'))} / {_num(slo.get('tpot_p95_ms'))} ms",
        )
    return t


def _instances_table(view: dict[str, Any]) -> Table:
    t = _table("instances")
    t.add_column("instance")
    t.add_column("health")
    t.add_column("pools")
    for col in ("KV measured", "KV reserved", "running", "waiting", "in flight", "op. limit"):
        t.add_column(col, justify="right")
    t.add_column("age", justify="right")
    t.add_column("preempt.", justify="right")
    for iid, i in view["instances"].items():
        blocks = i.get("num_gpu_blocks")
        reserved = i.get("kv_reserved_blocks", 0)
        op = i.get("operating_point") or {}
        pools = ", ".join(f"{p} {f * 100:.0f} %" for p, f in (i.get("pools") or {}).items() if f)
        t.add_row(
            iid,
            Text("healthy", style="green") if i["healthy"] else Text("unhealthy", style="red"),
            pools or DASH,
            # an engine that does not report its KV capacity: admitted by its operating point
            Text("kv_capacity: unknown", style="yellow")
            if i.get("kv_capacity") == "unknown"
            else _pct(i.get("kv_usage_frac")),
            f"{reserved} blk" + (f" ({_pct(reserved / blocks)})" if blocks else ""),
            _num(i.get("running")),
            _num(i.get("waiting")),
            _num(i.get("inflight")),
            f"{_num(op.get('limit'))} {op.get('source') or ''}".strip(),
            f"{_num(i.get('telemetry_age_s'), 1)} s",
            _num(i.get("preemptions_seen")),
        )
    return t


def _latency_table(samples: list[dict[str, Any]]) -> Table | None:
    figures = {
        name: _latest(samples, "latency", name)
        for name in ("ttft_p50_s", "ttft_p95_s", "tpot_p95_s")
    }
    classes = sorted(set().union(*figures.values()))
    if not classes:
        return None
    t = _table("latency by class (latest interval)")
    t.add_column("class")
    for col in ("TTFT p50", "TTFT p95", "TPOT p95"):
        t.add_column(col, justify="right")
    for cls in classes:
        t.add_row(cls, *(_secs(figures[n].get(cls)) for n in figures))
    return t


def _cost_tables(acc: dict[str, Any], top_n: int) -> list[Table]:
    runs = _table("top runs by GPU-seconds")
    for col in ("run", "tenant", "classes"):
        runs.add_column(col)
    for col in ("requests", "GPU-s", "wall s", "errors"):
        runs.add_column(col, justify="right")
    for r in acc.get("top_runs") or []:
        runs.add_row(
            r["run_id"],
            r["tenant"],
            ", ".join(r.get("classes") or []),
            _num(r.get("requests")),
            _num(r.get("gpu_seconds"), 2),
            _num(r.get("wall_s"), 1),
            _num(r.get("errors")),
        )
    ledger = acc.get("ledger") or {}
    total = ledger.get("gpu_seconds") or 0.0
    by_tenant = ledger.get("by_tenant") or {}
    tenants = _table("top tenants by GPU-seconds")
    tenants.add_column("tenant")
    for col in ("GPU-s", "share", "requests", "runs"):
        tenants.add_column(col, justify="right")
    ranked = sorted(by_tenant.items(), key=lambda kv: -kv[1]["gpu_seconds"])
    for name, t in ranked[:top_n]:
        tenants.add_row(
            name,
            _num(t["gpu_seconds"], 2),
            _pct(t["gpu_seconds"] / total) if total else DASH,
            _num(t.get("requests")),
            _num(t.get("runs")),
        )
    return [runs, tenants]


def _why(d: dict[str, Any]) -> str:
    """`<reason> (<who>)`, with the kind first when it says more than the reason."""
    kind, reason, who = d.get("kind"), d.get("reason") or "", d.get("who")
    head = f"{kind}: {reason}" if kind and kind != reason else reason
    return f"{head} ({who})" if who else head


def _decisions_table(decisions: dict[str, Any]) -> Table:
    t = _table("rebalancer decisions")
    for col in ("time", "move", "why", "smoothed pressure"):
        t.add_column(col)
    rows = sorted(decisions.get("data") or [], key=lambda d: -(d.get("at_unix_s") or 0))
    if not rows:
        t.add_row("no decisions yet", "", "", "")
    for d in rows[:5]:
        move = d.get("move")
        t.add_row(
            time.strftime("%H:%M:%S", time.localtime(d.get("at_unix_s") or 0)),
            f"{move['from_pool']} → {move['to_pool']} {_pct(move.get('share_frac'))}"
            if move
            else "no move",
            _why(d),
            ", ".join(f"{p} {v:.2f}" for p, v in (d.get("smoothed_pressure") or {}).items()),
        )
    return t
