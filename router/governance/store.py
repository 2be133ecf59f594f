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

The tables live in the store (router/store): embedded, `ledger.governance.sqlite` beside the
ledger; shared, the PostgreSQL database. Their schema is `MIGRATIONS` (component
"governance"), applied at `open`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from router.governance.shared import (
    ACQUIRE_SLOT,
    ADMISSION_RESERVATIONS,
    BORROW_DEBT,
    BORROWING,
    COST_WINDOWS,
    RUN_ACTIVE,
    RUN_COUNTERS,
    RUN_HOMES,
    RUN_LEASE,
    RUN_STEPS,
    SESSION_RUNS,
    SHARED_TABLES,
    SLOT_UNITS,
)
from router.store import Conn, Migration, SqliteStore, Store, migrate, upsert

__all__ = ["MIGRATIONS", "GovernanceStore", "RunRow", "SessionRow", "TenantRow"]

_SQLITE_SCHEMA = """
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
_POSTGRES_SCHEMA = _SQLITE_SCHEMA.replace(" REAL", " DOUBLE PRECISION").replace(
    " INTEGER", " BIGINT"
)


def _sqlite_v1(conn: Conn) -> None:
    """The tables, on a new file or one written before migrations (which may lack the
    columns added since)."""
    for statement in _SQLITE_SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)
    for table, column, declaration in _ADDED_COLUMNS:
        have = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        if column not in have:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")


MIGRATIONS = (
    Migration("governance", 1, "tenants, runs, sessions", _sqlite_v1, _POSTGRES_SCHEMA),
    SHARED_TABLES,  # router/governance/shared.py
    COST_WINDOWS,
    RUN_STEPS,
    ADMISSION_RESERVATIONS,  # router/admission/shared_reservations.py
    RUN_HOMES,
    ACQUIRE_SLOT,
    RUN_COUNTERS,
    SLOT_UNITS,
    SESSION_RUNS,
    RUN_ACTIVE,
    BORROWING,
    BORROW_DEBT,
    RUN_LEASE,
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
    """Sync; call it through `asyncio.to_thread`. The governor never overlaps two calls.

    `store`: the store the router shares (opened and closed by its owner), or a path: an
    embedded store of its own, opened and closed here."""

    def __init__(self, store: Store | Path) -> None:
        self._owned = isinstance(store, Path)
        self.store: Store = SqliteStore(store) if isinstance(store, Path) else store

    def open(self) -> None:
        if self._owned:
            self.store.open()
        migrate(self.store, MIGRATIONS)

    def close(self) -> None:
        if self._owned:
            self.store.close()

    def load(self) -> tuple[list[TenantRow], list[RunRow]]:
        with self.store.connection() as conn:
            tenants = [
                TenantRow(t, at, tl, rl, al, _slices(h), _slices(d))
                for t, at, tl, rl, al, h, d in conn.execute(
                    "SELECT tenant, saved_at_s, tokens_level, requests_level, allowance_level,"
                    " hour_slices, day_slices FROM tenants"
                )
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
        with self.store.connection() as conn:
            return [
                SessionRow(t, s, at, last, cur, [(str(k), int(n)) for k, n in json.loads(a)])
                for t, s, at, last, cur, a in conn.execute(
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
        with self.store.connection() as conn, conn.transaction():
            conn.executemany(
                upsert(
                    "tenants",
                    ("tenant",),
                    (
                        "saved_at_s",
                        "tokens_level",
                        "requests_level",
                        "allowance_level",
                        "hour_slices",
                        "day_slices",
                    ),
                ),
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
                upsert(
                    "runs",
                    ("tenant", "run_id"),
                    (
                        "started_at_s",
                        "last_seen_s",
                        "limits",
                        "steps",
                        "tokens",
                        "gpu_seconds",
                        "stop_code",
                        "stop_message",
                        "ended",
                        "active_s",
                        "settings",
                    ),
                ),
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
                upsert(
                    "sessions",
                    ("tenant", "session_id"),
                    ("last_seen_s", "last_run", "current_run", "anchors"),
                ),
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

    def forget_runs_before(self, unix_s: float, *, sessions_per_tenant: int | None = None) -> None:
        """Delete runs and sessions last seen before `unix_s` (the governor forgets them too),
        and, `sessions_per_tenant`, the shared run numbering of each tenant's sessions beyond
        its newest that many (what the governor keeps of them)."""
        with self.store.connection() as conn, conn.transaction():
            conn.execute("DELETE FROM runs WHERE last_seen_s < ?", (unix_s,))
            conn.execute("DELETE FROM sessions WHERE last_seen_s < ?", (unix_s,))
            conn.execute("DELETE FROM run_steps WHERE updated_at_s < ?", (unix_s,))
            conn.execute("DELETE FROM session_runs WHERE updated_at_s < ?", (unix_s,))
            if sessions_per_tenant is not None:
                conn.execute(
                    "DELETE FROM session_runs WHERE (tenant, session_id) IN (SELECT tenant,"
                    " session_id FROM (SELECT tenant, session_id, ROW_NUMBER() OVER (PARTITION"
                    " BY tenant ORDER BY updated_at_s DESC) AS n FROM session_runs) newest"
                    " WHERE n > ?)",
                    (sessions_per_tenant,),
                )
            conn.execute(  # an anchor goes with its session (or a day after its last step)
                "DELETE FROM session_anchors WHERE seen_at_s < ? OR NOT EXISTS (SELECT 1 FROM"
                " session_runs s WHERE s.tenant = session_anchors.tenant"
                " AND s.session_id = session_anchors.session_id)",
                (unix_s,),
            )


def _slices(raw: str) -> list[tuple[float, float]]:
    return [(float(t), float(a)) for t, a in json.loads(raw)]
