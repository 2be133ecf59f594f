"""The store's contract, the same cases against both backends (embedded SQLite, a real
PostgreSQL server): portable SQL, transactions and savepoints, migrations (versioned, applied
once, adopted on old files, refused when newer), and clear errors for bad stores."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from router.store import (
    Conn,
    Migration,
    PostgresStore,
    SqliteStore,
    Store,
    StoreError,
    applied_versions,
    migrate,
    savepoint,
)
from tests.postgres import PASSWORD, PostgresServer

_ITEMS = (
    Migration(
        "items",
        1,
        "items",
        "CREATE TABLE IF NOT EXISTS items (k TEXT PRIMARY KEY, n INTEGER NOT NULL,"
        " x REAL NOT NULL)",
        "CREATE TABLE IF NOT EXISTS items (k TEXT PRIMARY KEY, n BIGINT NOT NULL,"
        " x DOUBLE PRECISION NOT NULL)",
    ),
    Migration(
        "items",
        2,
        "a note per item",
        "ALTER TABLE items ADD COLUMN note TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE items ADD COLUMN note TEXT NOT NULL DEFAULT ''",
    ),
)
_UPSERT = (
    "INSERT INTO items (k, n, x) VALUES (?, ?, ?) ON CONFLICT (k) DO UPDATE SET"
    " n = items.n + excluded.n, x = excluded.x"
)


def test_migrations_apply_once_in_order(any_store: Store) -> None:
    applied = migrate(any_store, _ITEMS)
    assert [m.version for m in applied] == [1, 2]
    assert migrate(any_store, _ITEMS) == []
    assert applied_versions(any_store) == {"items": 2}
    with any_store.connection() as conn:
        conn.execute("INSERT INTO items (k, n, x, note) VALUES (?, ?, ?, ?)", ("a", 1, 0.5, "hi"))
        assert conn.execute("SELECT note FROM items").fetchall() == [("hi",)]


def test_a_later_migration_applies_alone(any_store: Store) -> None:
    migrate(any_store, _ITEMS[:1])
    with any_store.connection() as conn:
        conn.execute(_UPSERT, ("a", 1, 0.5))
    assert [m.version for m in migrate(any_store, _ITEMS)] == [2]
    with any_store.connection() as conn:
        assert conn.execute("SELECT k, n, note FROM items").fetchall() == [("a", 1, "")]


def test_a_newer_schema_is_refused(any_store: Store) -> None:
    migrate(any_store, _ITEMS)
    with pytest.raises(StoreError, match="version 2, newer than this gpupool's"):
        migrate(any_store, _ITEMS[:1])


def test_a_failed_migration_applies_nothing_of_it(any_store: Store) -> None:
    bad = Migration(
        "items",
        2,
        "broken",
        "ALTER TABLE nowhere ADD COLUMN y TEXT",
        "ALTER TABLE nowhere ADD COLUMN y TEXT",
    )
    migrate(any_store, _ITEMS[:1])
    with pytest.raises(StoreError, match="migrating items failed"):
        migrate(any_store, (_ITEMS[0], bad))
    assert applied_versions(any_store) == {"items": 1}


def test_portable_sql_round_trips(any_store: Store) -> None:
    migrate(any_store, _ITEMS)
    with any_store.connection() as conn:
        conn.executemany(_UPSERT, [("a", 2, 1.5), ("b", 3, 2.5), ("a", 5, 3.5)])
        rows = conn.execute("SELECT k, n, x FROM items ORDER BY k").fetchall()
        assert [tuple(r) for r in rows] == [("a", 7, 3.5), ("b", 3, 2.5)]
        total = conn.execute(
            "SELECT CAST(COALESCE(SUM(n), 0) AS BIGINT), COALESCE(SUM(x), 0.0) FROM items"
            " WHERE x >= ?",
            (float("-inf"),),
        ).fetchone()
        assert (total[0], total[1]) == (10, 6.0)
        assert isinstance(total[0], int)
        assert conn.execute("SELECT '100%' FROM items WHERE k = ?", ("a",)).fetchone()[0] == "100%"
        cur = conn.execute("DELETE FROM items WHERE k = ?", ("b",))
        assert cur.rowcount == 1


def test_transactions_roll_back_and_savepoints_keep_the_rest(any_store: Store) -> None:
    migrate(any_store, _ITEMS)
    with any_store.connection() as conn:
        with pytest.raises(RuntimeError), conn.transaction():
            conn.execute(_UPSERT, ("gone", 1, 1.0))
            raise RuntimeError("boom")
        with conn.transaction():
            conn.execute(_UPSERT, ("kept", 1, 1.0))
            with pytest.raises(any_store.data_errors), savepoint(conn, "one_row"):
                conn.execute("INSERT INTO items (k, n, x) VALUES (?, ?, ?)", ("bad", None, 1.0))
            conn.execute(_UPSERT, ("also", 1, 1.0))
        assert [r[0] for r in conn.execute("SELECT k FROM items ORDER BY k")] == ["also", "kept"]


def test_every_thread_may_take_a_connection(any_store: Store) -> None:
    migrate(any_store, _ITEMS)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(20):
                with any_store.connection() as conn, conn.transaction():
                    conn.execute(_UPSERT, (f"k{j % 3}", 1, float(i)))
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with any_store.connection() as conn:
        assert conn.execute("SELECT SUM(n) FROM items").fetchone()[0] == 80


def _conn_kind(conn: Conn) -> str:
    return type(conn).__name__


def test_routers_starting_at_once_on_a_fresh_database_migrate_once(any_store: Store) -> None:
    """Four stores (four routers' pools) migrate one fresh database at the same moment: none
    fails (PostgreSQL's CREATE TABLE IF NOT EXISTS races without the lock) and each
    migration is applied once."""
    if isinstance(any_store, PostgresStore):
        stores: list[Store] = [PostgresStore(any_store.url, password=PASSWORD) for _ in range(4)]
    else:
        assert isinstance(any_store, SqliteStore)
        stores = [SqliteStore(any_store.path) for _ in range(4)]
    barrier = threading.Barrier(len(stores))
    applied: list[int] = []
    errors: list[BaseException] = []

    def start(store: Store) -> None:
        try:
            store.open()
            barrier.wait()
            applied.extend(m.version for m in migrate(store, _ITEMS))
        except BaseException as err:  # reported below
            errors.append(err)
        finally:
            store.close()

    threads = [threading.Thread(target=start, args=(store,)) for store in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(applied) == [1, 2]
    assert applied_versions(any_store) == {"items": 2}


def test_a_closed_store_refuses_connections(any_store: Store) -> None:
    any_store.close()
    with pytest.raises(StoreError, match="not open"), any_store.connection() as conn:
        _conn_kind(conn)
    any_store.open()  # and opens again


# ---------------------------------------------------------------------------------------------
# bad stores: clear errors
# ---------------------------------------------------------------------------------------------


def test_a_wrong_password_names_the_cause(postgres_server: PostgresServer) -> None:
    store = PostgresStore(postgres_server.url(), password="not-it", connect_timeout_s=2)
    with pytest.raises(StoreError, match="password authentication failed") as err:
        store.open()
    assert "not-it" not in str(err.value)


def test_a_missing_database_names_the_cause(postgres_server: PostgresServer) -> None:
    store = PostgresStore(postgres_server.url("nope"), password=PASSWORD, connect_timeout_s=2)
    with pytest.raises(StoreError, match='database "nope" does not exist'):
        store.open()


def test_an_unreachable_server_fails_within_the_timeout(tmp_path: Path) -> None:
    store = PostgresStore(
        f"postgresql://u@/db?host={tmp_path}&port=1", password="x", connect_timeout_s=1
    )
    with pytest.raises(StoreError, match="cannot connect to the PostgreSQL store"):
        store.open()


def test_a_short_connect_timeout_does_not_fail_the_pool_fill(
    postgres_server: PostgresServer,
) -> None:
    """A `connect_timeout_s` far shorter than a connect (meant to notice an outage fast) does
    not fail `open` while the server answers: the pool's first connections get at least
    POOL_FILL_S (under load they took over 0.5 s and tests failed at setup)."""
    store = PostgresStore(postgres_server.url(), password=PASSWORD, connect_timeout_s=0.0001)
    store.open()
    try:
        with store.connection() as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        store.close()


def test_a_file_that_is_not_sqlite_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    path.write_bytes(b"not a database at all" * 100)
    store = SqliteStore(path)
    with pytest.raises(StoreError, match="not a SQLite database"):
        store.open()


def test_an_existing_file_is_adopted(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    raw = sqlite3.connect(path)
    raw.execute("CREATE TABLE items (k TEXT PRIMARY KEY, n INTEGER NOT NULL, x REAL NOT NULL)")
    raw.execute("INSERT INTO items VALUES ('old', 4, 1.0)")
    raw.commit()
    raw.close()
    store = SqliteStore(path)
    store.open()
    try:
        assert [m.version for m in migrate(store, _ITEMS)] == [1, 2]
        with store.connection() as conn:
            assert conn.execute("SELECT k, n, note FROM items").fetchall() == [("old", 4, "")]
    finally:
        store.close()


@pytest.mark.parametrize("synchronous_commit", [False, True])
def test_the_sessions_run_with_the_configured_commit_and_timeout(
    postgres_server: PostgresServer, synchronous_commit: bool
) -> None:
    store = PostgresStore(
        postgres_server.url(),
        password=PASSWORD,
        statement_timeout_s=2.5,
        synchronous_commit=synchronous_commit,
    )
    store.open()
    try:
        with store.connection() as conn:
            assert conn.execute("SHOW synchronous_commit").fetchone()[0] == (
                "on" if synchronous_commit else "off"
            )
            assert conn.execute("SHOW statement_timeout").fetchone()[0] == "2500ms"
    finally:
        store.close()
