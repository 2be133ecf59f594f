"""What counting a run's active time adds to the statements that carry it (s46), timed alone.

The step's upsert (`NEXT_STEP_SQL`) and the sweep's counter update, as before migration 11
(their text at 1ae4417, copied below) and as now, against the tests' PostgreSQL server (its
own, started here, over its unix socket), prepared on one connection, autocommit, in turns
of `--block` statements, each statement on one of 50 runs. Prints p50/p90 per statement in
microseconds, per round and over all.

    PYTHONPATH=. .venv/bin/python \
        benchmarks/results/duration-replicas-2026-12-04-s46/duration_statement_cost.py
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from collections.abc import Callable

import psycopg

from router.governance.shared import _ADD_RUN_USAGE, NEXT_STEP_SQL, RunUsageRow
from router.governance.store import MIGRATIONS
from router.store import PostgresStore, migrate

OLD_NEXT_STEP_SQL = (
    "INSERT INTO run_steps (tenant, run_id, next_step, updated_at_s)"
    " VALUES (%s, %s, 1, %s) ON CONFLICT (tenant, run_id) DO UPDATE SET"
    " next_step = run_steps.next_step + 1, updated_at_s = excluded.updated_at_s"
    " RETURNING next_step, home, home_step, context_tokens, tokens, gpu_seconds, stop_code"
)
OLD_ADD_RUN_USAGE = (
    "UPDATE run_steps SET tokens = tokens + %s, gpu_seconds = gpu_seconds + %s"
    " WHERE tenant = %s AND run_id = %s"
)


def _pg(sql: str) -> str:
    return sql.replace("?", "%s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=2000)
    parser.add_argument("--block", type=int, default=100)
    args = parser.parse_args()
    pg = importlib.import_module("tests.postgres")  # test support, not the product
    password: str = pg.PASSWORD
    with pg.start_postgres() as server:
        url = server.create_database("duration_cost")
        store = PostgresStore(url, password=password)
        store.open()
        migrate(store, MIGRATIONS)
        store.close()
        with psycopg.connect(url, password=password, autocommit=True) as conn:
            n = iter(range(10**9))

            def run() -> str:
                return f"run-{next(n) % 50}"

            usage = RunUsageRow("t", "", 10, 0.5, age_s=0.2, span_s=3.0, idle_s=120.0)
            statements: dict[str, Callable[[], None]] = {
                "step upsert, before": lambda: _one(
                    conn, OLD_NEXT_STEP_SQL, ("t", run(), time.time())
                ),
                "step upsert, now": lambda: _one(
                    conn, _pg(NEXT_STEP_SQL), ("t", run(), time.time(), 3.0, 120.0)
                ),
                "sweep's usage update, before": lambda: _one(
                    conn, OLD_ADD_RUN_USAGE, (10, 0.5, "t", run()), rows=False
                ),
                "sweep's usage update, now": lambda: _one(
                    conn,
                    _pg(_ADD_RUN_USAGE["postgresql"]),
                    (*usage.params()[:-1], run()),
                    rows=False,
                ),
            }
            for fn in statements.values():  # warm: prepared, rows made
                for _ in range(200):
                    fn()
            times: dict[str, list[float]] = {k: [] for k in statements}
            for r in range(args.rounds):
                this: dict[str, list[float]] = {k: [] for k in statements}
                for _ in range(args.per_round // args.block):
                    for name, fn in statements.items():
                        for _ in range(args.block):
                            t0 = time.perf_counter()
                            fn()
                            this[name].append((time.perf_counter() - t0) * 1e6)
                medians = ", ".join(f"{k} {_p(v, 50):.0f}" for k, v in this.items())
                print(f"round {r + 1} p50 (us): {medians}", flush=True)
                for k, v in this.items():
                    times[k] += v
            print("all rounds (us): p50 / p90")
            for k, v in times.items():
                print(f"  {k}: {_p(v, 50):.0f} / {_p(v, 90):.0f}")


def _one(
    conn: psycopg.Connection[tuple[object, ...]],
    sql: str,
    params: tuple[object, ...],
    *,
    rows: bool = True,
) -> None:
    cur = conn.execute(sql, params, prepare=True)
    if rows:
        cur.fetchone()


def _p(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1]


if __name__ == "__main__":
    main()
