"""Unit-test fixtures shared across files: a real PostgreSQL server (tests/postgres.py) and
`any_store`, a fresh open store of each backend (a test that takes it runs twice)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict, Unpack

import pytest

from router.store import PostgresStore, SqliteStore, Store
from tests.postgres import PASSWORD, PostgresServer, postgres_server

__all__ = ["any_store", "fresh_postgres_store", "postgres_server"]

_databases = itertools.count()


class StoreOptions(TypedDict, total=False):  # PostgresStore's that the tests set
    connect_timeout_s: float


def fresh_postgres_store(server: PostgresServer, **options: Unpack[StoreOptions]) -> PostgresStore:
    """A store on a database of its own (not opened)."""
    url = server.create_database(f"t{next(_databases)}")
    return PostgresStore(url, password=PASSWORD, **options)


@pytest.fixture(params=["sqlite", "postgresql"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    store: Store
    if request.param == "sqlite":
        store = SqliteStore(tmp_path / "store.sqlite")
    else:
        store = fresh_postgres_store(request.getfixturevalue("postgres_server"))
    store.open()
    yield store
    store.close()
