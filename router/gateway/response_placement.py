"""Where each stored OpenAI response lives, so a follow-up (`previous_response_id`) goes to the
engine that holds it (vLLM keeps responses in the engine process's memory, with
`VLLM_ENABLE_RESPONSES_API_STORE=1`).

One entry per response id: the tenant that made it, the instance that stored it, the chain's
first response id (a chain of follow-ups is one run when the client names no other run) and
the context the response ended with (prompt + output tokens: what a follow-up continues,
counted in its estimate). Bounded: the newest `max_entries` are kept in memory, and the newest
`max_entries` in the store. Stored: one table (`MIGRATIONS`, component "responses") in the
store (router/store):

- embedded (`<ledger>.responses.sqlite` beside the ledger, one router): written in batches by
  a background task every `flush_every_s` and on close, read back at start, so a router
  restart keeps its placements (a hard kill loses at most the last batch);
- shared (PostgreSQL, router replicas): each placement is written before the response's final
  bytes, so a follow-up the client sends at once to any replica finds it: in the statement
  that commits the response's ledger record when it can (`PlacementWrite`), else on an
  asyncio connection of its own (`LoopConnection`; placements that arrive while one statement
  is in flight go together in the next) beside the ledger's commit; the response waits for
  it at most `wait_s`. A follow-up whose previous response is not in
  this replica's memory reads its row (`fetch`: one SELECT, only on a miss); a store that
  cannot answer it is `StoreUnavailable` (503, retryable). A failed write stays in memory and
  is retried by the periodic flush, which also deletes the rows beyond `max_entries` (the
  oldest of all replicas' rows, by insertion order).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import OrderedDict
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pools.periodic import Periodic
from router.errors import StoreUnavailable
from router.store import Migration, SqliteStore, Store, migrate

if TYPE_CHECKING:
    from router.store.loop_connection import LoopConnection

__all__ = ["MIGRATIONS", "WAIT_S", "PlacementWrite", "ResponsePlacement", "StoredResponse"]

log = logging.getLogger(__name__)

WAIT_S = 2.0  # the most a response waits for its placement's write, a follow-up for its read

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
_COLUMNS = "response_id, tenant, instance_id, chain_root, context_tokens"
_FIND = f"SELECT {_COLUMNS} FROM responses WHERE response_id = ?"
_PRUNE = "DELETE FROM responses WHERE seq <= (SELECT MAX(seq) FROM responses) - ?"

_Row = tuple[str, str, str, str, int]


@dataclass(frozen=True, slots=True)
class StoredResponse:
    tenant: str
    instance_id: str
    chain_root: str  # the chain's first response id
    context_tokens: int  # prompt + output tokens of the response


class ResponsePlacement:
    """response id -> `StoredResponse`, bounded, persisted. `store`: the router's store (opened
    and closed by its owner), a path (an embedded store of its own), or None: memory only.
    `wait_s`: with a shared store, the most a response waits for its placement's write and a
    follow-up for its read."""

    def __init__(
        self,
        store: Store | Path | None,
        *,
        max_entries: int = 100_000,
        flush_every_s: float = 0.5,
        wait_s: float = WAIT_S,
    ) -> None:
        self._owned = isinstance(store, Path)
        self.store: Store | None = SqliteStore(store) if isinstance(store, Path) else store
        self.max_entries = max(1, max_entries)
        self.flush_every_s = flush_every_s
        self.wait_s = wait_s
        # PostgreSQL: replicas share the table, placements are written before the final bytes
        self.shared = self.store is not None and self.store.dialect == "postgresql"
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._pending: list[tuple[str, StoredResponse]] = []
        self._open = False
        self._conn: LoopConnection | None = None  # shared: writes and reads on the loop
        self._queue: list[tuple[str, StoredResponse]] = []  # shared: for the next statement
        self._waiters: list[asyncio.Future[bool]] = []  # the queued placements' responses
        self._sender: asyncio.Task[None] | None = None  # shared: the statement in flight
        # shared: writes neither carried by the ledger nor sent yet, oldest first (the flush
        # sends those older than `wait_s`, nobody having awaited them; close sends them all)
        self._unresolved: dict[PlacementWrite, None] = {}
        self._unpruned = False  # shared: rows written since the last prune
        self.written = 0  # shared: placements written before their response's final bytes
        self.written_with_record = 0  # of them, in the statement of the ledger's record
        self.failed_writes = 0  # shared: placements whose write failed (retried by the flush)
        self._failing = False  # shared: the last write failed (say so once, and when it heals)
        self.fetched = 0  # shared: follow-ups found in the store, not in memory
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
            if self.shared and self._conn is None:
                from router.store import PostgresStore
                from router.store.loop_connection import LoopConnection

                assert isinstance(self.store, PostgresStore)
                self._conn = LoopConnection(self.store, "gpupool-responses", timeout_s=self.wait_s)
                await self._conn.open()
        self._flush_loop.start()

    async def aclose(self) -> None:
        await self._flush_loop.aclose()
        for write in list(self._unresolved):
            write.declined()
        if self._sender is not None:
            await asyncio.gather(self._sender, return_exceptions=True)
        self._pending.extend(self._queue)  # none unless closed before the sender ran
        self._queue = []
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(False)
        self._waiters = []
        await self.flush()
        if self._conn is not None:
            await self._conn.aclose()
            self._conn = None
        if self._open and self.store is not None and self._owned:
            await asyncio.to_thread(self.store.close)
        self._open = False

    def _load(self, store: Store) -> None:
        if self._owned:
            store.open()
        migrate(store, MIGRATIONS)
        with store.connection() as conn:
            rows = conn.execute(
                f"SELECT {_COLUMNS} FROM responses ORDER BY seq DESC LIMIT ?",
                (self.max_entries,),
            ).fetchall()
        for rid, tenant, instance_id, root, tokens in reversed(rows):
            self._entries[rid] = StoredResponse(tenant, instance_id, root, int(tokens))

    # ------------------------------------------------------------------ the request path

    def get(self, response_id: str) -> StoredResponse | None:
        """What this replica knows (no I/O); with a shared store a miss may be found by
        `fetch`."""
        return self._entries.get(response_id)

    def remember(self, response_id: str, stored: StoredResponse) -> PlacementWrite | None:
        """Keep a stored response's place. Shared store: its write, for the response's final
        bytes to await (see `PlacementWrite`); None otherwise (written with the next flush)."""
        self._keep(response_id, stored)
        if self.store is None:
            return None
        if not (self.shared and self._open):
            self._pending.append((response_id, stored))
            return None
        write = PlacementWrite(self, response_id, stored, asyncio.get_running_loop().time())
        self._unresolved[write] = None
        return write

    def _enqueue(self, response_id: str, stored: StoredResponse) -> asyncio.Future[bool]:
        """Write it now on the placement's own connection (with others queued meanwhile);
        the future answers True once it is in the store, False when that failed or took
        longer than `wait_s` (retried by the next flush)."""
        waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._queue.append((response_id, stored))
        self._waiters.append(waiter)
        if self._sender is None:
            self._sender = asyncio.ensure_future(self._send())
        return waiter

    async def fetch(self, response_id: str) -> StoredResponse | None:
        """A response another replica stored (shared store; None otherwise, or when no
        replica did, or it is older than the newest `max_entries`): one SELECT, kept in memory
        once found. Raises `StoreUnavailable` when the store cannot answer within `wait_s`."""
        if not (self.shared and self._open) or self.store is None:
            return None
        conn = self._conn
        try:
            if conn is not None and conn.ready():
                rows = await conn.execute(_FIND, (response_id,))
            else:  # a write in flight there, or reconnecting: a pooled connection
                async with asyncio.timeout(self.wait_s):
                    rows = await asyncio.to_thread(_find, self.store, response_id)
        except Exception as err:
            log.warning("response placement: the store did not answer a lookup: %s", err)
            raise StoreUnavailable(
                f"the previous response's place is kept in the shared store, which did not "
                f"answer ({type(err).__name__}: {str(err)[:200] or 'no answer'}); retry",
                "store_unavailable",
                retry_after_s=1.0,
            ) from None
        if not rows:
            return None
        _, tenant, instance_id, root, tokens = rows[0]
        stored = StoredResponse(tenant, instance_id, root, int(tokens))
        self._keep(response_id, stored)
        self.fetched += 1
        return stored

    def _keep(self, response_id: str, stored: StoredResponse) -> None:
        self._entries[response_id] = stored
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    async def _send(self) -> None:
        """Write what is queued, one statement at a time, until nothing is; each statement's
        waiters answered when it ends."""
        try:
            while self._queue:
                rows, self._queue = _latest(self._queue), []
                waiters, self._waiters = self._waiters, []
                ok = await self._write_now(rows, waiters)
                if not ok:
                    self.failed_writes += len(waiters)
                    self._pending.extend(rows)  # the next flush retries them
                else:
                    self.written += len(waiters)
                    self._unpruned = True
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(ok)
        finally:
            self._sender = None

    async def _write_now(
        self, rows: list[tuple[str, StoredResponse]], waiters: list[asyncio.Future[bool]]
    ) -> bool:
        """One upsert of `rows`: on the loop's connection when it is idle, else (reconnecting)
        from a worker thread; its waiters answered False after `wait_s` (the write goes on)."""
        conn = self._conn
        params = [v for rid, s in rows for v in _row(rid, s)]
        try:
            if conn is not None and conn.ready():
                await conn.execute(_upsert_sql(len(rows)), params)
            else:
                await self._write_in_thread(len(rows), params, waiters)
        except Exception as err:
            if not self._failing:
                log.warning(
                    "response placement: writing %d placements failed (kept here, retried "
                    "every %g s; other replicas cannot find them until then): %s",
                    len(rows),
                    self.flush_every_s,
                    err,
                )
            self._failing = True
            return False
        if self._failing:
            log.warning("response placement: the store takes placements again")
            self._failing = False
        return True

    async def _write_in_thread(
        self, n: int, params: list[Any], waiters: list[asyncio.Future[bool]]
    ) -> None:
        timer = asyncio.get_running_loop().call_later(self.wait_s, _answer, waiters, False)
        try:
            assert self.store is not None
            await asyncio.to_thread(_upsert, self.store, n, params)
        finally:
            timer.cancel()

    # ------------------------------------------------------------------ disk

    async def flush(self) -> None:
        if not self._open or self.store is None:
            return
        if self._unresolved:  # made over `wait_s` ago, and still neither carried nor sent
            too_old_s = asyncio.get_running_loop().time() - self.wait_s
            for write in [w for w in self._unresolved if w.made_s < too_old_s]:
                write.declined()
        if not self._pending:
            if self._unpruned:  # shared: the rows beyond the bound, off the request path
                self._unpruned = False
                await asyncio.to_thread(self._prune, self.store)
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
                f"INSERT INTO responses ({_COLUMNS}) VALUES (?, ?, ?, ?, ?)",
                [_row(rid, s) for rid, s in rows],
            )
            conn.execute(_PRUNE, (self.max_entries,))

    def _prune(self, store: Store) -> None:
        with store.connection() as conn:
            conn.execute(_PRUNE, (self.max_entries,))


class PlacementWrite:
    """A placement's write to the shared store before its response's final bytes. It is
    offered to the ledger first (a `RecordCompanion`: `outcome.with_record`), which commits
    it in the statement of the response's record when that goes as a lone commit on the loop
    (`carried`: no statement of its own); otherwise (`declined`: the ledger's group commit,
    an agent step numbered with its record, a failed commit) it is sent at once on the
    placement's own connection, beside the ledger's commit. Awaiting it (after the ledger's
    commit) gives True once it is in the store, False when its write failed or took longer
    than `wait_s` (kept in memory, retried by the flush); not offered, it is sent then;
    neither offered nor awaited, the flush sends it after `wait_s`, the close at once."""

    __slots__ = (
        "_carried",
        "_placement",
        "_stored",
        "_waiter",
        "made_s",
        "params",
        "response_id",
        "sql",
    )

    def __init__(
        self, placement: ResponsePlacement, response_id: str, stored: StoredResponse, made_s: float
    ) -> None:
        self._placement = placement
        self.response_id = response_id
        self.made_s = made_s  # loop time
        self._stored = stored
        self.sql = _upsert_sql(1)
        self.params: Sequence[Any] = _row(response_id, stored)
        self._carried = False
        self._waiter: asyncio.Future[bool] | None = None

    def carried(self) -> None:
        if not self._carried:
            self._carried = True
            placement = self._placement
            placement._unresolved.pop(self, None)
            placement.written += 1
            placement.written_with_record += 1
            placement._unpruned = True

    def declined(self) -> None:
        if not self._carried and self._waiter is None:
            self._placement._unresolved.pop(self, None)
            self._waiter = self._placement._enqueue(self.response_id, self._stored)

    def __await__(self) -> Generator[Any, None, bool]:
        return self._wait().__await__()

    async def _wait(self) -> bool:
        if self._carried:
            return True
        self.declined()
        assert self._waiter is not None
        return await self._waiter


def _row(response_id: str, s: StoredResponse) -> _Row:
    return (response_id, s.tenant, s.instance_id, s.chain_root, s.context_tokens)


@functools.lru_cache(maxsize=64)
def _upsert_sql(n: int) -> str:
    """PostgreSQL: `n` placements in one statement; a response id given again takes a new
    `seq` (the newest, as the embedded store's delete and insert give it)."""
    values = ", ".join(["(?, ?, ?, ?, ?)"] * n)
    return (
        f"INSERT INTO responses ({_COLUMNS}) VALUES {values} ON CONFLICT (response_id) DO UPDATE"
        " SET seq = DEFAULT, tenant = excluded.tenant, instance_id = excluded.instance_id,"
        " chain_root = excluded.chain_root, context_tokens = excluded.context_tokens"
    )


def _upsert(store: Store, n: int, params: list[Any]) -> None:
    with store.connection() as conn:
        conn.execute(_upsert_sql(n), params)


def _find(store: Store, response_id: str) -> list[Any]:
    with store.connection() as conn:
        return list(conn.execute(_FIND, (response_id,)).fetchall())


def _answer(waiters: list[asyncio.Future[bool]], ok: bool) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(ok)


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
