"""Governance state on disk, so a restart (even `kill -9`) does not reset budgets to full or
forget stopped runs: one SQLite file (WAL) next to the ledger, `governance.sqlite`.

What is saved: per tenant its buckets' levels (tokens, requests, borrowing allowance; a
running request's reservation is already out of the level, so it counts as spent) and its
cost windows' slices; per run its counters, limits, stop and end. Times are unix seconds on
disk; the governor converts them to and from its monotonic clock. `save` replaces the tenants'
rows and upserts the runs given (the ones changed since the last save); it runs in a worker
thread every `governance` sweep (1 s), so a hard kill loses at most that much.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["GovernanceStore", "RunRow", "TenantRow"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (
    tenant TEXT PRIMARY KEY,
    saved_at_s REAL NOT NULL,
    tokens_level REAL,
    requests_level REAL,
    allowance_level REAL,
    hour_slices TEXT NOT NULL,
    day_slices TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS runs (
    tenant TEXT NOT NULL,
    run_id TEXT NOT NULL,
    started_at_s REAL NOT NULL,
    last_seen_s REAL NOT NULL,
    limits TEXT NOT NULL,
    steps INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    gpu_seconds REAL NOT NULL,
    stop_code TEXT,
    stop_message TEXT,
    ended TEXT,
    PRIMARY KEY (tenant, run_id)
);
"""


@dataclass(frozen=True, slots=True)
class TenantRow:
    tenant: str
    saved_at_s: float  # unix seconds
    tokens_level: float | None
    requests_level: float | None
    allowance_level: float | None
    hour_slices: Sequence[tuple[float, float]]  # (unix start, GPU-seconds)
    day_slices: Sequence[tuple[float, float]]


@dataclass(frozen=True, slots=True)
class RunRow:
    tenant: str
    run_id: str
    started_at_s: float  # unix seconds
    last_seen_s: float
    limits: dict[str, float | int | None]
    steps: int
    tokens: int
    gpu_seconds: float
    stop_code: str | None
    stop_message: str | None
    ended: str | None


class GovernanceStore:
    """Sync; call it through `asyncio.to_thread`. One connection, used by one thread at a
    time (the governor never overlaps two calls)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = None

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.executescript(_SCHEMA)
        self._conn = conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def load(self) -> tuple[list[TenantRow], list[RunRow]]:
        conn = self._need()
        tenants = [
            TenantRow(t, at, tl, rl, al, _slices(h), _slices(d))
            for t, at, tl, rl, al, h, d in conn.execute("SELECT * FROM tenants")
        ]
        runs = [
            RunRow(t, r, s, ls, json.loads(lim), st, tok, g, sc, sm, e)
            for t, r, s, ls, lim, st, tok, g, sc, sm, e in conn.execute("SELECT * FROM runs")
        ]
        return tenants, runs

    def save(self, tenants: Sequence[TenantRow], runs: Sequence[RunRow]) -> None:
        conn = self._need()
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany(
                "INSERT OR REPLACE INTO tenants VALUES (?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        t.tenant,
                        t.saved_at_s,
                        t.tokens_level,
                        t.requests_level,
                        t.allowance_level,
                        json.dumps(list(t.hour_slices)),
                        json.dumps(list(t.day_slices)),
                    )
                    for t in tenants
                ],
            )
            conn.executemany(
                "INSERT OR REPLACE INTO runs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        r.tenant,
                        r.run_id,
                        r.started_at_s,
                        r.last_seen_s,
                        json.dumps(r.limits),
                        r.steps,
                        r.tokens,
                        r.gpu_seconds,
                        r.stop_code,
                        r.stop_message,
                        r.ended,
                    )
                    for r in runs
                ],
            )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def forget_runs_before(self, unix_s: float) -> None:
        """Delete runs last seen before `unix_s` (the governor forgets them too)."""
        self._need().execute("DELETE FROM runs WHERE last_seen_s < ?", (unix_s,))

    def _need(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError("governance store not open")
        return self._conn


def _slices(raw: str) -> list[tuple[float, float]]:
    return [(float(t), float(a)) for t, a in json.loads(raw)]
