"""router/store/sqlite.py's None -> None adapter: None binds by sqlite3's adapter fast path and
still lands as SQL NULL, through the store and through the ledger's commit on the event loop."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from router.accounting.ledger import _COLUMNS, MIGRATIONS, _insert_rows_sql, _record_fields
from router.accounting.ledger_loop import LoopCommit
from router.store import SqliteStore, migrate
from tests.unit.ledger_records import record

NULLABLE = ("run_id", "step_index", "instance", "ttft_s", "tpot_s")


def test_importing_the_store_registers_none_to_none() -> None:
    adapter = sqlite3.adapters[(type(None), sqlite3.PrepareProtocol)]
    assert adapter(None) is None


def test_none_binds_as_null_through_the_store(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.sqlite")
    store.open()
    try:
        with store.connection() as conn:
            conn.execute("CREATE TABLE t (a TEXT, b REAL, c INTEGER)")
            conn.execute("INSERT INTO t VALUES (?, ?, ?)", (None, None, None))
            conn.executemany("INSERT INTO t VALUES (?, ?, ?)", [(None, 1.5, None), ("x", None, 2)])
            got = conn.execute("SELECT typeof(a), typeof(b), typeof(c), a, b, c FROM t").fetchall()
    finally:
        store.close()
    assert got == [
        ("null", "null", "null", None, None, None),
        ("null", "real", "null", None, 1.5, None),
        ("text", "null", "integer", "x", None, 2),
    ]


def test_a_ledger_row_with_nones_commits_nulls_on_the_loop(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    store = SqliteStore(path)
    store.open()
    migrate(store, MIGRATIONS)
    store.close()
    rec = record(run_id=None, instance=None, ttft_s=None, tpot_s=None)
    commit = LoopCommit(path, _insert_rows_sql, len(_COLUMNS))
    commit.open()
    try:
        assert commit.commit([(*_record_fields(rec), None)])
    finally:
        commit.close()
    with sqlite3.connect(path) as conn:
        types = conn.execute(
            "SELECT " + ", ".join(f"typeof({c})" for c in NULLABLE) + " FROM requests"
            " WHERE request_id = ?",
            (rec.request_id,),
        ).fetchall()
    assert types == [("null",) * len(NULLABLE)]


def test_a_bound_none_goes_through_the_adapters_table() -> None:
    """Python 3.11's sqlite3 binds a None through the adapter protocol: the adapters table
    first (one dict hit, where the registered None -> None adapter answers), then, without an
    entry, two failed attribute look-ups (~0.45 us more a None, sized in
    benchmarks/results/ledger-2026-12-04-s49/SIZING.md; the speed is the benchmark's, not this
    test's). A counting adapter in the same slot sees every bound None, so the table is what
    answers them."""
    conn = sqlite3.connect(":memory:")
    key = (type(None), sqlite3.PrepareProtocol)
    seen: list[object] = []

    def counting(value: object) -> None:
        seen.append(value)

    registered = sqlite3.adapters[key]
    sqlite3.adapters[key] = counting
    try:
        row = conn.execute("SELECT " + ", ".join(["?"] * 50), [None] * 50).fetchone()
    finally:
        sqlite3.adapters[key] = registered
        conn.close()
    assert seen == [None] * 50 and row == (None,) * 50
