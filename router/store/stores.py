"""`Stores`: which `Store` each feature writes to, built once from the config.

Embedded (no `store.url`): a SQLite file per feature, where gpupool has always kept them.
PostgreSQL: one `PostgresStore` (one pool) shared by every feature. `open()` opens each
distinct store once, `close()` closes each once; both block (call them in a thread).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pools.config import Config, StoreConfig
from router.store.base import Store
from router.store.postgres import PostgresStore
from router.store.sqlite import SqliteStore

__all__ = ["Stores", "governance_path"]


def governance_path(ledger_path: Path) -> Path:
    """The embedded governance file: beside the ledger (`ledger.governance.sqlite`)."""
    return ledger_path.with_name(ledger_path.stem + ".governance.sqlite")


def shared_store(sc: StoreConfig) -> PostgresStore:
    assert sc.url is not None
    return PostgresStore(
        sc.url,
        password=sc.password,
        min_connections=sc.pool_min_connections,
        max_connections=sc.pool_max_connections,
        connect_timeout_s=sc.connect_timeout_s,
        statement_timeout_s=sc.statement_timeout_s,
        synchronous_commit=sc.synchronous_commit,
    )


@dataclass(frozen=True, slots=True)
class Stores:
    ledger: Store
    governance: Store
    rebalancer: Store  # SRE settings, audit, decisions

    @classmethod
    def from_config(cls, config: Config) -> Stores:
        if config.store.url is not None:
            shared = shared_store(config.store)
            return cls(shared, shared, shared)
        ledger_path = config.router.ledger_path
        return cls(
            SqliteStore(ledger_path),
            SqliteStore(governance_path(ledger_path)),
            SqliteStore(config.rebalancer.decision_log_path),
        )

    def distinct(self) -> list[Store]:
        seen: list[Store] = []
        for store in (self.ledger, self.governance, self.rebalancer):
            if all(store is not s for s in seen):
                seen.append(store)
        return seen

    def open(self) -> None:
        opened: list[Store] = []
        try:
            for store in self.distinct():
                store.open()
                opened.append(store)
        except BaseException:
            for store in opened:
                store.close()
            raise

    def close(self) -> None:
        for store in self.distinct():
            store.close()
