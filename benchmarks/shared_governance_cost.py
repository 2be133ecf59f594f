"""Micro-benchmark: what shared governance (store.url set) costs per database call, one call at
a time on one connection pool (router/governance/shared.py).

On a request's path: a lease top-up (`reserve_up_to`, about one request in
`chunk / estimate`), a request slot (`acquire_slot` then `release_slot`, for a tenant with a
tier), a run step's number (`next_step`, per agent step). In the background: one sweep's
writes (`settle_many`, `renew_slots`, `publish_windows`, every second per replica), and
admission's exchange of KV and batch reservations (router/admission/shared_reservations.py,
every `store.admission_interval_s` per replica: publish this replica's and read two other
replicas' rows over four engines, or only read when unchanged).

    .venv/bin/python -m benchmarks.shared_governance_cost --postgres-url URL
        [--password-env VAR] [--calls 2000]

Use a database of its own: the benchmark migrates it and leaves its rows there.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

from router.admission.shared_reservations import ReservationsTable
from router.governance.shared import SharedBudgets
from router.governance.store import MIGRATIONS
from router.store import PostgresStore, migrate, redact


def _timed(call: Callable[[int], object], calls: int) -> str:
    took_ms = []
    for i in range(calls):
        started = time.perf_counter()
        call(i)
        took_ms.append((time.perf_counter() - started) * 1e3)
    took_ms.sort()
    return f"p50 {took_ms[calls // 2]:.3f} ms, p99 {took_ms[int(calls * 0.99)]:.3f} ms"


def run(db: SharedBudgets, calls: int) -> list[tuple[str, str]]:
    now_s = time.time()
    table = ReservationsTable(db.store)
    mine = {f"engine-{i}": {"agent": (40, 6, 12), "normal": (20, 8, 9)} for i in range(4)}
    for other in ("other-1", "other-2"):
        table.exchange(other, mine, 3.0)

    def slot(i: int) -> None:
        db.acquire_slot("t/requests", f"r:{i}", 1000, now_s, lease_s=30)
        db.release_slot("t/requests", f"r:{i}")

    def sweep(_: int) -> None:
        db.settle_many([("t", "tokens", 5.0)])
        db.renew_slots("r:", now_s, 30)
        db.publish_windows("r", now_s, [("t", [(now_s, 1.0)], [(now_s, 1.0)])])

    return [
        (
            "lease top-up (reserve_up_to)",
            _timed(
                lambda _: db.reserve_up_to(
                    "t", "tokens", 10, 500, now_s, capacity=1e12, rate_per_s=1e9
                ),
                calls,
            ),
        ),
        ("request slot (acquire_slot + release_slot)", _timed(slot, calls)),
        (
            "run step number (next_step)",
            _timed(lambda i: db.next_step("t", f"run{i % 50}", now_s), calls),
        ),
        (
            "run home (record_home)",
            _timed(lambda i: db.record_home("t", f"run{i % 50}", "engine-0", i, 100), calls),
        ),
        ("sweep (settle_many + renew_slots + publish_windows)", _timed(sweep, max(1, calls // 4))),
        (
            "admission exchange, publish + read (ReservationsTable.exchange)",
            _timed(lambda _: table.exchange("me", mine, 3.0), calls),
        ),
        (
            "admission exchange, read only (unchanged)",
            _timed(lambda _: table.exchange("me", None, 3.0), calls),
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--postgres-url", required=True, help="postgresql://user@host/db")
    parser.add_argument("--password-env", default=None, help="env var holding the password")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    password = os.environ[args.password_env] if args.password_env else None
    store = PostgresStore(args.postgres_url, password=password)
    store.open()
    try:
        migrate(store, MIGRATIONS)
        rows = run(SharedBudgets(store), args.calls)
    finally:
        store.close()
    load = os.getloadavg()[0]
    print(f"{redact(args.postgres_url)}, {args.calls} calls each, load {load:.1f}")
    for what, result in rows:
        print(f"  {what}: {result}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
