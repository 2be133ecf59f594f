"""Read-side queries over the ledger file: one run, a tenant's runs, totals and top runs.

Sync functions over a store connection (either backend; router/store) or a `sqlite3.Connection`:
the CLI calls them on the file directly, `Ledger` through a worker thread (after writing its
buffer, so the latest requests are visible). The SQL is the store's portable dialect. All
return JSON-ready dicts; shapes in docs/accounting.md.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from router.accounting.accountant import ConservationReport
from router.store import Conn, Rows

__all__ = [
    "HOUR_S",
    "JsonDict",
    "RunOrder",
    "list_runs",
    "run_summary",
    "top_runs_report",
    "totals",
]

JsonDict = dict[str, Any]
Db = Conn | sqlite3.Connection  # a store's connection, or the CLI's read-only file
RunOrder = Literal["last_seen", "gpu_seconds"]
HOUR_S = 3600  # idle and capacity are kept in hourly rows


def _dicts(cur: Rows | sqlite3.Cursor) -> list[JsonDict]:
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row, strict=True)) for row in cur]


def _sum_int(column: str) -> str:
    """SUM of an integer column as an integer on both backends (PostgreSQL's is NUMERIC)."""
    return f"CAST(SUM({column}) AS BIGINT) AS {column}"


def _total(column: str) -> str:
    """SQLite's TOTAL: a float sum, 0.0 over no rows."""
    return f"COALESCE(SUM({column}), 0.0) AS {column}"


_ROLLUP_KEYS = ("requests", "runs", "prompt_tokens", "completion_tokens", "gpu_seconds")


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 1]."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _distribution(values: Iterable[float | None]) -> JsonDict:
    present = sorted(v for v in values if v is not None)
    if not present:
        return {"count": 0, "p50": None, "p95": None, "max": None}
    return {
        "count": len(present),
        "p50": _percentile(present, 0.5),
        "p95": _percentile(present, 0.95),
        "max": present[-1],
    }


def run_summary(conn: Db, run_id: str, tenant: str | None) -> JsonDict | None:
    """One run: totals, TTFT/TPOT distributions and every request, in step order.

    `tenant` scopes the answer: None when that tenant has no request in the run (so a run id
    of another tenant looks like an unknown one). `tenant=None` (admin, CLI) sees all tenants.
    """
    where = "run_id = ?" + ("" if tenant is None else " AND tenant = ?")
    params: tuple[str, ...] = (run_id,) if tenant is None else (run_id, tenant)
    cur = conn.execute(
        f"SELECT * FROM requests WHERE {where} "
        "ORDER BY step_index IS NULL, step_index, started_at_s",
        params,
    )
    requests = _dicts(cur)
    if not requests:
        return None
    first_s = min(r["started_at_s"] for r in requests)
    last_s = max(r["ended_at_s"] for r in requests)
    outcomes: dict[str, int] = {}
    for r in requests:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    return {
        "object": "gpupool.run",
        "run_id": run_id,
        "tenants": sorted({r["tenant"] for r in requests}),
        "classes": sorted({r["class_name"] for r in requests}),
        "pools": sorted({r["pool"] for r in requests}),
        "first_seen_s": first_s,
        "last_seen_s": last_s,
        "totals": {
            "requests": len(requests),
            "outcomes": outcomes,
            "prompt_tokens": sum(r["prompt_tokens"] for r in requests),
            "completion_tokens": sum(r["completion_tokens"] for r in requests),
            "gpu_seconds": math.fsum(r["gpu_seconds"] for r in requests),
            "wall_s": last_s - first_s,
            **_time_split(requests, last_s - first_s),
        },
        "ttft_s": _distribution(r["ttft_s"] for r in requests),
        "tpot_s": _distribution(r["tpot_s"] for r in requests),
        "end": _run_end(conn, run_id, tenant),
        "requests": requests,
    }


def _run_end(conn: Db, run_id: str, tenant: str | None) -> JsonDict | None:
    """How the run last ended (governance: client_end, idle_timeout, or the run guard's
    code), or None while it has not ended; files older than the run_ends table have none."""
    where = "run_id = ?" + ("" if tenant is None else " AND tenant = ?")
    params: tuple[str, ...] = (run_id,) if tenant is None else (run_id, tenant)
    try:
        cur = conn.execute(
            "SELECT reason, ended_at_s, steps, tokens, gpu_seconds FROM run_ends"
            f" WHERE {where} ORDER BY ended_at_s DESC LIMIT 1",
            params,
        )
    except sqlite3.OperationalError:  # a read-only file written before the table existed
        return None
    rows = _dicts(cur)
    return rows[0] if rows else None


def _time_split(requests: Sequence[JsonDict], wall_s: float) -> JsonDict:
    """Where a run's wall time went: `queue_s` (its steps waiting in the router's queue),
    `exec_s` (its steps from dispatch to their last byte) and `between_steps_s` (no step of
    it at the router: tool calls and the client's own time, seen as gaps). Queue and exec are
    sums over steps; for a run whose steps do not overlap the three add up to `wall_s`."""
    queue_s = math.fsum(r["queue_s"] for r in requests)
    exec_s = math.fsum(
        max(0.0, r["ended_at_s"] - r["started_at_s"] - r["queue_s"]) for r in requests
    )
    spans = sorted((r["started_at_s"], r["ended_at_s"]) for r in requests)
    busy_s = 0.0  # the union of the steps' [arrival, last byte] spans
    span_start, span_end = spans[0]
    for start, end in spans[1:]:
        if start > span_end:
            busy_s += span_end - span_start
            span_start, span_end = start, end
        else:
            span_end = max(span_end, end)
    busy_s += span_end - span_start
    return {
        "queue_s": queue_s,
        "exec_s": exec_s,
        "between_steps_s": max(0.0, wall_s - busy_s),
    }


def list_runs(
    conn: Db,
    tenant: str | None,
    *,
    since_s: float | None = None,
    limit: int = 50,
    class_name: str | None = None,
    order_by: RunOrder = "last_seen",
) -> list[JsonDict]:
    """Runs (one per tenant and run id) with their totals, newest first or costliest first.

    `since_s`: only runs with a request ending at or after it (their totals stay whole);
    `class_name`: only runs with at least one request of that class; `tenant=None`: all.
    """
    if limit <= 0:
        return []
    where = ["run_id IS NOT NULL"]
    params: list[Any] = []
    if tenant is not None:
        where.append("tenant = ?")
        params.append(tenant)
    having = ["1 = 1"]
    if since_s is not None:
        having.append("MAX(ended_at_s) >= ?")
        params.append(since_s)
    if class_name is not None:
        having.append("SUM(CASE WHEN class_name = ? THEN 1 ELSE 0 END) > 0")
        params.append(class_name)
    order = "gpu_seconds DESC" if order_by == "gpu_seconds" else "last_seen_s DESC"
    params.append(limit)
    cur = conn.execute(
        "SELECT run_id, tenant, COUNT(*) AS requests,"
        " CAST(SUM(CASE WHEN outcome <> 'ok' THEN 1 ELSE 0 END) AS BIGINT) AS errors,"
        f" {_sum_int('prompt_tokens')}, {_sum_int('completion_tokens')},"
        f" {_total('gpu_seconds')}, {_total('queue_s')},"
        " MIN(started_at_s) AS first_seen_s, MAX(ended_at_s) AS last_seen_s,"
        " MAX(ended_at_s) - MIN(started_at_s) AS wall_s "
        f"FROM requests WHERE {' AND '.join(where)} GROUP BY run_id, tenant "
        f"HAVING {' AND '.join(having)} ORDER BY {order}, run_id LIMIT ?",
        params,
    )
    runs = _dicts(cur)
    if runs:  # each run's classes (no GROUP_CONCAT that both backends speak)
        classes: dict[tuple[str, str], list[str]] = {(r["run_id"], r["tenant"]): [] for r in runs}
        ids = sorted({r["run_id"] for r in runs})
        for run_id, run_tenant, class_name in conn.execute(
            "SELECT DISTINCT run_id, tenant, class_name FROM requests"
            f" WHERE run_id IN ({', '.join('?' for _ in ids)})",
            ids,
        ):
            if (run_id, run_tenant) in classes:
                classes[(run_id, run_tenant)].append(class_name)
        for run in runs:
            run["classes"] = sorted(classes[(run["run_id"], run["tenant"])])
    return runs


def _rollup(conn: Db, column: str, since_s: float) -> dict[str, JsonDict]:
    cur = conn.execute(
        f"SELECT {column} AS key, COUNT(*) AS requests, COUNT(DISTINCT run_id) AS runs,"
        f" {_sum_int('prompt_tokens')}, {_sum_int('completion_tokens')}, {_total('gpu_seconds')} "
        f"FROM requests WHERE ended_at_s >= ? GROUP BY {column} ORDER BY {column}",
        (since_s,),
    )
    return {row.pop("key"): row for row in _dicts(cur)}


def totals(conn: Db, since_s: float | None = None) -> JsonDict:
    """Everything in the ledger (or since `since_s`): requests, tokens and GPU-seconds per
    pool, class and tenant; idle GPU-seconds per pool and fleet capacity (hourly buckets, so
    `since_s` is rounded down to the hour for those)."""
    since = -math.inf if since_s is None else since_s
    hour = -(2**62) if since_s is None else math.floor(since_s / HOUR_S) * HOUR_S
    n, prompt, completion, gpu_s, first_s, last_s = conn.execute(
        "SELECT COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0),"
        " COALESCE(SUM(gpu_seconds), 0.0), MIN(started_at_s), MAX(ended_at_s) FROM requests"
        " WHERE ended_at_s >= ?",
        (since,),
    ).fetchone()
    outcomes = dict(
        conn.execute(
            "SELECT outcome, COUNT(*) FROM requests WHERE ended_at_s >= ? GROUP BY outcome",
            (since,),
        ).fetchall()
    )
    idle = dict(
        conn.execute(
            "SELECT pool, COALESCE(SUM(idle_gpu_seconds), 0.0) FROM idle_hourly"
            " WHERE hour_start_s >= ? "
            "GROUP BY pool ORDER BY pool",
            (hour,),
        ).fetchall()
    )
    (capacity,) = conn.execute(
        "SELECT COALESCE(SUM(capacity_gpu_seconds), 0.0) FROM capacity_hourly"
        " WHERE hour_start_s >= ?",
        (hour,),
    ).fetchone()
    by_pool = _rollup(conn, "pool", since)
    for pool in set(by_pool) | set(idle):
        entry = by_pool.setdefault(
            pool,
            {
                "requests": 0,
                "runs": 0,
                "prompt_tokens": 0,
                "completion_tokens": 0,
                "gpu_seconds": 0.0,
            },
        )
        entry["idle_gpu_seconds"] = idle.get(pool, 0.0)
    return {
        "object": "gpupool.accounting_totals",
        "since_s": since_s,
        "first_seen_s": first_s,
        "last_seen_s": last_s,
        "requests": n,
        "outcomes": outcomes,
        "prompt_tokens": int(prompt),
        "completion_tokens": int(completion),
        "gpu_seconds": gpu_s,
        "idle_gpu_seconds": math.fsum(idle.values()),
        "capacity_gpu_seconds": capacity,
        "by_pool": dict(sorted(by_pool.items())),
        "by_class": _rollup(conn, "class_name", since),
        "by_tenant": _rollup(conn, "tenant", since),
    }


def top_runs_report(
    conn: Db,
    *,
    top_n: int = 10,
    tenant: str | None = None,
    since_s: float | None = None,
    live: ConservationReport | None = None,
) -> JsonDict:
    """The body of `GET /admin/accounting`: ledger totals, the `top_n` costliest runs, and
    (from the router's accountant) the live conservation report of this process."""
    return {
        "object": "gpupool.accounting",
        "ledger": totals(conn, since_s),
        "top_runs": list_runs(conn, tenant, since_s=since_s, limit=top_n, order_by="gpu_seconds"),
        "live": None if live is None else live.as_dict(),
    }


# ---------------------------------------------------------------------------------------------
# The component
# ---------------------------------------------------------------------------------------------
