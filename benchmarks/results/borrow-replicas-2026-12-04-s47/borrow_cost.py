"""What a borrow costs with a shared store, and what a lease top-up (the only budget statement
a request that does not borrow may send) costs before and after borrowing across replicas.

    python borrow_cost.py --before <checkout> --after <checkout> [--rounds 4] [--calls 300]

starts one PostgreSQL server (tests/postgres.py: unix socket, fsync off) and, per round, runs
a child process per checkout (PYTHONPATH=<checkout>, the order swapped every round) on a fresh
database. Each child times `SharedBudgets` calls as the router's worker thread makes them (a
pooled connection each): `topup` (`reserve_up_to` granted: the statement of a request whose
lease needs filling), `refused` (`reserve_up_to` that finds the bucket short: what a borrowing
request sends first) and, where the checkout has it, `borrow` (`SharedBudgets.borrow`
granted, with 3 lenders). Prints one JSON line per child and a table of medians per round.
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


def child(url: str, calls: int) -> dict[str, Any]:
    from router.governance.shared import SharedBudgets
    from router.governance.store import MIGRATIONS
    from router.store import PostgresStore, migrate
    from tests.postgres import PASSWORD

    store = PostgresStore(url, password=PASSWORD)
    store.open()
    try:
        migrate(store, MIGRATIONS)
        db = SharedBudgets(store)
        out: dict[str, Any] = {}

        def timed(name: str, call: Any) -> None:
            for _ in range(20):  # warm the pool and the plans
                call()
            samples = []
            for _ in range(calls):
                started = time.perf_counter()
                call()
                samples.append((time.perf_counter() - started) * 1e6)
                time.sleep(0.001)  # 1 ms idle before each, as a request's
            samples.sort()
            out[name] = {
                "p50_us": round(statistics.median(samples), 1),
                "p10_us": round(samples[len(samples) // 10], 1),
                "p90_us": round(samples[len(samples) * 9 // 10], 1),
            }

        now = time.time()
        timed(
            "topup",
            lambda: db.reserve_up_to("q", "tokens", 1, 1, now, capacity=HUGE, rate_per_s=HUGE),
        )
        db.reserve("x", "tokens", 60, now, capacity=60, rate_per_s=1e-9)  # x holds nothing
        timed(
            "refused",
            lambda: db.reserve_up_to("x", "tokens", 1, 3, now, capacity=60, rate_per_s=1e-9),
        )
        if hasattr(db, "borrow"):
            from router.governance.borrowing import Terms

            lenders = (("x", 60.0, 1e-9), ("l1", HUGE, HUGE), ("l2", HUGE, HUGE), ("l3", 100, 1))
            terms = Terms(60, 1e-9, HUGE, HUGE, lenders, idle_after_s=3.0)
            timed("borrow", lambda: db.borrow("x", 1, 0.0, now, terms))
        return out
    finally:
        store.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path)
    parser.add_argument("--after", type=Path)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--child-url")
    args = parser.parse_args()
    if args.child_url:
        print(json.dumps(child(args.child_url, args.calls)))
        return
    from tests.postgres import start_postgres

    rows = []
    with start_postgres() as server:
        for r in range(args.rounds):
            sides = [("before", args.before), ("after", args.after)]
            for name, checkout in sides if r % 2 == 0 else sides[::-1]:
                url = server.create_database(f"borrow_cost_{r}_{name}")
                env = {**os.environ, "PYTHONPATH": str(checkout)}
                done = subprocess.run(
                    [sys.executable, __file__, "--child-url", url, "--calls", str(args.calls)],
                    env=env,
                    cwd=checkout,
                    check=True,
                    capture_output=True,
                    text=True,
                )
                result = json.loads(done.stdout.strip().splitlines()[-1])
                print(json.dumps({"round": r, "side": name, **result}), flush=True)
                rows.append((r, name, result))
    print("\nround side    topup p50 (p10-p90)   refused p50   borrow p50 (p10-p90)")
    for r, name, res in rows:
        cells = []
        for what in ("topup", "refused", "borrow"):
            got = res.get(what)
            cells.append(
                "-" if got is None else f"{got['p50_us']} ({got['p10_us']}-{got['p90_us']})"
            )
        print(f"{r:5} {name:7} " + "   ".join(cells))


if __name__ == "__main__":
    main()
