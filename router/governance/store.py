"""Governance state on disk, so a restart (even `kill -9`) does not reset budgets to full or
forget stopped runs: one SQLite file (WAL) next to the ledger, `governance.sqlite`.

What is saved: per tenant its buckets' levels (tokens, requests, borrowing allowance; a
running request's reservation is already out of the level, so it counts as spent) and its
cost windows' slices; per run its counters, limits, stop and end; per session its run
numbering (so a session's next task never reuses a run id after a restart). Times are unix
seconds on disk; the governor converts them to and from its monotonic clock. `save` replaces
the tenants' rows and upserts the runs and sessions given (the ones changed since the last
save); it runs in a worker thread every `governance` sweep (1 s), so a hard kill loses at
most that much.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["GovernanceStore", "RunRow", "SessionRow", "TenantRow"]

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
    active_s REAL NOT NULL DEFAULT 0,
    settings TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (tenant, run_id)
);
CREATE TABLE IF NOT EXISTS sessions (
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    last_seen_s REAL NOT NULL,
    last_run INTEGER NOT NULL,
    current_run INTEGER NOT NULL,
    anchors TEXT NOT NULL,
    PRIMARY KEY (tenant, session_id)
);
"""
# columns added after the first release: (table, column, declaration), added when missing
_ADDED_COLUMNS = (
    ("runs", "active_s", "REAL NOT NULL DEFAULT 0"),
    ("runs", "settings", "TEXT NOT NULL DEFAULT '{}'"),
)


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
    active_s: float = 0.0
    settings: dict[str, str] = field(default_factory=dict)  # guard field -> its setting


@dataclass(frozen=True, slots=True)
class SessionRow:
    tenant: str
    session_id: str
    last_seen_s: float  # unix seconds
    last_run: int  # the highest run number given
    current_run: int
    anchors: Sequence[tuple[str, int]]  # (task anchor, run number), oldest first


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
        for table, column, declaration in _ADDED_COLUMNS:
            have = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
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
            RunRow(t, r, s, ls, json.loads(lim), st, tok, g, sc, sm, e, a, json.loads(se))
            for t, r, s, ls, lim, st, tok, g, sc, sm, e, a, se in conn.execute(
                "SELECT tenant, run_id, started_at_s, last_seen_s, limits, steps, tokens,"
                " gpu_seconds, stop_code, stop_message, ended, active_s, settings FROM runs"
            )
        ]
        return tenants, runs

    def load_sessions(self) -> list[SessionRow]:
        return [
            SessionRow(t, s, at, last, cur, [(str(k), int(n)) for k, n in json.loads(a)])
            for t, s, at, last, cur, a in self._need().execute(
                "SELECT tenant, session_id, last_seen_s, last_run, current_run, anchors"
                " FROM sessions"
            )
        ]

    def save(
        self,
        tenants: Sequence[TenantRow],
        runs: Sequence[RunRow],
        sessions: Sequence[SessionRow] = (),
    ) -> None:
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
                "INSERT OR REPLACE INTO runs (tenant, run_id, started_at_s, last_seen_s, limits,"
                " steps, tokens, gpu_seconds, stop_code, stop_message, ended, active_s, settings)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
                        r.active_s,
                        json.dumps(r.settings),
                    )
                    for r in runs
                ],
            )
            conn.executemany(
                "INSERT OR REPLACE INTO sessions (tenant, session_id, last_seen_s, last_run,"
                " current_run, anchors) VALUES (?, ?, ?, ?, ?, ?)",
                [
                    (
                        x.tenant,
                        x.session_id,
                        x.last_seen_s,
                        x.last_run,
                        x.current_run,
                        json.dumps(list(x.anchors)),
                    )
                    for x in sessions
                ],
            )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def forget_runs_before(self, unix_s: float) -> None:
        """Delete runs and sessions last seen before `unix_s` (the governor forgets them too)."""
        self._need().execute("DELETE FROM runs WHERE last_seen_s < ?", (unix_s,))
        self._need().execute("DELETE FROM sessions WHERE last_seen_s < ?", (unix_s,))

    def _need(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError("governance store not open")
        return self._conn


def _slices(raw: str) -> list[tuple[float, float]]:
    return [(float(t), float(a)) for t, a in json.loads(raw)]
