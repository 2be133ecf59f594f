"""What the rebalancer keeps in the store: the SREs' settings, the audit trail and the
decision log.

`DecisionLog` owns three tables in the store (router/store; embedded: `decisions.sqlite` at
rebalancer.decision_log_path; shared: the PostgreSQL database, so every replica reads the same
settings and appends to one log): `decisions` (every decision of the loop with the signals
behind it, and every SRE move), `audit` (every SRE change: who, when, what, before and after)
and `sre_settings` (one row: bounds overrides, a pinned ratio, pinned instances, frozen, the
last target ratio; it survives a restart). Settings written by gpupool before the store, a JSON
file at router.state_path, are read once, when the store holds none yet. Every call is one
short transaction in a worker thread; rows older than the retention are deleted at start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from router.store import Conn, Migration, SqliteStore, Store, migrate, upsert

__all__ = ["MIGRATIONS", "DecisionLog", "Ratio", "SreSettings", "read_legacy_settings"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_DECISIONS = """
CREATE TABLE IF NOT EXISTS decisions (
    id {id},
    at_unix_s {real} NOT NULL,
    reason TEXT NOT NULL,
    from_pool TEXT,
    to_pool TEXT,
    share_frac {real},
    shares TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS decisions_at ON decisions (at_unix_s);
CREATE TABLE IF NOT EXISTS audit (
    id {id},
    at_unix_s {real} NOT NULL,
    who TEXT NOT NULL,
    action TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS audit_at ON audit (at_unix_s);
"""
_SETTINGS = """
CREATE TABLE IF NOT EXISTS sre_settings (
    id INTEGER PRIMARY KEY,
    saved_at_s {real} NOT NULL,
    body TEXT NOT NULL
)
"""
_RATIO = """
CREATE TABLE IF NOT EXISTS pool_ratio (
    id INTEGER PRIMARY KEY,
    version BIGINT NOT NULL,
    saved_at_s {real} NOT NULL,
    replica TEXT NOT NULL,
    shares TEXT NOT NULL
)
"""
_SQLITE = {"id": "INTEGER PRIMARY KEY AUTOINCREMENT", "real": "REAL"}
_POSTGRES = {"id": "BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY", "real": "DOUBLE PRECISION"}
MIGRATIONS = (
    Migration(
        "rebalancer",
        1,
        "decisions, audit",
        _DECISIONS.format(**_SQLITE),
        _DECISIONS.format(**_POSTGRES),
    ),
    Migration(
        "rebalancer",
        2,
        "SRE settings (were a JSON file)",
        _SETTINGS.format(**_SQLITE),
        _SETTINGS.format(**_POSTGRES),
    ),
    Migration(
        "rebalancer",
        3,
        "the target ratio every replica follows (published by the leader and SRE changes)",
        _RATIO.format(**_SQLITE),
        _RATIO.format(**_POSTGRES),
    ),
    Migration(
        "rebalancer",
        4,
        "the placement published with the ratio (which instance serves which pool)",
        "ALTER TABLE pool_ratio ADD COLUMN placement TEXT",
        "ALTER TABLE pool_ratio ADD COLUMN placement TEXT",
    ),
)
_SAVE_SETTINGS = upsert("sre_settings", ("id",), ("saved_at_s", "body"))
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


@dataclass(frozen=True, slots=True)
class Ratio:
    """The target ratio as published in the store: `version` counts publications (1, 2,
    ...), `replica` wrote it. `placement` is the allocation it placed the ratio with
    (instance -> pool -> fraction), so that every replica moves the same instances (the same
    shares can be placed by moving any of a pool's instances, and an SRE's `move_instance`
    names one); None where it was published without one."""

    version: int
    replica: str
    shares: dict[str, float]
    placement: dict[str, dict[str, float]] | None = None


def _settings_from(body: str, store_name: str) -> SreSettings:
    try:
        return SreSettings.from_json(json.loads(body))
    except (ValueError, TypeError, AttributeError, KeyError, IndexError) as err:
        log.warning("ignoring unreadable SRE settings in %s: %s", store_name, err)
        return SreSettings()


def read_legacy_settings(path: Path) -> SreSettings | None:
    """The settings gpupool kept at `path` (JSON) before the store; None when there is no
    file. A file that cannot be read is logged and ignored (the router starts from the
    config), never fatal."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        log.warning("cannot read the SRE settings at %s: %s", path, err.strerror)
        return None
    try:
        return SreSettings.from_json(json.loads(text))
    except (ValueError, TypeError, AttributeError, KeyError, IndexError) as err:
        log.warning("ignoring unreadable SRE settings at %s: %s", path, err)
        return None


class DecisionLog:
    """Decisions, the audit trail and the SRE settings in the store. Every call is one short
    transaction, run in a worker thread one at a time (a lock orders them).

    `store`: the router's store (opened and closed by its owner), or a path: an embedded
    store of its own, opened and closed here."""

    def __init__(self, store: Store | Path, *, retention_days: float = 30.0) -> None:
        self._owned = isinstance(store, Path)
        self.store: Store = SqliteStore(store) if isinstance(store, Path) else store
        self.retention_days = retention_days
        self._open = False
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        if self._open:
            return
        if self._owned:
            await asyncio.to_thread(self.store.open)
        self._open = True
        try:
            await asyncio.to_thread(migrate, self.store, MIGRATIONS)
            cutoff = time.time() - self.retention_days * _DAY_S

            def expire(c: Conn) -> None:
                c.execute("DELETE FROM decisions WHERE at_unix_s < ?", (cutoff,))
                c.execute("DELETE FROM audit WHERE at_unix_s < ?", (cutoff,))

            await self._run(expire)
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        if not self._open:
            return
        self._open = False
        if self._owned:
            async with self._lock:
                await asyncio.to_thread(self.store.close)

    async def _run(self, fn: Callable[[Conn], T]) -> T:
        if not self._open:
            raise RuntimeError("the decision log is not open")

        def work() -> T:
            with self.store.connection() as conn:
                return fn(conn)

        async with self._lock:
            return await asyncio.to_thread(work)

    async def load_settings(self, legacy_path: Path | None = None) -> SreSettings:
        """The saved settings; with none saved yet, those of the JSON file at `legacy_path`
        (gpupool before the store), saved here at once; else empty ones."""
        row = await self._run(
            lambda c: c.execute("SELECT body FROM sre_settings WHERE id = 1").fetchone()
        )
        if row is not None:
            return _settings_from(row[0], self.store.name)
        legacy = None if legacy_path is None else read_legacy_settings(legacy_path)
        if legacy is None:
            return SreSettings()
        await self.save_settings(legacy)
        log.info("SRE settings imported from %s into %s", legacy_path, self.store.name)
        return legacy

    async def save_settings(self, settings: SreSettings) -> None:
        body = json.dumps(settings.to_json(), sort_keys=True)
        await self._run(lambda c: c.execute(_SAVE_SETTINGS, (1, time.time(), body)))

    async def load_shared(self) -> tuple[SreSettings | None, Ratio | None]:
        """What the replicas share, read in one call: the SRE settings and the target ratio
        (None where none is saved yet)."""

        def read(c: Conn) -> tuple[Any, Any]:
            settings = c.execute("SELECT body FROM sre_settings WHERE id = 1").fetchone()
            ratio = c.execute(
                "SELECT version, replica, shares, placement FROM pool_ratio WHERE id = 1"
            ).fetchone()
            return settings, ratio

        settings_row, ratio_row = await self._run(read)
        settings = (
            None if settings_row is None else _settings_from(settings_row[0], self.store.name)
        )
        ratio = None
        if ratio_row is not None:
            try:
                shares = {str(k): float(v) for k, v in json.loads(ratio_row[2]).items()}
                placement = None
                if ratio_row[3] is not None:
                    placement = {
                        str(i): {str(p): float(f) for p, f in by_pool.items()}
                        for i, by_pool in json.loads(ratio_row[3]).items()
                    }
            except (ValueError, TypeError, AttributeError) as err:
                log.warning("ignoring an unreadable pool ratio in %s: %s", self.store.name, err)
            else:
                ratio = Ratio(int(ratio_row[0]), str(ratio_row[1]), shares, placement)
        return settings, ratio

    async def publish_ratio(
        self,
        seen_version: int,
        replica: str,
        shares: Mapping[str, float],
        placement: Mapping[str, Mapping[str, float]] | None = None,
    ) -> int | None:
        """Publish `shares` (and the `placement` they were placed with) as the target ratio if
        the newest version is still `seen_version` (0: none yet); the new version, or None
        when another replica published first (read it and follow it)."""
        body = json.dumps(dict(shares), sort_keys=True)
        placed = (
            None
            if placement is None
            else json.dumps({i: dict(f) for i, f in placement.items()}, sort_keys=True)
        )
        now = time.time()

        def write(c: Conn) -> int:
            if seen_version == 0:
                return c.execute(
                    "INSERT INTO pool_ratio (id, version, saved_at_s, replica, shares, placement)"
                    " VALUES (1, 1, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
                    (now, replica, body, placed),
                ).rowcount
            return c.execute(
                "UPDATE pool_ratio SET version = version + 1, saved_at_s = ?, replica = ?,"
                " shares = ?, placement = ? WHERE id = 1 AND version = ?",
                (now, replica, body, placed, seen_version),
            ).rowcount

        return seen_version + 1 if await self._run(write) == 1 else None

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
