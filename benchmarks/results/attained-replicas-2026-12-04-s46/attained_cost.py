"""The cost of sharing run_las's attained service across replicas (router/admission/
shared_attained.py), timed on a real PostgreSQL (README.md beside this file): one admission
exchange (the worker thread's statements) with and without the attained rows, for K runs
changed since the last tick, on the writing and the reading replica; and the event loop's
side (the scan of the run table, absorbing the rows, one run's lookup). Run from a
checkout's root with PYTHONPATH set to it:

    PYTHONPATH=. .venv/bin/python \
        benchmarks/results/attained-replicas-2026-12-04-s46/attained_cost.py
"""

from __future__ import annotations

import importlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from router.accounting.accountant import Accountant
from router.admission.shared_attained import SharedAttained
from router.admission.shared_reservations import SharedReservations, snapshot
from router.governance.store import MIGRATIONS
from router.runtable import RunTable
from router.store import migrate

# the tests' helpers (a real PostgreSQL, a replica's admitter and exchange), imported by name
# so the type check of benchmarks/ does not walk into tests/
pg: Any = importlib.import_module("tests.postgres")
conftest: Any = importlib.import_module("tests.unit.conftest")  # a store on a fresh database
rig: Any = importlib.import_module("tests.unit.test_run_las_replicas")

ROUNDS, N = 3, 40


def _ms(samples: list[float]) -> str:
    samples.sort()
    return f"{samples[len(samples) // 2]:.3f}/{samples[len(samples) * 95 // 100]:.3f}"


def _rounds(fn: Callable[[], float]) -> str:
    """p50/p95 ms of `fn`'s own timings, per round."""
    return "; ".join(_ms([fn() for _ in range(N)]) for _ in range(ROUNDS))


def _exchange(shared: SharedReservations, clock: Any, changed: Callable[[], None]) -> float:
    """One tick's statements (as the worker thread runs them), timed; `changed` first."""
    changed()
    clock.now += 0.1
    attained = shared.attained
    mine = snapshot(shared.fleet)
    version, shares = attained.changes(clock.now) if attained is not None else (0, [])
    start = time.perf_counter()
    others, read = shared._exchange(mine, version, shares, False)
    took = (time.perf_counter() - start) * 1e3
    if attained is not None and read is not None:
        attained.published(shares)
        attained.absorb(read[0], others, clock.now)
    return took


def main(store: Any, tmp: Path) -> None:
    migrate(store, MIGRATIONS)
    clock = rig.Clock()
    writer = rig.Replica(tmp, store, "w", clock)
    reader = rig.Replica(tmp, store, "r", clock)
    plain = SharedReservations(store, writer.core.fleet, "p", clock=clock)  # no run_las
    _exchange(writer.shared, clock, lambda: None)  # the migration, the first reads
    _exchange(reader.shared, clock, lambda: None)
    print(
        "| K runs changed a tick | reservations only | writer (K rows written) | reader (K read) |"
    )
    print("| --- | --- | --- | --- |")
    for k in (0, 1, 10, 100, 1000):

        def steps(k: int = k) -> None:  # a step of each of K runs began and ended
            for i in range(k):
                writer.serve(f"k{k}-{i % max(k, 1)}", clock.now, clock.now + 0.05)

        base = _rounds(lambda: _exchange(plain, clock, lambda: None))
        w_samples, r_samples = [], []
        for _ in range(ROUNDS):
            ws, rs = [], []
            for _ in range(N):
                ws.append(_exchange(writer.shared, clock, steps))
                rs.append(_exchange(reader.shared, clock, lambda: None))
            w_samples.append(_ms(ws))
            r_samples.append(_ms(rs))
        print(f"| {k} | {base} | {'; '.join(w_samples)} | {'; '.join(r_samples)} |")
    assert reader.attained.peer_runs() > 1000, reader.attained.peer_runs()

    # the event loop's side: a tick's scan of a full run table (100,000 runs) with nothing
    # touched since the last, and with 1,000 runs touched (none changed); one run's lookup
    # (what a queued step adds)
    runs = RunTable()
    acc = Accountant(runs=runs)
    acc.add_instance("e", 1.0, {"normal": 1.0}, 0.0)
    for i in range(100_000):
        acc.end(acc.begin("e", float(i), ("t", f"r{i}")), float(i) + 0.5)
    side = SharedAttained(runs, "postgresql", max_rows_per_tick=100_000, max_scan_runs=100_000)
    side.published(side.changes(200_000.0)[1])  # all written

    def scan(touch: int) -> float:
        for i in range(touch):
            runs.touch(("t", f"r{i}"))
        start = time.perf_counter()
        assert side.changes(200_000.0)[1] == []
        return (time.perf_counter() - start) * 1e3

    print()
    print(f"scan, nothing touched, ms p50/p95: {_rounds(lambda: scan(0))}")
    print(f"scan, 1,000 runs touched, ms p50/p95: {_rounds(lambda: scan(1000))}")
    own = writer.accountant.run_usage(("t", "k1000-5"), clock.now)

    def lookup() -> float:
        start = time.perf_counter()
        for _ in range(1000):
            reader.attained.with_peers(("t", "k1000-5"), own)
        return (time.perf_counter() - start) * 1e3  # ms per 1000 = us per call

    print(f"with_peers, one run, us per call p50/p95: {_rounds(lookup)}")
    print(f"load average: {os.getloadavg()}")


if __name__ == "__main__":
    with pg.start_postgres() as server, tempfile.TemporaryDirectory() as tmp:
        store = conftest.fresh_postgres_store(server)
        store.open()
        try:
            main(store, Path(tmp))
        finally:
            store.close()
