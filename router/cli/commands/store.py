"""`gpupool store`: the store's schema (router/store).

    gpupool store migrate [--config FILE]   apply the migrations the store lacks, then exit
    gpupool store status  [--config FILE]   the schema version of each feature's tables

The router applies migrations itself at start; `migrate` runs them alone (before a rolling
upgrade of several replicas, or to check a PostgreSQL URL and password). The store is the
config's: `store.url` (PostgreSQL, password from `store.password_env`), else the embedded
SQLite files beside `router.ledger_path`.

Exit codes: 0 done; 1 the store is unreachable, refused the password, or is newer than this
gpupool; 2 bad input (the config).
"""

from __future__ import annotations

import argparse
import sys

from router.accounting.ledger import MIGRATIONS as LEDGER
from router.admission.shared_attained import MIGRATIONS as ADMISSION
from router.cli.commands._config import load_or_report
from router.gateway.response_placement import MIGRATIONS as RESPONSES
from router.governance.store import MIGRATIONS as GOVERNANCE
from router.rebalancer.store import MIGRATIONS as REBALANCER
from router.store import (
    Migration,
    SqliteStore,
    Store,
    StoreError,
    Stores,
    applied_versions,
    migrate,
)

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("store", help="the store's schema: migrate, status")
    sub = p.add_subparsers(dest="store_command", metavar="{migrate,status}", required=True)
    for name, text in (
        ("migrate", "apply the schema migrations the store lacks"),
        ("status", "the schema version of each feature's tables"),
    ):
        q = sub.add_parser(name, help=text)
        q.add_argument("--config", metavar="FILE", help="YAML config (default: the built-in)")
    p.set_defaults(func=run)


def _by_store(stores: Stores) -> list[tuple[Store, tuple[Migration, ...]]]:
    """Each distinct store with the migrations of the features it holds."""
    pairs: list[tuple[Store, tuple[Migration, ...]]] = []
    for store, migrations in (
        (stores.ledger, LEDGER),
        (stores.governance, GOVERNANCE),
        (stores.rebalancer, REBALANCER),
        (stores.responses, RESPONSES),
        # run_las across replicas: only a shared store has other replicas to tell
        (stores.governance, ADMISSION if stores.governance.dialect == "postgresql" else ()),
    ):
        for i, (seen, held) in enumerate(pairs):
            if seen is store:
                pairs[i] = (seen, held + migrations)
                break
        else:
            pairs.append((store, migrations))
    return pairs


def run(args: argparse.Namespace) -> int:
    config = load_or_report(args.config)
    if config is None:
        return 2
    stores = Stores.from_config(config)
    try:
        if args.store_command == "migrate":
            _migrate(stores)
        else:
            _status(stores)
    except StoreError as err:
        print(f"gpupool store: {err}", file=sys.stderr)
        return 1
    return 0


def _migrate(stores: Stores) -> None:
    stores.open()
    try:
        for store, migrations in _by_store(stores):
            done = migrate(store, migrations)
            for m in done:
                print(f"{store.name}: {m.component} {m.version}: {m.description}")
            if not done:
                print(f"{store.name}: up to date")
    finally:
        stores.close()


def _status(stores: Stores) -> None:
    """Each store's schema versions, read without changing anything: an embedded file that
    does not exist yet is said to be missing, not created."""
    for store, migrations in _by_store(stores):
        if isinstance(store, SqliteStore) and not store.path.exists():
            print(
                f"{store.name}: not created yet (the router creates it at its first start,"
                " `gpupool store migrate` now)"
            )
            continue
        store.open()
        try:
            have = applied_versions(store)
        finally:
            store.close()
        for component in sorted({m.component for m in migrations}):
            latest = max(m.version for m in migrations if m.component == component)
            at = have.get(component, 0)
            state = "up to date" if at == latest else f"{latest - at} to apply"
            print(f"{store.name}: {component} at {at} of {latest} ({state})")
