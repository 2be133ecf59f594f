"""The governor's shared half, when `store.url` is set: router replicas on one database share
each tenant's token and request budgets, concurrency slots and cost windows.

- Budgets, in chunks. A request's reservation comes out of this replica's lease on the tenant's
  bucket; when the lease does not hold it, one transaction takes at least the shortfall and up
  to `budget_chunk_frac` of the bucket from the shared bucket (router/governance/shared.py),
  one top-up per bucket at a time (the requests that arrive meanwhile wait for it, then take
  from the lease it filled: a top-up leaves less than one chunk unused; what finished requests
  give back adds to it until the sweep).
  Settling (the request used less or more) goes back into the lease; the governance sweep
  (every second) gives each lease back to the shared bucket, or charges its debt. What was
  taken from the database is never taken twice, so replicas together never spend more than
  the shared bucket held (plus what requests use beyond their estimates, as in one process);
  the price is that up to one chunk per replica may sit in a lease, unused, for a second.
- Slots: `max_concurrent_requests` and `max_concurrent_runs` are slots in the database, held
  by `<replica>:<request or run>`, renewed every sweep, released when the request or run
  ends; a replica that dies gives them back after `store.slot_lease_s`. A request's slot is
  handed over: when the request ends, its slot waits `HANDOVER_S` (10 ms) for the tenant's
  next request on this replica, which takes it without a round trip (the database's count
  does not change: one request in flight ends, the next begins); nobody came, it is released
  then. So a tenant's requests that follow each other on one replica take no round trip
  for their slot (and release none), and the others see a freed slot up to `HANDOVER_S`
  later: the limit is never exceeded, and a request may be refused for at most that long
  after a slot freed on another replica (docs/replicas.md).
- Step numbers: a run's steps are numbered in the store as they are admitted, so steps that
  go to different replicas never share a number (a step refused after it was numbered leaves
  a gap; during an outage the ledger numbers from the replica's memory).
- A session's runs: a session's step (`begin`/`next_step` given a `SessionStep`) sends
  `SESSION_STEP_SQL` instead of `NEXT_STEP_SQL`: the store maps its task anchor to the
  session's run and numbers the step in it, one statement, so every replica gives a task the
  same run; a run that ends forgets its anchors there (`forget_session_run`, background).
- Active time (`max_duration_s`): the step's statement and the sweep's update of a run's
  counters (its steps' ends, told with how long ago they ended) carry the run's stretch
  here (how long it has been active without a pause), and the store counts the run's active
  time on the database's clock across replicas (router/governance/shared.py: `RUN_ACTIVE`).
- Cost windows: each replica publishes its hourly and daily GPU-seconds slices every sweep
  and reads the others' (a cap is seen up to one sweep late).
- An outage (a call fails: `StoreError` or the driver's error): logged once, loudly; the
  metric `gpupool_governance_store_up` goes to 0 and the request path stops asking the
  database. `budgets_on_outage: open` admits against the replica's own buckets and lets
  leases run into debt; `closed` refuses what the lease does not cover (503). The sweep keeps
  trying; the first sweep that gets through gives back the leases and charges the debts (the
  reconciliation) and the request path uses the database again.

Every call runs in a worker thread (`asyncio.to_thread`), bounded by the store's
`connect_timeout_s` and `statement_timeout_s`, but for those a request waits for on
PostgreSQL (its tier's slot, an agent step's number, or both in one statement for a governed
step) and the small ones after it (a slot's release, a run's home): one statement each, sent
from the event loop on a connection of their own when it is idle (no thread hand-over),
bounded by `connect_timeout_s`. Lease arithmetic happens on the event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from router.errors import StoreUnavailable
from router.governance.borrowing import Terms
from router.governance.metrics import GovernanceMetrics
from router.governance.runtable import MAX_ANCHORS
from router.governance.shared import (
    ACQUIRE_SLOT_SQL,
    HELD_ELSEWHERE,
    LEASE_CHANNEL,
    LEASE_SEPARATOR,
    LEASE_STEP_SQL,
    NEXT_STEP_SQL,
    RECORD_HOME_SQL,
    RELEASE_SLOT_SQL,
    SESSION_STEP_SQL,
    SLOT_AND_LEASE_STEP_SQL,
    SLOT_AND_SESSION_STEP_SQL,
    SLOT_AND_STEP_SQL,
    HeldRun,
    Loan,
    NextStep,
    RunUsageRow,
    SessionStep,
    SharedBudgets,
    SharedLevel,
    Slices,
    Stretch,
    leasable,
)
from router.store import Store, StoreError
from router.store.leader import new_replica_id

if TYPE_CHECKING:
    from router.store.loop_connection import LoopConnection

__all__ = ["ReplicaBudgets", "new_replica_id"]

log = logging.getLogger(__name__)

T = TypeVar("T")
Row = tuple[Any, ...]
OutagePolicy = Literal["open", "closed"]
OUTAGE_RETRY_AFTER_S = 1.0  # what a refusal under `closed` tells the client (one sweep)
# how long a finished request's slot waits for its tenant's next request on this replica (the
# hand-over) before it is released: the longest a freed slot stays unseen by the others
HANDOVER_S = 0.01
READ_TIMEOUT_S = 5.0  # GET /v1/budget's read (PostgreSQL: the store's connect timeout)


class _Down(Exception):
    """The store did not answer (the outage has been recorded)."""


class ReplicaBudgets:
    def __init__(
        self,
        store: Store,
        metrics: GovernanceMetrics,
        *,
        on_outage: OutagePolicy,
        chunk_frac: float,
        slot_lease_s: float,
        wall_clock: Callable[[], float],
        replica_id: str | None = None,
        handover_s: float = HANDOVER_S,
        clock: Callable[[], float] = time.monotonic,
        idle_timeout_s: float = math.inf,
    ) -> None:
        self.db = SharedBudgets(store)
        self.replica = replica_id or new_replica_id()
        self.on_outage = on_outage
        self.chunk_frac = chunk_frac
        self.slot_lease_s = slot_lease_s
        self.metrics = metrics
        self._wall = wall_clock
        self._errors: tuple[type[Exception], ...] = (StoreError, *store.errors)
        self.leases: dict[tuple[str, str], float] = {}  # (tenant, bucket) -> units held
        # each shared bucket's level as this replica last read it (a top-up, the sweep,
        # `GET /v1/budget`): what the x-ratelimit-* headers show without a round trip
        self.learned: dict[tuple[str, str], SharedLevel] = {}
        # top-ups started and under way: a read that overlapped one may miss its take while
        # the lease already holds it, so it is not kept (`_read_from`, `_read_clean`)
        self._top_ups = self._topping_now = 0
        self.down_since_s: float | None = None  # unix time of the failure that began it
        self._pending: set[asyncio.Task[None]] = set()  # slot releases, homes under way
        self._topping: dict[tuple[str, str], asyncio.Lock] = {}  # a top-up under way
        self._unreleased: list[tuple[str, str]] = []  # (slot key, holder) for the next sweep
        # finished requests' slots waiting for their tenant's next request here (the
        # hand-over): slot key -> (holder, the timer that releases it), oldest first
        self.handover_s = handover_s
        self._parked: dict[str, list[tuple[str, asyncio.TimerHandle]]] = {}
        self.handovers = 0  # requests that took a parked slot (no round trip for it)
        # runs' settled usage not yet added to the shared counters: (tenant, run) -> (tokens,
        # GPU-seconds, its steps' ends here: (when on `clock`, the stretch then), oldest
        # first, one per stretch), added by the next sweep
        self.run_usage: dict[tuple[str, str], _Usage] = {}
        self._clock = clock  # monotonic: how long ago a step ended, told to the store
        # `governance.run_idle_timeout_s`: a longer gap with no step in flight is a pause,
        # which a run's active time across replicas leaves out as each replica's does
        self.idle_timeout_s = idle_timeout_s
        self._closed = False
        # the latest `begin`: (its task, the statement it sent on the loop's connection)
        self._begun: tuple[asyncio.Task[Any], asyncio.Task[list[Row]]] | None = None
        # PostgreSQL: a request's slot and its step number are one statement each, awaited on
        # the loop (router/store/loop_connection.py) while that connection is idle, else in a
        # worker thread as every other call
        self._loop: LoopConnection | None = None
        # the statements nobody waits for (a slot's release after its response) on one of
        # their own: on the first, the next request's slot would find the release in flight
        # (at c=1 one request in 5-20 did) and take the thread path
        self._loop_background: LoopConnection | None = None
        self.read_timeout_s = READ_TIMEOUT_S  # GET /v1/budget's read of the shared levels
        # a run's numbering under a lease (PostgreSQL, set by the governor): a run's step
        # numbered in the store (not a session's) makes this replica its holder for this long
        # (`LEASE_STEP_SQL`); None: no leases, `NEXT_STEP_SQL`
        self.run_lease_s: float | None = None
        if store.dialect == "postgresql":
            from router.store import PostgresStore
            from router.store.loop_connection import LoopConnection

            assert isinstance(store, PostgresStore)
            self.read_timeout_s = store.connect_timeout_s
            self._loop = LoopConnection(
                store, "gpupool-governance", timeout_s=store.connect_timeout_s
            )
            self._loop_background = LoopConnection(
                store, "gpupool-governance-background", timeout_s=store.connect_timeout_s
            )
        metrics.store_up.set(1)

    # ------------------------------------------------------------------ calls

    async def _call(self, fn: Callable[[], T]) -> T:
        try:
            return await asyncio.to_thread(fn)
        except self._errors as err:
            self._down(err)
            raise _Down from err

    async def _statement(
        self,
        sql: str,
        params: Sequence[object],
        fn: Callable[[], T],
        *,
        waited: bool = True,
        sent: asyncio.Task[list[Row]] | None = None,
    ) -> T | Row:
        """One statement on the loop's connection when it is idle (its first row; () when
        it returns none), else
        `fn` in a worker thread (also when the loop's call fails: the thread's call then
        decides whether the store is down; but a call the server did not answer within the
        bound is an outage at once). `waited`: a request waits for the answer (polled for on
        the loop, router/store/loop_connection.py); else it runs in the background, on a
        connection of its own. `sent`: the statement, sent already (`LoopConnection.begin`)."""
        loop = self._loop if waited else self._loop_background
        if sent is not None or (loop is not None and loop.ready()):
            try:
                if sent is not None:
                    rows = await sent
                else:
                    assert loop is not None
                    rows = await loop.execute(sql, params, spin=waited)
                return rows[0] if rows else ()
            except TimeoutError as err:  # a hung server: the thread would wait as long again
                self._down(err)
                raise _Down from err
            except self._errors:
                pass
        return await self._call(fn)

    def _down(self, err: BaseException) -> None:
        if self.down_since_s is not None:
            return
        self.down_since_s = self._wall()
        # a parked slot is not handed over while the store is down (its row is not renewed
        # and may expire): released by the reconnecting sweep
        for key, holders in self._parked.items():
            for holder, timer in holders:
                timer.cancel()
                self._unreleased.append((key, holder))
        self._parked.clear()
        self.metrics.store_up.set(0)
        log.error(
            "the governance store %s cannot be reached (%s): budgets fail %s until it answers (%s)",
            self.db.store.name,
            str(err).splitlines()[0] if str(err) else type(err).__name__,
            self.on_outage.upper(),
            "each replica admits against its own buckets and charges the shared ones on reconnect"
            if self.on_outage == "open"
            else "requests its reserved chunk does not cover are refused with 503",
        )

    def _outage(self, tenant: str, what: str, *, counted: bool = True) -> None:
        """A decision the database cannot make now: admit (open) or refuse (closed)."""
        if counted:
            self.metrics.outage_requests.labels(tenant, self.on_outage).inc()
        if self.on_outage == "closed":
            raise StoreUnavailable(
                f"tenant {tenant!r}'s {what} are kept in the shared store, which cannot be"
                " reached (store.budgets_on_outage: closed)",
                "store_unavailable",
                retry_after_s=OUTAGE_RETRY_AFTER_S,
            )

    # ------------------------------------------------------------------ budgets

    async def take(
        self,
        tenant: str,
        bucket: str,
        amount: float,
        *,
        capacity: float,
        rate_per_s: float,
        decides: bool = True,
    ) -> float:
        """Take `amount` from the lease, topping it up from the shared bucket. Returns 0.0
        when taken, else the seconds until the shared bucket will hold it (nothing taken).
        During an outage: taken on debt (open) or `StoreUnavailable` (closed); counted as an
        outage decision unless `decides` is false (a borrower past its own bucket: the
        caller refuses it on that bucket instead)."""
        key = (tenant, bucket)
        if self._from_lease(key, amount):
            return 0.0
        lock = self._topping.get(key)
        if lock is None:
            lock = self._topping[key] = asyncio.Lock()
        async with lock:  # one top-up at a time: the others then find it in the lease
            return await self._top_up(key, amount, capacity, rate_per_s, decides)

    def _from_lease(self, key: tuple[str, str], amount: float) -> bool:
        held = self.leases.get(key, 0.0)
        if held < amount:
            return False
        self.leases[key] = held - amount
        return True

    async def _top_up(
        self,
        key: tuple[str, str],
        amount: float,
        capacity: float,
        rate_per_s: float,
        decides: bool = True,
    ) -> float:
        if self._from_lease(key, amount):
            return 0.0
        tenant, bucket = key
        held = self.leases.get(key, 0.0)
        if self.down_since_s is None:
            least = amount - held
            try:
                most, now_s = max(least, self.chunk_frac * capacity), self._wall()
                self._top_ups += 1
                self._topping_now += 1
                try:
                    taken, level = await self._call(
                        lambda: self.db.reserve_up_to(
                            tenant,
                            bucket,
                            least,
                            most,
                            now_s,
                            capacity=capacity,
                            rate_per_s=rate_per_s,
                        )
                    )
                finally:
                    self._topping_now -= 1
            except _Down:
                pass
            else:
                self._learn(key, SharedLevel(level, now_s, capacity, rate_per_s))
                if taken <= 0.0:
                    return max(1e-3, (min(least, capacity) - level) / rate_per_s)
                self.metrics.shared_reservations.labels(tenant, bucket).inc()
                self.leases[key] = self.leases.get(key, 0.0) + taken - amount
                return 0.0
        self._outage(tenant, f"{bucket} budget", counted=decides)
        self.leases[key] = self.leases.get(key, 0.0) - amount  # a debt, charged on reconnect
        return 0.0

    def _learn(self, key: tuple[str, str], seen: SharedLevel) -> None:
        """Keep the latest read of a shared bucket (reads may come back out of order)."""
        known = self.learned.get(key)
        if known is None or seen.at_s >= known.at_s:
            self.learned[key] = seen

    def _read_from(self) -> int | None:
        """Before a read of the levels: a mark for `_read_clean` (None: a top-up is under way)."""
        return None if self._topping_now else self._top_ups

    def _read_clean(self, mark: int | None) -> bool:
        """After it: no top-up overlapped the read (its levels and the leases agree)."""
        return mark is not None and mark == self._top_ups

    def shared_level(self, tenant: str, bucket: str) -> tuple[float, float] | None:
        """What this replica may spend of the tenant's shared bucket now as it last learned
        it: (the bucket's level then, refilled since, plus this replica's lease (negative: its
        debt), that read's age in seconds); None when it learned none or the store is down.
        Other replicas' spending since the read is not in it (docs/replicas.md: the bound)."""
        seen = self.learned.get((tenant, bucket))
        if seen is None or self.down_since_s is not None:
            return None
        now_s = self._wall()
        held = self.leases.get((tenant, bucket), 0.0)
        return seen.at(now_s) + held, max(0.0, now_s - seen.at_s)

    async def read_levels(
        self, tenant: str, buckets: Sequence[tuple[str, float, float]]
    ) -> str | None:
        """Read the tenant's shared buckets (`(bucket, capacity, rate_per_s)`; one never used
        is full) now, for `GET /v1/budget`. Returns None when read, else why not. A failed
        read does not start an outage (the sweep decides that; the request path is not
        affected) and takes at most `read_timeout_s` (the store's connect timeout)."""
        if self.down_since_s is not None:
            return "the shared store cannot be reached (store.budgets_on_outage applies)"
        now_s, mark, timeout_s = self._wall(), self._read_from(), self.read_timeout_s
        try:
            read = await asyncio.wait_for(
                asyncio.to_thread(self.db.levels, [tenant], now_s), timeout=timeout_s
            )
        except TimeoutError:
            return f"the shared store did not answer within {timeout_s:g} s"
        except self._errors as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            return f"the shared store did not answer: {first}"
        if not self._read_clean(mark):  # the top-up's own read is as fresh
            return None
        for bucket, capacity, rate_per_s in buckets:
            key = (tenant, bucket)
            self._learn(key, read.get(key) or SharedLevel(capacity, now_s, capacity, rate_per_s))
        return None

    async def borrow(self, tenant: str, need: float, terms: Terms) -> Loan | None:
        """`need` tokens with the shortfall borrowed from an idle tenant's shared bucket (one
        statement: `SharedBudgets.borrow`), after `take` found the tenant's own short. The
        part from the lease comes out of it here. None: not borrowed (nothing lendable, the
        allowance spent, or the store down: no borrowing during an outage)."""
        if self.down_since_s is not None:
            return None
        key, now_s = (tenant, "tokens"), self._wall()
        lease = self.leases.get(key, 0.0)
        try:
            loan = await self._call(lambda: self.db.borrow(tenant, need, lease, now_s, terms))
        except _Down:
            return None
        if loan is not None:
            self.leases[key] = self.leases.get(key, 0.0) - loan.from_lease
        return loan

    def give(self, tenant: str, bucket: str, amount: float) -> None:
        """Put `amount` back into the lease (negative: a request used more than it took)."""
        if amount != 0.0:
            key = (tenant, bucket)
            self.leases[key] = self.leases.get(key, 0.0) + amount

    # ------------------------------------------------------------------ slots

    def begin(
        self,
        tenant: str,
        request_id: str,
        limit: int | None,
        run_id: str | None,
        session: SessionStep | None = None,
        span_s: float = 0.0,
    ) -> asyncio.Task[tuple[bool, str | None, NextStep | None]]:
        """A request's slot (`limit`: its tier's `max_concurrent_requests`, None: no tier),
        then, when admitted, its run's next step (`run_id`), as `acquire` and `next_step`:
        (admitted, the slot's holder to release, the step). The first statement is sent
        before this returns when the loop's connection is idle, so its round trip overlaps
        what the request does before it awaits the task (router/governance/governor.py);
        a holder the task got is the caller's to release, awaited or not. A slot parked by
        the tenant's previous request here is taken at once (the hand-over): then only the
        step number, if any, is asked for. `session`: a session's step, whose run the store
        maps (`SESSION_STEP_SQL`: the answer's `NextStep.run`). `span_s`: how long the run
        has been active here without a pause (its active time across replicas)."""
        now_s = self._wall()
        sent: asyncio.Task[list[Row]] | None = None
        handed = None if limit is None else self._take_parked(f"{tenant}/requests")
        if handed is not None:
            self.handovers += 1
            if run_id is not None and self._loop is not None and self._loop.ready():
                sent = self._loop.begin(*self._step_sql(tenant, run_id, session, now_s, span_s))
            task = asyncio.get_running_loop().create_task(
                self._handed_over(tenant, handed, run_id, sent, session, span_s)
            )
            self._begun = None if sent is None else (task, sent)
            return task
        if self.down_since_s is None and self._loop is not None and self._loop.ready():
            if limit is not None:
                params = self._slot_params(tenant, request_id, limit, now_s)
                if run_id is None:
                    sent = self._loop.begin(ACQUIRE_SLOT_SQL, params)
                else:  # both in one round trip
                    sent = self._loop.begin(
                        *self._slot_and_step_sql(params, tenant, run_id, session, now_s, span_s)
                    )
            elif run_id is not None:
                sent = self._loop.begin(*self._step_sql(tenant, run_id, session, now_s, span_s))
        task = asyncio.get_running_loop().create_task(
            self._slot_and_step(tenant, request_id, limit, run_id, now_s, sent, session, span_s)
        )
        self._begun = None if sent is None else (task, sent)
        return task

    async def _slot_and_step(
        self,
        tenant: str,
        request_id: str,
        limit: int | None,
        run_id: str | None,
        now_s: float,
        sent: asyncio.Task[list[Row]] | None,
        session: SessionStep | None = None,
        span_s: float = 0.0,
    ) -> tuple[bool, str | None, NextStep | None]:
        holder = None
        if limit is not None and run_id is not None:
            together = await self._slot_and_step_together(
                tenant, request_id, limit, run_id, now_s, sent, session, span_s
            )
            if together is not None:
                return together
            sent = None  # not answered on the loop: one call after the other, as below
        if limit is not None:
            admitted, holder = await self.acquire(
                tenant, "requests", request_id, limit, now_s=now_s, sent=sent
            )
            if not admitted:
                return False, None, None
            sent = None
        try:
            step = (
                None
                if run_id is None
                else await self.next_step(tenant, run_id, sent=sent, session=session, span_s=span_s)
            )
        except BaseException:
            if holder is not None:
                self.release(tenant, "requests", holder)
            raise
        return True, holder, step

    def _step_sql(
        self, tenant: str, run_id: str, session: SessionStep | None, now_s: float, span_s: float
    ) -> tuple[str, tuple[object, ...]]:
        """The statement that numbers a run's step: `NEXT_STEP_SQL`, or for a session's step
        `SESSION_STEP_SQL` (its run mapped by the store); either counts its active time."""
        stretch = Stretch(span_s, self.idle_timeout_s)
        if session is None and self.run_lease_s is not None and leasable(run_id):
            span, idle = stretch.params()
            return LEASE_STEP_SQL, (
                tenant,
                run_id,
                now_s,
                span,
                self.replica,
                self.run_lease_s,
                idle,
            )
        if session is None:
            return NEXT_STEP_SQL, (tenant, run_id, now_s, *stretch.params())
        return SESSION_STEP_SQL, session.params(tenant, now_s, MAX_ANCHORS, stretch)

    def _slot_and_step_sql(
        self,
        slot_params: tuple[object, ...],
        tenant: str,
        run_id: str,
        session: SessionStep | None,
        now_s: float,
        span_s: float,
    ) -> tuple[str, tuple[object, ...]]:
        """A request's slot and its run's step in one statement."""
        _, step = self._step_sql(tenant, run_id, session, now_s, span_s)
        both = SLOT_AND_STEP_SQL if session is None else SLOT_AND_SESSION_STEP_SQL
        if session is None and self.run_lease_s is not None and leasable(run_id):
            both = SLOT_AND_LEASE_STEP_SQL
        return both, (*slot_params, *step)

    def _slot_params(
        self, tenant: str, request_id: str, limit: int, now_s: float
    ) -> tuple[object, ...]:
        """`ACQUIRE_SLOT_SQL`'s parameters for a request's slot."""
        holder = self.holder(request_id)
        key = f"{tenant}/requests"
        return (key, holder, request_id, limit, now_s, now_s + self.slot_lease_s)

    async def _slot_and_step_together(
        self,
        tenant: str,
        request_id: str,
        limit: int,
        run_id: str,
        now_s: float,
        sent: asyncio.Task[list[Row]] | None,
        session: SessionStep | None = None,
        span_s: float = 0.0,
    ) -> tuple[bool, str | None, NextStep | None] | None:
        """A run's step that needs a request slot: the slot and, when granted, the step
        number in one statement on the loop's connection (`SLOT_AND_STEP_SQL`), as `acquire`
        then `next_step` would answer. None when the loop's connection did not answer it
        (busy, or an error other than a timeout): the caller asks one after the other."""
        loop = self._loop
        if sent is None and (self.down_since_s is not None or loop is None or not loop.ready()):
            return None
        slot = self._slot_params(tenant, request_id, limit, now_s)
        sql, both = self._slot_and_step_sql(slot, tenant, run_id, session, now_s, span_s)
        try:
            if sent is not None:
                rows = await sent
            else:
                assert loop is not None
                rows = await loop.execute(sql, both)
        except TimeoutError as err:  # a hung server: the outage's answer, as `acquire` gives
            self._down(err)
            self._outage(tenant, "concurrent requests")
            return True, None, None
        except self._errors:
            return None
        ok, *step = rows[0]
        if not ok:
            return False, None, None
        if step[0] is None:  # the slot granted, the run held by another replica's lease
            return True, self.holder(request_id), HELD_ELSEWHERE
        return True, self.holder(request_id), NextStep.from_row(step)

    async def _handed_over(
        self,
        tenant: str,
        holder: str,
        run_id: str | None,
        sent: asyncio.Task[list[Row]] | None,
        session: SessionStep | None = None,
        span_s: float = 0.0,
    ) -> tuple[bool, str | None, NextStep | None]:
        """`_slot_and_step` for a request that took a parked slot (`holder`)."""
        try:
            step = (
                None
                if run_id is None
                else await self.next_step(tenant, run_id, sent=sent, session=session, span_s=span_s)
            )
        except BaseException:
            self.release(tenant, "requests", holder)
            raise
        return True, holder, step

    def _take_parked(self, key: str) -> str | None:
        """A slot of `key` parked here (the newest; its release timer stopped), or None."""
        if self.down_since_s is not None or self._closed:
            return None
        holders = self._parked.get(key)
        if not holders:
            return None
        holder, timer = holders.pop()
        timer.cancel()
        if not holders:
            del self._parked[key]
        return holder

    def release_parked(self) -> int:
        """Release every parked slot now (a config reload may have lowered a limit; a test
        that wants a freed slot seen at once). Returns how many."""
        parked = [(key, holder) for key, hs in self._parked.items() for holder, _ in hs]
        for holders in self._parked.values():
            for _, timer in holders:
                timer.cancel()
        self._parked.clear()
        for key, holder in parked:
            self._release_now(key, holder)
        return len(parked)

    def parked(self) -> int:
        """Slots parked here, waiting for their tenant's next request."""
        return sum(len(holders) for holders in self._parked.values())

    async def acquire(
        self,
        tenant: str,
        kind: str,
        name: str,
        limit: int,
        *,
        now_s: float | None = None,
        sent: asyncio.Task[list[Row]] | None = None,
    ) -> tuple[bool, str | None]:
        """One of at most `limit` `kind` slots of `tenant` (requests, runs), held as
        `<replica>:<name>` and counted by `name` (a run whose steps run on two replicas holds
        a slot on each, renewed and released by each, and takes one of the `limit`).
        Returns (admitted, the holder to release): (False, None) when the limit is reached;
        (True, None) when the store is down and budgets fail open (admitted without a slot);
        `StoreUnavailable` when they fail closed. `now_s` and `sent`: as `begin` sent it."""
        holder = self.holder(name)
        if self.down_since_s is None or sent is not None:
            try:
                at_s, key = self._wall() if now_s is None else now_s, f"{tenant}/{kind}"
                got = await self._statement(
                    ACQUIRE_SLOT_SQL,
                    (key, holder, name, limit, at_s, at_s + self.slot_lease_s),
                    lambda: self.db.acquire_slot(
                        key, holder, limit, at_s, lease_s=self.slot_lease_s, unit=name
                    ),
                    sent=sent,
                )
            except _Down:
                pass
            else:
                admitted = bool(got[0]) if isinstance(got, tuple) else got
                return admitted, holder if admitted else None
        self._outage(tenant, f"concurrent {kind}")
        return True, None

    async def next_step(
        self,
        tenant: str,
        run_id: str,
        *,
        sent: asyncio.Task[list[Row]] | None = None,
        session: SessionStep | None = None,
        span_s: float = 0.0,
        waited: bool = True,
    ) -> NextStep | None:
        """The run's next step number (and its home) from the store; None while it cannot be
        reached (the ledger then numbers the step from this replica's memory). `sent`: as
        `begin` sent it. `session`: a session's step (the store maps its run: `run`).
        `span_s`: as `begin`'s. `waited`: False when nobody waits for the answer (the
        background connection, not polled: `_statement`)."""
        if self.down_since_s is not None and sent is None:
            return None
        now_s = self._wall()
        sql, params = self._step_sql(tenant, run_id, session, now_s, span_s)
        stretch = Stretch(span_s, self.idle_timeout_s)

        lease_s = self.run_lease_s

        def in_thread() -> NextStep:
            if session is None and lease_s is not None and leasable(run_id):
                return self.db.lease_step(tenant, run_id, now_s, self.replica, lease_s, stretch)
            if session is None:
                return self.db.next_step(tenant, run_id, now_s, stretch)
            return self.db.session_step(
                tenant, session, now_s, max_anchors=MAX_ANCHORS, stretch=stretch
            )

        try:
            got = await self._statement(sql, params, in_thread, waited=waited, sent=sent)
        except _Down:
            return None
        if got == ():  # no row: a live lease holds the run (`LEASE_STEP_SQL`)
            return HELD_ELSEWHERE
        return NextStep.from_row(got) if isinstance(got, tuple) else got

    async def write_held(
        self, runs: Sequence[HeldRun]
    ) -> list[tuple[str | None, bool] | None] | None:
        """The sweep's write of the runs this replica holds (`SharedBudgets.write_held`);
        None when the store cannot be reached (the leases then run out here)."""
        lease_s = self.run_lease_s
        if not runs or lease_s is None:
            return []
        try:
            return await self._call(lambda: self.db.write_held(self.replica, lease_s, runs))
        except _Down:
            return None

    def want_held(self, tenant: str, run_id: str) -> None:
        """Ask the holder of the run to hand it over at its next sweep (background)."""
        self._background(self._want_held(tenant, run_id))

    def hand_over(self, runs: Sequence[HeldRun]) -> None:
        """Write and let go the runs another replica asked for, now (background)."""
        self._background(self._hand_over(runs))

    async def _hand_over(self, runs: Sequence[HeldRun]) -> None:
        await self.write_held(runs)

    async def listen_wanted(self, on_wanted: Callable[[str, str], None]) -> None:
        """Until cancelled: the notifications of another replica asking for a run this
        replica holds (`WANT_HELD_SQL`), each as `on_wanted(tenant, run id)`, on a connection
        of its own (PostgreSQL; reconnected a second after it fails: the sweep reads the
        row's mark meanwhile)."""
        from router.store import PostgresStore

        store = self.db.store
        if not isinstance(store, PostgresStore):
            return
        while True:
            try:
                conn = await store.connect_async("gpupool-run-lease")
                try:
                    await conn.execute(f"LISTEN {LEASE_CHANNEL}")
                    async for note in conn.notifies():
                        holder, _, rest = note.payload.partition(LEASE_SEPARATOR)
                        tenant, _, run_id = rest.partition(LEASE_SEPARATOR)
                        if holder == self.replica:
                            on_wanted(tenant, run_id)
                finally:
                    await conn.close()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # the connection failed: the sweep's reads stand in
                log.warning("the run leases' listener stopped (%s); reconnecting", err)
            await asyncio.sleep(1.0)

    async def _want_held(self, tenant: str, run_id: str) -> None:
        with contextlib.suppress(_Down):  # recorded: the lease runs out instead
            await self._call(lambda: self.db.want_held(tenant, run_id))

    def step_statement(
        self, tenant: str, run_id: str, session: SessionStep | None = None, span_s: float = 0.0
    ) -> tuple[str, tuple[object, ...]]:
        """`next_step`'s statement and parameters, for a statement of another component to
        carry (the ledger's commit of the step's record, router/settlement.py)."""
        return self._step_sql(tenant, run_id, session, self._wall(), span_s)

    def number_later(self, tenant: str, run_id: str) -> None:
        """Count a step of the run in the store, in the background (a step sent on with no
        statement whose record was not committed with its number: its known number stands,
        and the next step here is numbered after it)."""
        self._background(self._number_later(tenant, run_id))

    async def _number_later(self, tenant: str, run_id: str) -> None:
        # nobody waits for it: the background connection, not polled (s47; on the loop's it
        # took the connection the next request's statement needs, and polled for its answer)
        await self.next_step(tenant, run_id, waited=False)

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` on the event loop, in the background (awaited at close), unless the
        store is down or closed (then it is dropped)."""
        if self.down_since_s is not None or self._closed:
            work.close()
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside the event loop
            work.close()
            return
        task = loop.create_task(work)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def unhurry(self, task: asyncio.Task[Any]) -> None:
        """The request `task` (`begin`'s) answers went on without its answer: its statement,
        when it is the one in flight on the loop's connection, is not polled for
        (`LoopConnection.unhurry`)."""
        if self._loop is not None and self._begun is not None and self._begun[0] is task:
            self._loop.unhurry(self._begun[1])

    def holder(self, name: str) -> str:
        return f"{self.replica}:{name}"

    def record_home(
        self,
        tenant: str,
        run_id: str,
        home: str,
        step: int,
        context_tokens: int,
        *,
        stored_home: str | None = None,
    ) -> None:
        """Step `step` of the run was answered by `home` (in the background, on the event
        loop; not while the store is down: the run's next step there keeps the replica's own
        home, and a later step's record replaces this one anyway).

        Not written when `stored_home`, the home the store gave this step (`next_step`), is
        `home` already: the store then names the right engine, with an older step number and
        context size (a replica adopting it counts fewer cached tokens than the engine holds,
        the cautious side). Bound: a step of the run that another replica answered elsewhere
        after this step read the store, and recorded before this one ends, stays the stored
        home (steps of one run overlapping in time)."""
        if self.down_since_s is not None or self._closed:
            return
        if stored_home == home:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside the event loop: the next step keeps the older home
            return
        task = loop.create_task(self._record_home(tenant, run_id, home, step, context_tokens))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _record_home(
        self, tenant: str, run_id: str, home: str, step: int, context_tokens: int
    ) -> None:
        params = (home, step, context_tokens, tenant, run_id, step)
        with contextlib.suppress(_Down):  # on the background connection when idle: no thread
            await self._statement(
                RECORD_HOME_SQL,
                params,
                lambda: self.db.record_home(tenant, run_id, home, step, context_tokens),
                waited=False,
            )

    def add_run_usage(
        self,
        tenant: str,
        run_id: str,
        tokens: int,
        gpu_seconds: float,
        *,
        ended_s: float | None = None,
        span_s: float = 0.0,
    ) -> None:
        """A step of the run settled: its usage, for the shared counters at the next sweep,
        and its end (`ended_s` on `clock`; the run active here for `span_s` before it), for
        the run's active time there."""
        key = (tenant, run_id)
        usage = self.run_usage.get(key)
        if usage is None:
            usage = self.run_usage[key] = _Usage()
        usage.add(tokens, gpu_seconds, ended_s, span_s)

    def pending_usage(self, tenant: str, run_id: str) -> tuple[int, float]:
        """The run's tokens and GPU-seconds settled here since the last sweep."""
        usage = self.run_usage.get((tenant, run_id))
        return (0, 0.0) if usage is None else (usage.tokens, usage.gpu_seconds)

    def forget_session_run(self, tenant: str, session_id: str, run: int) -> None:
        """The session's run ended here (its client ended it): its anchors are forgotten in
        the store, so its task's next step on any replica starts a new run (background)."""
        self._background(self._forget_session_run(tenant, session_id, run))

    async def _forget_session_run(self, tenant: str, session_id: str, run: int) -> None:
        try:
            await asyncio.to_thread(self.db.forget_session_run, tenant, session_id, run)
        except self._errors as err:
            self._down(err)

    async def adopt_session_runs(
        self, runs: Sequence[tuple[str, str, int, Sequence[tuple[str, int]]]]
    ) -> bool:
        """Hand the store what this replica numbered during an outage (`SharedBudgets.
        adopt_session_runs`). False: it could not (the outage goes on; kept for the next)."""
        now_s = self._wall()
        try:
            await self._call(lambda: self.db.adopt_session_runs(runs, now_s))
        except _Down:
            return False
        return True

    def mark_run(self, tenant: str, run_id: str, stop_code: str | None) -> None:
        """A guard stopped the run here (`stop_code`), or it ended (None: its id starts
        afresh on every replica), in the background. Its usage not yet added goes with it
        (ended: dropped, it was the old run's)."""
        if stop_code is None:
            self.run_usage.pop((tenant, run_id), None)
        self._background(self._mark_run(tenant, run_id, stop_code))

    async def _mark_run(self, tenant: str, run_id: str, stop_code: str | None) -> None:
        try:
            await asyncio.to_thread(self.db.mark_run, tenant, run_id, stop_code)
        except self._errors as err:
            self._down(err)

    def release(self, tenant: str, kind: str, holder: str) -> None:
        """Give a slot back (in the background; if that fails, the next sweep that gets
        through does). A request's slot is parked first: the tenant's next request here
        within `handover_s` takes it, else it is released then. Called outside the event
        loop, it is left to the next sweep."""
        key = f"{tenant}/{kind}"
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._unreleased.append((key, holder))
            return
        parking = self.handover_s > 0 and self.down_since_s is None and not self._closed
        if kind == "requests" and parking:
            timer = loop.call_later(self.handover_s, self._unpark, key, holder)
            self._parked.setdefault(key, []).append((holder, timer))
            return
        self._release_now(key, holder)

    def _unpark(self, key: str, holder: str) -> None:
        """Nobody took the parked slot within `handover_s`: release it."""
        holders = self._parked.get(key, [])
        for i, (parked, _) in enumerate(holders):
            if parked == holder:
                del holders[i]
                break
        if not holders:
            self._parked.pop(key, None)
        self._release_now(key, holder)

    def _release_now(self, key: str, holder: str) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._unreleased.append((key, holder))
            return
        task = loop.create_task(self._release(key, holder))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _release(self, key: str, holder: str) -> None:
        try:
            await self._statement(
                RELEASE_SLOT_SQL,
                (key, holder),
                lambda: self.db.release_slot(key, holder),
                waited=False,
            )
        except _Down:  # the reconnecting sweep releases it (its renewals would keep it)
            self._unreleased.append((key, holder))

    # ------------------------------------------------------------------ the sweep

    async def sync(
        self, windows: Sequence[tuple[str, Slices, Slices]], busy: Sequence[str] = ()
    ) -> dict[str, tuple[Slices, Slices]] | None:
        """The governance sweep's half: give back the leases (charge their debts), mark the
        `busy` tenants active (a request of theirs in flight or waiting here: not lenders),
        renew this replica's slots, publish its cost windows (`(tenant, hour, day)`, unix
        starts) and return the other replicas' (None when the store cannot be reached). The
        first sync that gets through after an outage is its reconciliation."""
        amounts = [(t, b, units) for (t, b), units in self.leases.items() if units != 0.0]
        for t, b, _ in amounts:
            self.leases[(t, b)] = 0.0
        now_s = self._wall()
        unreleased, self._unreleased = self._unreleased, []
        usage, self.run_usage = self.run_usage, {}
        rows = _usage_rows(usage, self._clock(), self.idle_timeout_s)
        mark = self._read_from()
        learned = [t for t, _ in self.learned]

        settled = added = False

        def work() -> tuple[dict[str, tuple[Slices, Slices]], dict[tuple[str, str], SharedLevel]]:
            nonlocal settled, added
            self.db.settle_many(amounts, busy, now_s)  # one transaction: all or none
            settled = True
            self.db.add_run_usage(rows)
            added = True
            for key, holder in unreleased:
                self.db.release_slot(key, holder)
            self.db.renew_slots(f"{self.replica}:", now_s, lease_s=self.slot_lease_s)
            others = self.db.publish_windows(self.replica, now_s, windows)
            # the buckets' levels with every lease given back: the headers' source is at
            # most one sweep old (docs/replicas.md)
            return others, self.db.levels(learned, now_s) if learned else {}

        try:
            others, levels = await asyncio.to_thread(work)
        except self._errors as err:
            if not settled:  # not given back: kept for the next sweep
                for t, b, units in amounts:
                    self.give(t, b, units)
            if not added:  # kept for the next sweep (with what settled meanwhile)
                for key, kept in usage.items():
                    self.run_usage[key] = kept.then(self.run_usage.get(key))
            self._unreleased.extend(unreleased)  # a second release deletes nothing
            self._down(err)
            return None
        if self.down_since_s is not None:
            debt = -sum(units for _, _, units in amounts if units < 0)
            log.warning(
                "the governance store %s answers again after %.1f s: budgets are shared again"
                " (%.0f units spent during the outage charged to the shared buckets)",
                self.db.store.name,
                now_s - self.down_since_s,
                debt,
            )
            self.down_since_s = None
            self.metrics.store_up.set(1)
        if self._read_clean(mark):
            for key, seen in levels.items():
                if key in self.learned:
                    self._learn(key, seen)
        return others

    async def aclose(self) -> None:
        """Leave: finish the releases under way, give back the leases and every slot.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        for holders in self._parked.values():  # released below with every slot of this replica
            for _, timer in holders:
                timer.cancel()
        self._parked.clear()
        for loop in (self._loop, self._loop_background):
            if loop is not None:
                await loop.aclose()
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        amounts = [(t, b, units) for (t, b), units in self.leases.items() if units != 0.0]
        self.leases.clear()

        def work() -> None:
            self.db.settle_many(amounts)
            self.db.release_slots(f"{self.replica}:")

        try:
            await asyncio.to_thread(work)
        except self._errors as err:
            log.warning("could not give back this replica's budget leases and slots: %s", err)


MAX_ENDS = 16  # a run's step ends kept between sweeps (an outage's: one per stretch)


class _Usage:
    """A run's usage settled here since the last sweep, and its steps' ends."""

    __slots__ = ("ends", "gpu_seconds", "tokens")

    def __init__(self) -> None:
        self.tokens = 0
        self.gpu_seconds = 0.0
        self.ends: list[tuple[float, float]] = []  # (when, the stretch then), oldest first

    def add(self, tokens: int, gpu_seconds: float, ended_s: float | None, span_s: float) -> None:
        self.tokens += tokens
        self.gpu_seconds += gpu_seconds
        if ended_s is None:
            return
        # an end whose stretch reaches back to the last one's covers it: one end per stretch
        while self.ends and ended_s - span_s <= self.ends[-1][0] <= ended_s:
            self.ends.pop()
        self.ends.append((ended_s, span_s))
        del self.ends[:-MAX_ENDS]

    def then(self, later: _Usage | None) -> _Usage:
        """This (not swept) followed by `later` (settled since), as one."""
        if later is not None:
            self.add(later.tokens, later.gpu_seconds, None, 0.0)
            for ended_s, span_s in later.ends:
                self.add(0, 0.0, ended_s, span_s)
        return self


def _usage_rows(
    usage: dict[tuple[str, str], _Usage], now_s: float, idle_s: float
) -> list[RunUsageRow]:
    """The sweep's rows: per run its usage with its first end, then its later ends."""
    rows = []
    for (tenant, run_id), u in usage.items():
        ends = u.ends or [(now_s, 0.0)]  # none (not expected): a point event now
        for i, (ended_s, span_s) in enumerate(ends):
            tokens, gpu_s = (u.tokens, u.gpu_seconds) if i == 0 else (0, 0.0)
            age_s = now_s - ended_s
            rows.append(RunUsageRow(tenant, run_id, tokens, gpu_s, age_s, span_s, idle_s))
    return rows
