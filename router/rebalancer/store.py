"""What the rebalancer keeps on disk: the SREs' settings and the decision log.

`SreSettings` (bounds overrides, a pinned ratio, pinned instances, frozen, and the last target
ratio) lives in one JSON file at `router.state_path`, written atomically (temporary file +
rename), so it survives a restart. `DecisionLog` is one SQLite file (WAL) with two tables:
`decisions` (every decision of the loop with the signals behind it, and every SRE move) and
`audit` (every SRE change: who, when, what, before and after). Both are written through
`asyncio.to_thread`; rows older than the retention are deleted at start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DecisionLog", "SreSettings", "load_settings", "save_settings"]

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS decisions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at_unix_s REAL NOT NULL,
    reason TEXT NOT NULL,
    from_pool TEXT,
    to_pool TEXT,
    share_frac REAL,
    shares TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS decisions_at ON decisions (at_unix_s);
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at_unix_s REAL NOT NULL,
    who TEXT NOT NULL,
    action TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS audit_at ON audit (at_unix_s);
"""
_DAY_S = 86_400.0


@dataclass(slots=True)
class SreSettings:
    """The SREs' settings. `bounds[pool] = (floor, ceiling)` overrides the config's (and its
    schedule); `pinned_shares` replaces the loop's judgement; `pinned_instances[id] = pool`
    adds to the config's pins; `shares` is the last target ratio (restored at start)."""

    bounds: dict[str, tuple[float, float]] = field(default_factory=dict)
    pinned_shares: dict[str, float] | None = None
    pinned_instances: dict[str, str] = field(default_factory=dict)
    frozen: bool = False
    shares: dict[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "version": 1,
            "bounds": {p: [lo, hi] for p, (lo, hi) in self.bounds.items()},
            "pinned_shares": self.pinned_shares,
            "pinned_instances": self.pinned_instances,
            "frozen": self.frozen,
            "shares": self.shares,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SreSettings:
        def floats(value: Any) -> dict[str, float] | None:
            return None if value is None else {str(k): float(v) for k, v in value.items()}

        return cls(
            bounds={str(p): (float(b[0]), float(b[1])) for p, b in data.get("bounds", {}).items()},
            pinned_shares=floats(data.get("pinned_shares")),
            pinned_instances={str(k): str(v) for k, v in data.get("pinned_instances", {}).items()},
            frozen=bool(data.get("frozen", False)),
            shares=floats(data.get("shares")),
        )


def load_settings(path: Path) -> SreSettings:
    """The settings saved at `path`; empty ones when there is no file. A file that cannot be
    read is logged and ignored (the router starts from the config), never fatal."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return SreSettings()
    except OSError as err:
        log.warning("cannot read the SRE settings at %s: %s", path, err.strerror)
        return SreSettings()
    try:
        return SreSettings.from_json(json.loads(text))
    except (ValueError, TypeError, AttributeError, KeyError, IndexError) as err:
        log.warning("ignoring unreadable SRE settings at %s: %s", path, err)
        return SreSettings()


def save_settings(path: Path, settings: SreSettings) -> None:
    """Write atomically: a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(settings.to_json(), indent=2, sort_keys=True))
    os.replace(tmp, path)


def _connect(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.executescript(_SCHEMA)
    return conn


class DecisionLog:
    """Decisions and the audit trail in SQLite. Every call is one short transaction, run in a
    worker thread one at a time (a lock orders them)."""

    def __init__(self, path: Path, *, retention_days: float = 30.0) -> None:
        self.path = path
        self.retention_days = retention_days
        self._conn: sqlite3.Connection | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        if self._conn is not None:
            return
        self._conn = await asyncio.to_thread(_connect, self.path)
        cutoff = time.time() - self.retention_days * _DAY_S
        await self._run(
            lambda c: (
                c.execute("DELETE FROM decisions WHERE at_unix_s < ?", (cutoff,)),
                c.execute("DELETE FROM audit WHERE at_unix_s < ?", (cutoff,)),
            )
        )

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            async with self._lock:
                await asyncio.to_thread(conn.close)

    async def _run(self, fn: Any) -> Any:
        conn = self._conn
        if conn is None:
            raise RuntimeError("the decision log is not open")
        async with self._lock:
            return await asyncio.to_thread(fn, conn)

    async def record_decision(self, at_unix_s: float, row: Mapping[str, Any]) -> None:
        move = row.get("move") or {}
        await self._run(
            lambda c: c.execute(
                "INSERT INTO decisions (at_unix_s, reason, from_pool, to_pool, share_frac,"
                " shares, detail) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    at_unix_s,
                    row["reason"],
                    move.get("from_pool"),
                    move.get("to_pool"),
                    move.get("share_frac"),
                    json.dumps(row["shares"], sort_keys=True),
                    json.dumps(row, sort_keys=True),
                ),
            )
        )

    async def record_audit(
        self, at_unix_s: float, who: str, action: str, detail: Mapping[str, Any]
    ) -> None:
        await self._run(
            lambda c: c.execute(
                "INSERT INTO audit (at_unix_s, who, action, detail) VALUES (?, ?, ?, ?)",
                (at_unix_s, who, action, json.dumps(detail, sort_keys=True)),
            )
        )

    async def decisions(
        self, *, limit: int = 50, since_unix_s: float | None = None, moves_only: bool = False
    ) -> list[dict[str, Any]]:
        """Newest first."""
        where, args = ["1=1"], []
        if since_unix_s is not None:
            where.append("at_unix_s >= ?")
            args.append(since_unix_s)
        if moves_only:
            where.append("from_pool IS NOT NULL")
        conditions = " AND ".join(where)
        sql = f"SELECT id, detail FROM decisions WHERE {conditions} ORDER BY id DESC LIMIT ?"
        rows = await self._run(lambda c: c.execute(sql, (*args, limit)).fetchall())
        return [{"id": r[0], **json.loads(r[1])} for r in rows]

    async def audit(self, *, limit: int = 50) -> list[dict[str, Any]]:
        """Newest first."""
        rows = await self._run(
            lambda c: c.execute(
                "SELECT id, at_unix_s, who, action, detail FROM audit ORDER BY id DESC LIMIT ?",
                (limit,),
            ).fetchall()
        )
        return [
            {"id": r[0], "at_unix_s": r[1], "who": r[2], "action": r[3], **json.loads(r[4])}
            for r in rows
        ]
