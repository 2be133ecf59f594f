"""Micro-benchmark: what a request waits on the store for, embedded SQLite against PostgreSQL,
side by side in one run.

The one store wait on a request's path is the durable ledger's commit (`Ledger.commit`, awaited
right before a response's final bytes with `router.ledger_durable: true`, the default);
governance and the rebalancer write in the background. At concurrency 1 every commit is its
own transaction, the worst case for a network database. The backends take turns in rounds
(SQLite, PostgreSQL, SQLite, ...), so both see the same machine load; the report gives each
backend's latency percentiles over all rounds and the spread of the per-round p50s.

    .venv/bin/python -m benchmarks.store_overhead --postgres-url URL [--password-env VAR]
        [--requests 2000] [--rounds 5] [--out benchmarks/results/store_overhead.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.accounting_overhead import bench_record
from router.accounting.ledger import Ledger, RequestRecord
from router.store import PostgresStore, SqliteStore, Store, redact


def _record(k: int, now_s: float) -> RequestRecord:
    """Step numbers given: the commit alone is measured, not the step look-up."""
    return bench_record(k, 0.5, now_s, step_index=k)


async def _round(store: Store, requests: int, first: int) -> list[float]:
    """Commit latencies (seconds) of `requests` records one after another (c=1)."""
    ledger = Ledger(store, flush_interval_s=3600.0)
    await ledger.start()
    try:
        for k in range(first, first + 50):  # warm up: connections, prepared statements
            await ledger.commit(_record(k, time.time()))
        latencies = []
        for k in range(first + 50, first + 50 + requests):
            record = _record(k, time.time())
            t0 = time.perf_counter()
            ok = await ledger.commit(record)
            latencies.append(time.perf_counter() - t0)
            if not ok:
                raise RuntimeError(f"a commit failed on {store.name}")
        return latencies
    finally:
        await ledger.aclose()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main_async(args: argparse.Namespace) -> str:
    password = os.environ.get(args.password_env) if args.password_env else None
    with tempfile.TemporaryDirectory() as tmp:
        stores: dict[str, Store] = {
            "sqlite": SqliteStore(Path(tmp) / "ledger.sqlite"),
            "postgresql": PostgresStore(args.postgres_url, password=password),
            "postgresql, synchronous_commit": PostgresStore(
                args.postgres_url, password=password, synchronous_commit=True
            ),
        }
        for store in stores.values():
            store.open()
        all_s: dict[str, list[float]] = {name: [] for name in stores}
        p50s_ms: dict[str, list[float]] = {name: [] for name in stores}
        try:
            for r in range(args.rounds):
                for name, store in stores.items():
                    lat = await _round(store, args.requests, first=r * (args.requests + 50))
                    all_s[name] += lat
                    p50s_ms[name].append(statistics.median(lat) * 1000)
        finally:
            for store in stores.values():
                store.close()
    lines = [
        "# Store overhead: the durable ledger commit per request, SQLite vs PostgreSQL",
        "",
        f"Command: `{shlex.join(['python', '-m', 'benchmarks.store_overhead', *sys.argv[1:]])}`",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()};"
        f" PostgreSQL at {redact(args.postgres_url)}.",
        f"{args.rounds} rounds x {args.requests} commits at concurrency 1 per backend, in turns.",
        "",
        "| backend | p50 ms | p90 ms | p99 ms | per-round p50 ms (min..max) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in all_s:
        lat = all_s[name]
        lines.append(
            f"| {name} | {statistics.median(lat) * 1000:.3f} | {_pct(lat, 0.9) * 1000:.3f} |"
            f" {_pct(lat, 0.99) * 1000:.3f} | {min(p50s_ms[name]):.3f}..{max(p50s_ms[name]):.3f} |"
        )
    lines.append("")
    for name in list(stores)[1:]:
        deltas = [p - s for p, s in zip(p50s_ms[name], p50s_ms["sqlite"], strict=True)]
        lines.append(
            f"Added p50 per request, {name} against sqlite: {statistics.median(deltas):.3f} ms"
            " (median of the rounds' differences; per round:"
            f" {', '.join(f'{d:.3f}' for d in deltas)})."
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--postgres-url", required=True, help="postgresql://user@host/db")
    parser.add_argument("--password-env", default=None, help="env var holding the password")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="also write the Markdown here")
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    print(report)
    if args.out is not None:
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
