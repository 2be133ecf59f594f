"""Leader election: which router replica runs the loops that must run once (the rebalancer's
decisions), so that several replicas on one PostgreSQL store do not each move the pool ratio.

- Embedded store (SQLite, one router): `SoleLeader`, the router is its own leader.
- PostgreSQL store: `AdvisoryLockLeader`. Each replica keeps one connection of its own
  (`PostgresStore.dedicated`, outside the pool) and every `check_s` (1 s) asks
  `pg_try_advisory_lock(key)` on it while it does not lead. A session-level advisory lock
  belongs to its session: it is released when the session ends, whether the replica closes
  it (a clean stop hands over at the others' next check), its process dies (the server sees
  the socket close), the server ends it (`pg_terminate_backend`, a restart) or the network
  drops it (TCP keepalives on both ends: about 11 s). Then another replica's next check takes
  it. The leader checks its own session every `check_s` too (one round trip that also reads
  who holds the lock, from `pg_locks` and `pg_stat_activity`'s `application_name`, which is
  `gpupool <replica>` cut to 63 bytes) and counts itself leader only while the last check
  that confirmed it is less than `valid_s` (3 checks) old: a leader whose check hangs (a
  partitioned network) stops acting after `valid_s`, before the server gives the lock away.

Every database call runs in the election's own thread (not asyncio's default executor, which
the router's other blocking calls share), one at a time. Handover after a leader dies:
at most `check_s` after its session ends (plus the keepalive time when the network, not the
process, died). docs/replicas.md has the numbers and the tests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import secrets
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from pools.periodic import Periodic
from router.store.base import Store, StoreError

if TYPE_CHECKING:  # psycopg is imported only when a PostgreSQL store elects a leader
    import psycopg

__all__ = [
    "REBALANCER_LOCK_KEY",
    "AdvisoryLockLeader",
    "Leadership",
    "SoleLeader",
    "leadership_for",
    "new_replica_id",
]

log = logging.getLogger(__name__)

# pg_try_advisory_lock key of the rebalancer's leader ("gpupool" and 1; the migrations use
# "gpupool" alone, as a transaction lock)
REBALANCER_LOCK_KEY = 0x6770_7570_6F6F_6C01
_T = TypeVar("_T")
CHECK_S = 1.0  # how often a replica asks for the lock / checks it still holds it
_VALID_CHECKS = 3  # a leader acts while its last confirmation is this many checks old

# who holds the lock: a bigint key is (classid, objid) = (high, low 32 bits), objsubid 1
_HOLDER = (
    "SELECT a.application_name, l.pid = pg_backend_pid() FROM pg_locks l"
    " LEFT JOIN pg_stat_activity a ON a.pid = l.pid"
    " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " AND l.classid::bigint = %s AND l.objid::bigint = %s"
)
_APP_PREFIX = "gpupool "


def new_replica_id() -> str:
    """`host:pid:random`: unique per router process (a restart is a new replica)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class Leadership(ABC):
    """Whether this replica leads, and who does. `start()` campaigns (or, embedded, leads at
    once), `aclose()` gives the leadership up; `on_change(leading)` is called on the event
    loop at each change."""

    replica: str
    on_change: Callable[[bool], None] | None = None

    @property
    @abstractmethod
    def leading(self) -> bool:
        """True while this replica may act as the leader."""

    @property
    @abstractmethod
    def leader(self) -> str | None:
        """The leading replica as last seen (None: none seen, or the store does not answer)."""

    @property
    @abstractmethod
    def how(self) -> str:
        """`embedded` or `advisory_lock`."""

    @abstractmethod
    async def start(self) -> None:
        """Begin campaigning."""

    @abstractmethod
    async def aclose(self) -> None:
        """Stop, giving the leadership up."""

    def view(self) -> dict[str, Any]:
        """What `GET /admin/pools` shows under `leader`."""
        return {
            "replica": self.replica,
            "leading": self.leading,
            "leader": self.leader,
            "election": self.how,
        }


class SoleLeader(Leadership):
    """The embedded store's: one router, which leads."""

    def __init__(self, replica: str) -> None:
        self.replica = replica

    @property
    def leading(self) -> bool:
        return True

    @property
    def leader(self) -> str | None:
        return self.replica

    @property
    def how(self) -> str:
        return "embedded"

    async def start(self) -> None:
        if self.on_change is not None:
            self.on_change(True)

    async def aclose(self) -> None:
        return None


class AdvisoryLockLeader(Leadership):
    """Leads while its own session holds the advisory lock `key` (see the module's notes).

    `connect(application_name)`: a new connection of its own (`PostgresStore.dedicated`),
    raising `StoreError` when none can be had. `clock`: monotonic seconds."""

    def __init__(
        self,
        connect: Callable[[str], psycopg.Connection[Any]],
        *,
        replica: str,
        store_name: str = "the store",
        key: int = REBALANCER_LOCK_KEY,
        check_s: float = CHECK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        import psycopg

        self._pg_error: type[Exception] = psycopg.Error
        self.replica = replica
        self.key = key
        self.check_s = check_s
        self.valid_s = _VALID_CHECKS * check_s
        self._connect = connect
        self._store_name = store_name
        self._clock = clock
        self._conn: psycopg.Connection[Any] | None = None  # touched in one thread at a time
        self._held = False
        self._confirmed_at_s: float | None = None
        self._leader: str | None = None
        self._was_leading = False
        self._failing = False  # the last check failed (logged once per run of failures)
        self._closing = False
        self._checking = asyncio.Lock()
        # its own thread: asyncio's default executor is shared with the router's other
        # blocking calls (the store's statements under load), behind which a check would queue
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        # a tick in a worker thread is let finish (its calls are bounded by the store's
        # timeouts), so the connection is never closed under it
        self._loop = Periodic(
            f"gpupool-leader-{key:x}", self.check, check_s, first_delay_s=0, interrupt_tick=False
        )

    @property
    def leading(self) -> bool:
        confirmed = self._confirmed_at_s
        return self._held and confirmed is not None and self._clock() - confirmed < self.valid_s

    @property
    def leader(self) -> str | None:
        return self._leader

    @property
    def how(self) -> str:
        return "advisory_lock"

    async def start(self) -> None:
        self._closing = False
        self._loop.start()

    async def _in_thread(self, call: Callable[[], _T]) -> _T:
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"gpupool-leader-{self.key:x}"
            )
        return await asyncio.get_running_loop().run_in_executor(self._thread, call)

    async def aclose(self) -> None:
        """Stop checking and close the session: the lock is free at once."""
        self._closing = True
        await self._loop.aclose()
        async with self._checking:
            await self._in_thread(self._drop)
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.shutdown(wait=False)
        self._held, self._confirmed_at_s = False, None
        self._leader = None
        self._changed()

    async def check(self) -> None:
        """One check: take the lock if free, confirm it if held, read who holds it."""
        async with self._checking:  # one at a time on the one session
            await self._check_once()

    async def _check_once(self) -> None:
        try:
            held, leader = await self._in_thread(self._check)
        except (StoreError, self._pg_error) as err:
            if not self._failing:
                log.warning(
                    "leader election on %s: no answer (%s)%s",
                    self._store_name,
                    str(err).splitlines()[0] if str(err) else type(err).__name__,
                    "; this replica stops leading" if self._held else "",
                )
            self._failing = True
            self._held, self._confirmed_at_s, self._leader = False, None, None
        else:
            self._failing = False
            self._held, self._leader = held, leader
            self._confirmed_at_s = self._clock() if held else None
        self._changed()

    def _changed(self) -> None:
        leading = self.leading
        if leading == self._was_leading:
            return
        self._was_leading = leading
        if leading:
            log.info("replica %s leads (advisory lock on %s)", self.replica, self._store_name)
        elif self._closing:
            log.info("replica %s gave the leadership up (stopping)", self.replica)
        else:
            log.warning("replica %s no longer leads", self.replica)
        if self.on_change is not None:
            self.on_change(leading)

    def _check(self) -> tuple[bool, str | None]:
        """Runs in the election's own thread. A session that fails (the server ended it) is
        replaced by a new one at once, which campaigns in the same check; a new one that fails
        raises."""
        for fresh in (False, True):
            conn = self._conn
            if fresh or conn is None or conn.closed or conn.broken:
                self._drop()
                self._held = False  # a new session holds nothing
                conn = self._conn = self._connect(_APP_PREFIX + self.replica)
                fresh = True
            try:
                if not self._held:
                    conn.execute("SELECT pg_try_advisory_lock(%s)", (self.key,))
                row = conn.execute(_HOLDER, (self.key >> 32, self.key & 0xFFFF_FFFF)).fetchone()
            except self._pg_error:
                self._drop()  # the session (and any lock it held) is gone or going
                if fresh:
                    raise
                continue
            if row is None:
                return False, None
            name = row[0]
            if isinstance(name, str) and name.startswith(_APP_PREFIX):
                name = name[len(_APP_PREFIX) :]
            return bool(row[1]), name
        raise AssertionError("unreachable: the fresh session's check returns or raises")

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(self._pg_error):
                conn.close()


def leadership_for(
    store: Store, replica: str, *, check_s: float = CHECK_S, key: int = REBALANCER_LOCK_KEY
) -> Leadership:
    """A PostgreSQL store's advisory lock; any other store's router leads alone."""
    if store.dialect == "postgresql":
        from router.store.postgres import PostgresStore

        assert isinstance(store, PostgresStore)
        return AdvisoryLockLeader(
            store.dedicated, replica=replica, store_name=store.name, key=key, check_s=check_s
        )
    return SoleLeader(replica)
