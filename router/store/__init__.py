"""The store: one interface for the state router replicas must agree on, two backends.

What lives there, each feature owning its tables and their migrations: the ledger (requests,
hourly idle and capacity, run ends; router/accounting/ledger.py), governance (token buckets,
cost windows, runs and their guards, sessions; router/governance/store.py), the rebalancer's
SRE settings, audit trail and decision log (router/rebalancer/store.py), and where each stored
response lives (router/gateway/response_placement.py).

`Stores.from_config(config)` gives each of them its `Store`: with `store.url` unset, the
embedded SQLite files of one machine (router.ledger_path, the governance and responses files
beside it, rebalancer.decision_log_path: existing files keep working, adopted by the
migrations); with a
PostgreSQL URL, one database (one connection pool) for all of them. See docs/replicas.md.

`PostgresStore` is imported on first use (`router.store.PostgresStore`), so a router on the
embedded store never imports psycopg (~0.1 s of every start).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from router.store.base import Conn, Dialect, Rows, Store, StoreError, redact, savepoint, upsert
from router.store.migrations import Migration, applied_versions, migrate
from router.store.sqlite import SqliteStore
from router.store.stores import Stores

if TYPE_CHECKING:
    from router.store.postgres import PostgresStore

__all__ = [
    "Conn",
    "Dialect",
    "Migration",
    "PostgresStore",
    "Rows",
    "SqliteStore",
    "Store",
    "StoreError",
    "Stores",
    "applied_versions",
    "migrate",
    "redact",
    "savepoint",
    "upsert",
]


def __getattr__(name: str) -> Any:
    if name == "PostgresStore":
        from router.store.postgres import PostgresStore

        return PostgresStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
