"""`gpupool runs`: GPU-seconds per run, tenant, class and pool, from the ledger.

    gpupool runs [--ledger PATH | --url URL [--api-key K]] [--config FILE] [--tenant T]
                 [--top N] [--json]
    gpupool runs show RUN_ID [same options]

Reads the ledger directly: the SQLite file (default: `router.ledger_path` of `--config`, else
the built-in `./.gpupool/ledger.sqlite`), or the PostgreSQL store when `--config` sets
`store.url`; or with `--url` a running router's API:
`GET {url}/admin/accounting?top=N[&tenant=T]` and `GET {url}/v1/runs/{run_id}`, with the key
from `--api-key` or `$GPUPOOL_API_KEY` as a bearer token. A session id (Claude Code's, Codex's)
names many runs, `<session>:1`, `<session>:2`, ... (one per task); with `--url`, `show SESSION`
lists them and shows the current one. Both paths print the same JSON shapes
(router/accounting/ledger.py: `top_runs_report`, `run_summary`).

Exit codes: 0 success; 1 the run is unknown, or the router is unreachable or failed;
2 bad input (options, config, a missing or foreign ledger file, a refused API key).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from pools.config import ConfigError, load_config
from router.accounting.ledger import LedgerError, open_readonly, run_summary, top_runs_report
from router.store import StoreError, Stores

__all__ = ["register", "run_command"]

API_KEY_ENV = "GPUPOOL_API_KEY"
HTTP_TIMEOUT_S = 10.0


class _Failure(Exception):
    """Stop with a message and an exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _add_source_options(p: argparse.ArgumentParser, *, nested: bool) -> None:
    # In `runs show`, defaults are suppressed so options given before `show` are not reset.
    def default(value: Any) -> Any:
        return argparse.SUPPRESS if nested else value

    source = p.add_mutually_exclusive_group()
    source.add_argument("--ledger", metavar="PATH", default=default(None), help="ledger file")
    source.add_argument("--url", default=default(None), help="router base URL, e.g. http://h:8000")
    p.add_argument(
        "--api-key", default=default(None), help=f"bearer key for --url (default ${API_KEY_ENV})"
    )
    p.add_argument(
        "--config", metavar="FILE", default=default(None), help="config naming the ledger path"
    )
    p.add_argument("--tenant", default=default(None), help="only this tenant's runs")
    p.add_argument("--json", action="store_true", default=default(False), help="print JSON")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("runs", help="GPU-seconds per run, tenant, class and pool")
    _add_source_options(p, nested=False)
    p.add_argument("--top", type=int, default=10, metavar="N", help="runs to list (default 10)")
    p.set_defaults(func=run_command, runs_command=None)
    sub = p.add_subparsers(dest="runs_command", metavar="show")
    show = sub.add_parser("show", help="one run: totals and every request")
    show.add_argument("run_id")
    _add_source_options(show, nested=True)


def run_command(args: argparse.Namespace, *, transport: httpx.BaseTransport | None = None) -> int:
    """The entry point for both `runs` and `runs show`. `transport` is the HTTP seam (tests)."""
    try:
        if args.runs_command == "show":
            run = _fetch_run(args, transport)
            if run is None:
                raise _Failure(f"run {args.run_id!r} not found", 1)
            print(json.dumps(run, indent=2) if args.json else _format_run(run))
        else:
            if args.top < 1:
                raise _Failure("--top must be at least 1", 2)
            report = _fetch_report(args, transport)
            print(json.dumps(report, indent=2) if args.json else _format_report(report))
    except _Failure as failure:
        print(f"gpupool runs: {failure}", file=sys.stderr)
        return failure.code
    return 0


# --- sources ----------------------------------------------------------------------------------


def _read_ledger(args: argparse.Namespace, query: str) -> Any:
    if args.ledger is not None:
        path = Path(args.ledger)
    else:
        try:
            config = load_config(args.config)
        except ConfigError as err:
            raise _Failure(f"invalid config {err.source}: {'; '.join(err.problems)}", 2) from None
        if config.store.url is not None:
            return _read_shared_ledger(args, query, Stores.from_config(config))
        path = config.router.ledger_path
    try:
        conn = open_readonly(path)
    except LedgerError as err:
        raise _Failure(str(err), 2) from None
    try:
        if query == "show":
            return run_summary(conn, args.run_id, args.tenant)
        return top_runs_report(conn, top_n=args.top, tenant=args.tenant)
    finally:
        conn.close()


def _read_shared_ledger(args: argparse.Namespace, query: str, stores: Stores) -> Any:
    """The same queries on the PostgreSQL store the config names."""
    store = stores.ledger
    failures: tuple[type[Exception], ...] = (StoreError, *store.errors)
    try:
        store.open()
        try:
            with store.connection() as conn:
                if query == "show":
                    return run_summary(conn, args.run_id, args.tenant)
                return top_runs_report(conn, top_n=args.top, tenant=args.tenant)
        finally:
            store.close()
    except failures as err:
        raise _Failure(f"{store.name}: {err}", 1) from None


def _get_json(
    args: argparse.Namespace,
    path: str,
    params: dict[str, Any],
    transport: httpx.BaseTransport | None,
) -> Any:
    key = args.api_key or os.environ.get(API_KEY_ENV)
    headers = {"authorization": f"Bearer {key}"} if key else {}
    url = args.url.rstrip("/") + path
    try:
        with httpx.Client(transport=transport, timeout=HTTP_TIMEOUT_S) as client:
            response = client.get(url, params=params, headers=headers)
    except httpx.HTTPError as err:
        raise _Failure(f"cannot reach {args.url}: {err}", 1) from None
    if response.status_code == 404:
        return None
    if response.status_code in (401, 403):
        raise _Failure(f"{url}: the router refused the API key ({response.status_code})", 2)
    if response.status_code >= 400:
        raise _Failure(f"{url}: HTTP {response.status_code}: {response.text[:200]}", 1)
    try:
        return response.json()
    except ValueError:
        raise _Failure(f"{url}: the answer is not JSON", 1) from None


def _fetch_run(args: argparse.Namespace, transport: httpx.BaseTransport | None) -> Any:
    if args.url is None:
        return _read_ledger(args, "show")
    return _get_json(args, f"/v1/runs/{quote(args.run_id, safe='')}", {}, transport)


def _fetch_report(args: argparse.Namespace, transport: httpx.BaseTransport | None) -> Any:
    if args.url is None:
        return _read_ledger(args, "report")
    params: dict[str, Any] = {"top": args.top}
    if args.tenant is not None:
        params["tenant"] = args.tenant
    report = _get_json(args, "/admin/accounting", params, transport)
    if report is None:
        raise _Failure(f"{args.url} has no /admin/accounting", 1)
    return report


# --- text output ------------------------------------------------------------------------------


def _when(unix_s: float | None) -> str:
    if unix_s is None:
        return "-"
    return datetime.fromtimestamp(unix_s, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns of numbers are right-aligned, the rest left-aligned."""
    numeric = [
        all(isinstance(row[i], int | float) or row[i] is None for row in rows)
        for i in range(len(headers))
    ]
    cells = [list(headers)] + [[_num(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(
            c.rjust(w) if right else c.ljust(w)
            for c, w, right in zip(row, widths, numeric, strict=True)
        ).rstrip()
        for row in cells
    )


def _outcomes(outcomes: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())) or "none"


def _format_report(report: dict[str, Any]) -> str:
    led = report["ledger"]
    capacity = led["capacity_gpu_seconds"]
    used = f" ({led['gpu_seconds'] / capacity:.0%} of capacity)" if capacity > 0 else ""
    out = [
        f"requests {led['requests']} ({_outcomes(led['outcomes'])}), "
        f"{_when(led['first_seen_s'])} .. {_when(led['last_seen_s'])} UTC",
        f"GPU-seconds: attributed {led['gpu_seconds']:.2f}{used}, idle "
        f"{led['idle_gpu_seconds']:.2f}, capacity {capacity:.2f}",
        f"tokens: prompt {led['prompt_tokens']}, completion {led['completion_tokens']}",
    ]
    heads = ["requests", "runs", "gpu_s", "prompt_tok", "completion_tok"]
    for title, key in (("pool", "by_pool"), ("class", "by_class"), ("tenant", "by_tenant")):
        groups: dict[str, dict[str, Any]] = led[key]
        if not groups:
            continue
        extra = ["idle_gpu_s"] if key == "by_pool" else []
        rows = [
            [
                name,
                g["requests"],
                g["runs"],
                float(g["gpu_seconds"]),
                g["prompt_tokens"],
                g["completion_tokens"],
                *([float(g.get("idle_gpu_seconds", 0.0))] if extra else []),
            ]
            for name, g in groups.items()
        ]
        out += ["", _table([title, *heads, *extra], rows)]
    runs = report["top_runs"]
    out += ["", f"top {len(runs)} runs by GPU-seconds" if runs else "no runs recorded"]
    if runs:
        rows = [
            [
                r["run_id"],
                r["tenant"],
                r["requests"],
                r["errors"],
                float(r["gpu_seconds"]),
                float(r["wall_s"]),
                float(r["queue_s"]),
                _when(r["last_seen_s"]),
            ]
            for r in runs
        ]
        heads = ["run_id", "tenant", "requests", "errors", "gpu_s", "wall_s", "queue_s"]
        out.append(_table([*heads, "last_seen_utc"], rows))
    live = report.get("live")
    if live:
        out += [
            "",
            f"live (this router): capacity {live['capacity_gpu_seconds']:.2f} GPU-s = attributed "
            f"{live['attributed_gpu_seconds']:.2f} + idle {live['idle_gpu_seconds']:.2f} "
            f"(relative error {live['rel_error']:.1e}); {live['in_flight_sequences']} in flight",
        ]
    return "\n".join(out)


def _format_run(run: dict[str, Any]) -> str:
    if run.get("object") == "gpupool.session":  # `--url` with a session id: its runs
        head = [
            f"session {run['session_id']}: runs {', '.join(run['runs'])}",
            f"current run {run['current_run'] or '-'}",
            "",
        ]
        current = run.get("current")
        return "\n".join(head) + ("\n" + _format_run(current) if current else "")
    t = run["totals"]
    ttft, tpot = run["ttft_s"], run["tpot_s"]
    out = [
        f"run {run['run_id']}  tenant {', '.join(run['tenants'])}  class "
        f"{', '.join(run['classes'])}  pool {', '.join(run['pools'])}",
        f"requests {t['requests']} ({_outcomes(t['outcomes'])}); GPU-seconds "
        f"{t['gpu_seconds']:.3f}; wall {t['wall_s']:.2f} s; queued {t['queue_s']:.2f} s",
        f"tokens: prompt {t['prompt_tokens']}, completion {t['completion_tokens']}",
        f"ttft s: p50 {_num(ttft['p50'], 3)} p95 {_num(ttft['p95'], 3)} max {_num(ttft['max'], 3)}"
        f";  tpot ms: p50 {_ms(tpot['p50'])} p95 {_ms(tpot['p95'])} max {_ms(tpot['max'])}",
        f"{_when(run['first_seen_s'])} .. {_when(run['last_seen_s'])} UTC",
        "",
    ]
    rows = [
        [
            r["step_index"],
            r["request_id"],
            r["class_name"],
            r["instance"] or "-",
            _when(r["started_at_s"]),
            float(r["ended_at_s"] - r["started_at_s"]),
            float(r["queue_s"]),
            r["ttft_s"],
            None if r["tpot_s"] is None else r["tpot_s"] * 1e3,
            r["prompt_tokens"],
            r["completion_tokens"],
            float(r["gpu_seconds"]),
            r["outcome"],
        ]
        for r in run["requests"]
    ]
    heads = ["step", "request_id", "class", "instance", "started_utc", "dur_s", "queue_s"]
    heads += ["ttft_s", "tpot_ms", "prompt", "completion", "gpu_s", "outcome"]
    out.append(_table(heads, rows))
    return "\n".join(out)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"
