"""Where each stored OpenAI response lives, so a follow-up (`previous_response_id`) goes to the
engine that holds it (vLLM keeps responses in the engine process's memory, with
`VLLM_ENABLE_RESPONSES_API_STORE=1`).

One entry per response id: the tenant that made it, the instance that stored it, the chain's
first response id (a chain of follow-ups is one run when the client names no other run) and
the context the response ended with (prompt + output tokens: what a follow-up continues,
counted in its estimate). Bounded: the newest `max_entries` are kept, in memory and in the
store. Stored: one table (`MIGRATIONS`, component "responses") in the store (router/store;
embedded: `<ledger>.responses.sqlite` beside the ledger; shared: the PostgreSQL database),
written in batches by a background task every `flush_every_s` and on close, read back at
start, so a router restart keeps its placements (a hard kill loses at most the last batch).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from pools.periodic import Periodic
from router.store import Migration, SqliteStore, Store, migrate

__all__ = ["MIGRATIONS", "ResponsePlacement", "StoredResponse"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq {id},
    response_id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    chain_root TEXT NOT NULL,
    context_tokens {int} NOT NULL
)
"""
MIGRATIONS = (
    Migration(
        "responses",
        1,
        "responses",
        _SCHEMA.format(id="INTEGER PRIMARY KEY AUTOINCREMENT", int="INTEGER"),
        _SCHEMA.format(id="BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY", int="BIGINT"),
    ),
)


@dataclass(frozen=True, slots=True)
class StoredResponse:
    tenant: str
    instance_id: str
    chain_root: str  # the chain's first response id
    context_tokens: int  # prompt + output tokens of the response


class ResponsePlacement:
    """response id -> `StoredResponse`, bounded, persisted. `store`: the router's store (opened
    and closed by its owner), a path (an embedded store of its own), or None: memory only."""

    def __init__(
        self,
        store: Store | Path | None,
        *,
        max_entries: int = 100_000,
        flush_every_s: float = 0.5,
    ) -> None:
        self._owned = isinstance(store, Path)
        self.store: Store | None = SqliteStore(store) if isinstance(store, Path) else store
        self.max_entries = max(1, max_entries)
        self.flush_every_s = flush_every_s
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._pending: list[tuple[str, StoredResponse]] = []
        self._open = False
        # a flush in progress finishes on close: its rows were taken off `_pending`
        self._flush_loop = Periodic(
            "gpupool-response-placement", self.flush, flush_every_s, interrupt_tick=False
        )

    def __len__(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.store is not None and not self._open:
            await asyncio.to_thread(self._load, self.store)
            self._open = True
        self._flush_loop.start()

    async def aclose(self) -> None:
        await self._flush_loop.aclose()
        await self.flush()
        if self._open and self.store is not None and self._owned:
            await asyncio.to_thread(self.store.close)
        self._open = False

    def _load(self, store: Store) -> None:
        if self._owned:
            store.open()
        migrate(store, MIGRATIONS)
        with store.connection() as conn:
            rows = conn.execute(
                "SELECT response_id, tenant, instance_id, chain_root, context_tokens"
                " FROM responses ORDER BY seq DESC LIMIT ?",
                (self.max_entries,),
            ).fetchall()
        for rid, tenant, instance_id, root, tokens in reversed(rows):
            self._entries[rid] = StoredResponse(tenant, instance_id, root, int(tokens))

    # ------------------------------------------------------------------ the request path

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def remember(self, response_id: str, stored: StoredResponse) -> None:
        self._entries[response_id] = stored
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        if self.store is not None:
            self._pending.append((response_id, stored))

    # ------------------------------------------------------------------ disk

    async def flush(self) -> None:
        if not self._pending or not self._open or self.store is None:
            return
        rows, self._pending = self._pending, []
        try:
            await asyncio.to_thread(self._write, self.store, _latest(rows))
        except BaseException:
            self._pending[:0] = rows  # written with the next flush
            raise

    def _write(self, store: Store, rows: list[tuple[str, StoredResponse]]) -> None:
        """One transaction: the rows (a response id given again moves to the newest), then the
        oldest beyond `max_entries` deleted."""
        with store.connection() as conn, conn.transaction():
            conn.executemany(
                "DELETE FROM responses WHERE response_id = ?", [(rid,) for rid, _ in rows]
            )
            conn.executemany(
                "INSERT INTO responses"
                " (response_id, tenant, instance_id, chain_root, context_tokens)"
                " VALUES (?, ?, ?, ?, ?)",
                [(rid, s.tenant, s.instance_id, s.chain_root, s.context_tokens) for rid, s in rows],
            )
            conn.execute(
                "DELETE FROM responses WHERE seq <= (SELECT MAX(seq) FROM responses) - ?",
                (self.max_entries,),
            )


def _latest(rows: list[tuple[str, StoredResponse]]) -> list[tuple[str, StoredResponse]]:
    """Each response id once, at its last place."""
    seen: set[str] = set()
    kept = []
    for rid, stored in reversed(rows):
        if rid not in seen:
            seen.add(rid)
            kept.append((rid, stored))
    kept.reverse()
    return kept
