"""`Stores`: which `Store` each feature writes to, built once from the config.

Embedded (no `store.url`): a SQLite file per feature, where gpupool has always kept them.
PostgreSQL: one `PostgresStore` (one pool) shared by every feature. `open()` opens each
distinct store once, `close()` closes each once; both block (call them in a thread).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pools.config import Config, StoreConfig
from router.store.base import Store
from router.store.sqlite import SqliteStore

if TYPE_CHECKING:
    from router.store.postgres import PostgresStore

__all__ = ["Stores", "beside_ledger"]


def beside_ledger(ledger_path: Path, what: str) -> Path:
    """An embedded file beside the ledger: `ledger.<what>.sqlite`."""
    return ledger_path.with_name(f"{ledger_path.stem}.{what}.sqlite")


def shared_store(sc: StoreConfig) -> PostgresStore:
    from router.store.postgres import PostgresStore  # psycopg only for a shared store

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
    responses: Store  # where each stored response lives (previous_response_id)

    @classmethod
    def from_config(cls, config: Config) -> Stores:
        if config.store.url is not None:
            shared = shared_store(config.store)
            return cls(shared, shared, shared, shared)
        ledger_path = config.router.ledger_path
        return cls(
            SqliteStore(ledger_path),
            SqliteStore(beside_ledger(ledger_path, "governance")),
            SqliteStore(config.rebalancer.decision_log_path),
            SqliteStore(beside_ledger(ledger_path, "responses")),
        )

    def distinct(self) -> list[Store]:
        seen: list[Store] = []
        for store in (self.ledger, self.governance, self.rebalancer, self.responses):
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
