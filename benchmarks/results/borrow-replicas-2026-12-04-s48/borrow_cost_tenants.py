"""What one borrow costs with a shared store as the tenant count grows (s48; s47's
borrow_cost.py, extended).

    python borrow_cost_tenants.py --tree NAME=<checkout> [--tree ...] [--tenants 3,300,1000]
        [--rounds 3] [--calls 300]

starts one PostgreSQL server (tests/postgres.py: unix socket, fsync off) and, per round, runs
a child process per checkout (PYTHONPATH=<checkout>; the order rotated every round) on a fresh
database. A child times `SharedBudgets.borrow` granted, as the router's worker thread calls it
(a pooled connection each, 1 ms idle before each, 20 warm-up calls), for each tenant count N
in ascending order: N=3 is s47's case (3 lenders, their rows made by the first borrows);
N >= 4 has N tenants' `tokens` rows in `budget_buckets` (all idle, full, lendable) and passes
all of them as lenders, as a router configured with N budgeted tenants does (the governor
passes every tenant with a token budget that has no request here). Each call borrows 1 token
(the borrower's own bucket is empty), so the lender with the most to lend changes from call to
call. Prints one JSON line per child and a table of p50 (p10-p90) per round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HUGE = 1e12


def child(url: str, calls: int, counts: list[int], equal: bool = False) -> dict[str, Any]:
    from router.governance.borrowing import Terms
    from router.governance.shared import SharedBudgets
    from router.governance.store import MIGRATIONS
    from router.store import PostgresStore, migrate
    from tests.postgres import PASSWORD

    out: dict[str, Any] = {}
    store, now = PostgresStore(url, password=PASSWORD), time.time()
    store.open()
    try:
        db = SharedBudgets(store)
        migrate(store, MIGRATIONS)
        db.reserve("x", "tokens", 60, now, capacity=60, rate_per_s=1e-9)  # x holds nothing

        def timed(call: Any) -> dict[str, float]:
            for _ in range(20):  # warm the pool and the plans
                call()
            samples = []
            for _ in range(calls):
                started = time.perf_counter()
                assert call() is not None, "the borrow was refused"
                samples.append((time.perf_counter() - started) * 1e6)
                time.sleep(0.001)  # 1 ms idle before each, as a request's
            samples.sort()
            return {
                "p50_us": round(statistics.median(samples), 1),
                "p10_us": round(samples[len(samples) // 10], 1),
                "p90_us": round(samples[len(samples) * 9 // 10], 1),
            }

        made = 0
        for n in counts:
            if n <= 3:  # s47's case
                lenders: tuple[tuple[str, float, float], ...] = (
                    ("x", 60.0, 1e-9),
                    ("l1", HUGE, HUGE),
                    ("l2", HUGE, HUGE),
                    ("l3", 100, 1),
                )
            else:
                names = [f"t{i:05d}" for i in range(n)]
                # capacities differ, so the lender with the most to lend is one of them; the
                # rates are ~0: a lender lent from falls behind the next
                lenders = tuple(
                    (name, 1e6 + (0 if equal else i), 1e-6) for i, name in enumerate(names)
                )
                with store.connection() as conn, conn.transaction():
                    conn.executemany(
                        "INSERT INTO budget_buckets (tenant, bucket, level, capacity,"
                        " rate_per_s, updated_at_s) VALUES (?, 'tokens', ?, ?, ?, ?)",
                        [(name, c, c, r, now) for name, c, r in lenders[made:]],
                    )
                made = n
                lenders = (("x", 60.0, 1e-9), *lenders)
            terms = Terms(60, 1e-9, HUGE, HUGE, lenders, idle_after_s=3.0)
            out[str(n)] = timed(lambda terms=terms: db.borrow("x", 1, 0.0, now, terms))
            with store.connection() as conn:  # the table's rows after the calls
                rows = conn.execute("SELECT count(*) FROM budget_buckets").fetchone()
            out[str(n)]["rows"] = int(rows[0])
        return out
    finally:
        store.close()


def _run_child(checkout: Path, url: str, calls: int, tenants: str, equal: bool) -> dict[str, Any]:
    """One child's JSON answer (the last line it prints), run on `checkout`'s code."""
    command = [sys.executable, __file__, "--child-url", url, "--calls", str(calls)]
    command += ["--equal"] if equal else []
    answer = subprocess.check_output(
        [*command, "--tenants", tenants],
        env={**os.environ, "PYTHONPATH": str(checkout)},
        cwd=checkout,
        text=True,
    )
    parsed: dict[str, Any] = json.loads(answer.strip().splitlines()[-1])
    return parsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tree", action="append", default=[], help="NAME=<checkout>")
    parser.add_argument("--tenants", default="3,300,1000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--equal", action="store_true", help="every lender's bucket alike")
    parser.add_argument("--child-url")
    args = parser.parse_args()
    counts = sorted(int(n) for n in args.tenants.split(","))
    if args.child_url:
        print(json.dumps(child(args.child_url, args.calls, counts, args.equal)))
        return
    trees = [(t.partition("=")[0], Path(t.partition("=")[2])) for t in args.tree]
    if not trees:
        parser.error("give at least one --tree NAME=<checkout>")
    from tests.postgres import start_postgres

    rows = []
    with start_postgres() as server:
        for r in range(args.rounds):
            order = trees[r % len(trees) :] + trees[: r % len(trees)]
            for name, checkout in order:
                url = server.create_database(f"borrow_cost_{r}_{name}")
                result = _run_child(checkout, url, args.calls, args.tenants, args.equal)
                print(json.dumps({"round": r, "side": name, **result}), flush=True)
                rows.append((r, name, result))
    print("\nround side     " + "   ".join(f"N={n} p50 (p10-p90)" for n in counts))
    for r, name, res in rows:
        cells = []
        for n in counts:
            got = res[str(n)]
            cells.append(f"{got['p50_us']} ({got['p10_us']}-{got['p90_us']})")
        print(f"{r:5} {name:8} " + "   ".join(cells))


if __name__ == "__main__":
    main()
