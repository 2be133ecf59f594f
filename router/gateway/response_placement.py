"""Where each stored OpenAI response lives, so a follow-up (`previous_response_id`) goes to the
engine that holds it (vLLM keeps responses in the engine process's memory, with
`VLLM_ENABLE_RESPONSES_API_STORE=1`).

One entry per response id: the tenant that made it, the instance that stored it, the chain's
first response id (a chain of follow-ups is one run when the client names no other run) and
the context the response ended with (prompt + output tokens: what a follow-up continues,
counted in its estimate). Bounded: the newest `max_entries` are kept, in memory and on disk.
On disk: one SQLite table (WAL) next to the ledger, written in batches by a background task
every `flush_every_s` and on close, read back at start, so a router restart keeps its
placements (a hard kill loses at most the last batch).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from pools.periodic import Periodic

__all__ = ["ResponsePlacement", "StoredResponse"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    response_id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    chain_root TEXT NOT NULL,
    context_tokens INTEGER NOT NULL
);
"""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    tenant: str
    instance_id: str
    chain_root: str  # the chain's first response id
    context_tokens: int  # prompt + output tokens of the response


class ResponsePlacement:
    """response id -> `StoredResponse`, bounded, persisted. `path` None: memory only."""

    def __init__(
        self, path: Path | None, *, max_entries: int = 100_000, flush_every_s: float = 0.5
    ) -> None:
        self.path = path
        self.max_entries = max(1, max_entries)
        self.flush_every_s = flush_every_s
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._pending: list[tuple[str, StoredResponse]] = []
        self._conn: sqlite3.Connection | None = None
        # a flush in progress finishes on close: its rows were taken off `_pending`
        self._flush_loop = Periodic(
            "gpupool-response-placement", self.flush, flush_every_s, interrupt_tick=False
        )

    def __len__(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.path is not None and self._conn is None:
            await asyncio.to_thread(self._open)
        self._flush_loop.start()

    async def aclose(self) -> None:
        await self._flush_loop.aclose()
        await self.flush()
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _open(self) -> None:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.executescript(_SCHEMA)
        rows = conn.execute(
            "SELECT response_id, tenant, instance_id, chain_root, context_tokens FROM responses"
            " ORDER BY seq DESC LIMIT ?",
            (self.max_entries,),
        ).fetchall()
        for rid, tenant, instance_id, root, tokens in reversed(rows):
            self._entries[rid] = StoredResponse(tenant, instance_id, root, int(tokens))
        self._conn = conn

    # ------------------------------------------------------------------ the request path

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def remember(self, response_id: str, stored: StoredResponse) -> None:
        self._entries[response_id] = stored
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        if self.path is not None:
            self._pending.append((response_id, stored))

    # ------------------------------------------------------------------ disk

    async def flush(self) -> None:
        if not self._pending or self._conn is None:
            return
        rows, self._pending = self._pending, []
        await asyncio.to_thread(self._write, rows)

    def _write(self, rows: list[tuple[str, StoredResponse]]) -> None:
        conn = self._conn
        if conn is None:
            return
        with conn:
            conn.execute("BEGIN")
            conn.executemany(
                "INSERT OR REPLACE INTO responses"
                " (response_id, tenant, instance_id, chain_root, context_tokens)"
                " VALUES (?, ?, ?, ?, ?)",
                [(rid, s.tenant, s.instance_id, s.chain_root, s.context_tokens) for rid, s in rows],
            )
            conn.execute(
                "DELETE FROM responses WHERE seq <= (SELECT MAX(seq) FROM responses) - ?",
                (self.max_entries,),
            )
