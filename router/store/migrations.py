"""Versioned schema migrations, applied at start and by `gpupool store migrate`.

Each feature owns its tables and declares their history as `Migration`s (component, version
1, 2, 3, ...; a text per backend, or a function of the connection where plain SQL cannot say
it). `migrate(store, migrations)` applies the ones a database has not had, in order, each
component's in one transaction, and records the version reached in `gpupool_schema`. Two
routers starting at once apply them once: PostgreSQL takes an advisory lock for the duration,
SQLite its write lock. A database whose version of a component is newer than this gpupool
knows is refused (an older router must not write a newer schema).

Files written before migrations existed are adopted: version 1 of each component is written
with `IF NOT EXISTS`, so on an existing file it finds its tables already there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import groupby

from router.store.base import Conn, Store, StoreError, split_statements

__all__ = ["Migration", "applied_versions", "migrate"]

Step = str | Callable[[Conn], None]
# pg_advisory_xact_lock key: the migrations of every component, one at a time
_LOCK_KEY = 0x6770_7570_6F6F_6C  # "gpupool"

_SCHEMA_TABLE = """
CREATE TABLE IF NOT EXISTS gpupool_schema (
    component TEXT PRIMARY KEY,
    version INTEGER NOT NULL,
    applied_at_s DOUBLE PRECISION NOT NULL
)
"""


@dataclass(frozen=True, slots=True)
class Migration:
    component: str  # e.g. "ledger"
    version: int  # 1, 2, 3, ... within the component
    description: str
    sqlite: Step
    postgresql: Step


def _schema_table(store: Store, conn: Conn) -> None:
    """`gpupool_schema`, created if missing. PostgreSQL's `CREATE TABLE IF NOT EXISTS` is not
    safe against a concurrent one (both may pass the check, the second then fails on the
    catalog's unique index), so there it runs under the migrations' lock: routers starting
    at once on a fresh database."""
    if store.dialect != "postgresql":
        conn.execute(_SCHEMA_TABLE)
        return
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(?)", (_LOCK_KEY,))
        conn.execute(_SCHEMA_TABLE)


def applied_versions(store: Store) -> dict[str, int]:
    """component -> the version its tables are at in `store` (none: not created yet)."""
    with store.connection() as conn:
        _schema_table(store, conn)
        return {
            str(c): int(v) for c, v in conn.execute("SELECT component, version FROM gpupool_schema")
        }


def migrate(store: Store, migrations: Iterable[Migration]) -> list[Migration]:
    """Apply what `store` lacks; returns what was applied, in order. Raises `StoreError`
    when the store is newer than `migrations` or a migration fails (its component's
    transaction is rolled back: nothing of it is applied)."""
    ordered = sorted(migrations, key=lambda m: (m.component, m.version))
    applied: list[Migration] = []
    with store.connection() as conn:
        _schema_table(store, conn)
        for component, group in groupby(ordered, key=lambda m: m.component):
            steps = list(group)
            _check_numbering(component, steps)
            try:
                applied += _migrate_component(store, conn, component, steps)
            except StoreError:
                raise
            except store.errors as err:
                raise StoreError(
                    f"{store.name}: migrating {component} failed (nothing of it applied): {err}"
                ) from err
    return applied


def _check_numbering(component: str, steps: Sequence[Migration]) -> None:
    versions = [m.version for m in steps]
    if versions != list(range(1, len(versions) + 1)):
        raise ValueError(f"{component}: migrations must be numbered 1, 2, 3, ...: {versions}")


def _migrate_component(
    store: Store, conn: Conn, component: str, steps: Sequence[Migration]
) -> list[Migration]:
    with conn.transaction():
        if store.dialect == "postgresql":
            conn.execute("SELECT pg_advisory_xact_lock(?)", (_LOCK_KEY,))
        row = conn.execute(
            "SELECT version FROM gpupool_schema WHERE component = ?", (component,)
        ).fetchone()
        have = 0 if row is None else int(row[0])
        if have > len(steps):
            raise StoreError(
                f"{store.name}: the {component} tables are at schema version {have}, newer than"
                f" this gpupool's ({len(steps)}): upgrade gpupool"
            )
        todo = steps[have:]
        for m in todo:
            step = m.sqlite if store.dialect == "sqlite" else m.postgresql
            if isinstance(step, str):
                for statement in split_statements(step):
                    conn.execute(statement)
            else:
                step(conn)
        if todo:
            conn.execute(
                "INSERT INTO gpupool_schema (component, version, applied_at_s) VALUES (?, ?, ?)"
                " ON CONFLICT (component) DO UPDATE SET version = excluded.version,"
                " applied_at_s = excluded.applied_at_s",
                (component, todo[-1].version, time.time()),
            )
    return list(todo)
