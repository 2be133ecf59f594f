"""The governance shell: tenant budgets and run guards on the request path.

    prepare(ctx, tenant, headers, body)  read the step's signals (run end, task type, history);
                                         a session's step gets its run, `<session>:<n>`
    await enter(ctx, estimate, signals)  guards, cost cap, concurrency, then reserve the
                                         tenant's tokens and request (waiting while its bucket
                                         refills, within the deadline); raises a refusal
    dispatched(outcome)                  the step reached an engine: it counts toward max_steps
    finished(outcome)                    settle to the real usage (a step the engine failed
                                         stops counting)
    rate_headers(tenant)                 OpenAI's x-ratelimit-* headers for a response (with a
                                         shared store: the shared budgets, as last learned)

`dispatched` and `finished` are called by `router.settlement.Settlement`, whose fixed order
puts governance after the meter (so the request's GPU-seconds are known) and before the ledger
and the learners; a run's end goes to `on_run_end` (the settlement's `run_ended`). State lives
in memory per tenant and per run; a background task
(`start()`/`aclose()`) ends runs that stay idle past `governance.run_idle_timeout_s`. Every
decision is made by the pure cores (`bucket`, `guards`, `loops`); this module only holds state
and answers in errors from `router.errors`.

A tenant's token bucket holds one minute of its `tokens_per_minute` and refills at that rate;
a request reserves its estimate (prompt + expected output) and settles to `usage` when it
ends. A request whose reservation does not fit waits (FIFO per tenant) while the bucket refills,
as long as the wait ends before both its deadline and its pool's `queue.max_wait_s`; else it is
refused at once with 429 `token_rate` (or `request_rate`) and the `Retry-After` at which the
bucket will hold it.

With `store.url` set (router replicas on one database) the limits are shared besides
(`replica.ReplicaBudgets`): a request also takes its tokens and request from the replica's
lease on the tenant's shared buckets, and a slot in the database for `max_concurrent_requests`
and (a run becoming active) `max_concurrent_runs`; cost caps add the other replicas' windows;
a run's step is numbered in the store (`dispatched` hands the number to the meter), and a
session's step is mapped there to its session's run by the same statement (`prepare` names it
with the replica's guess, `enter` takes the store's: docs/replicas.md, s45).
The local buckets still apply (they are what a store outage falls back on), but for a
borrower's tokens, which the shared buckets decide while the store answers: its shortfall is
borrowed from an idle tenant's shared bucket, out of its shared allowance, in one statement
(`_borrow_shared`; no borrowing during an outage: docs/replicas.md). Without a URL nothing of
this runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pools.config import Config, TenantConfig
from pools.periodic import Periodic
from router.admission.estimate import Estimate
from router.errors import BadRequest, GpupoolError, RateLimited, RunStopped, StoreUnavailable
from router.governance.borrowing import IDLE_AFTER_SWEEPS, LenderView, Terms, pick_lender
from router.governance.bucket import TokenBucket, WindowSum
from router.governance.guards import (
    STOP_FIELDS,
    RunLimits,
    RunState,
    Stop,
    active_span_s,
    active_time_s,
    check_step,
    touch,
)
from router.governance.headers import (
    BucketView,
    local_view,
    rate_limit_headers,
    shared_view,
    view_headers,
)
from router.governance.limits import (
    TenantLimits,
    run_limit_settings,
    run_limits,
    tenant_limits,
)
from router.governance.loops import repeated_tool_call
from router.governance.metrics import GovernanceMetrics
from router.governance.replica import ReplicaBudgets
from router.governance.runtable import SessionRuns, runs_to_forget, session_run_id
from router.governance.shared import (
    SESSION_FRESH_S,
    HeldRun,
    Loan,
    NextStep,
    SessionStep,
    leasable,
)
from router.governance.speculation import SPECULATE_WITHIN_S, DeferredStep, Speculation
from router.governance.store import GovernanceStore, RunRow, SessionRow, TenantRow
from router.request import RequestContext, RequestOutcome

__all__ = ["Governor", "RunEnd", "StepSignals"]

log = logging.getLogger(__name__)

RUN_END_HEADER = "x-gpupool-run-end"
TASK_TYPE_HEADER = "x-gpupool-task-type"
# with a shared store: which view the x-ratelimit-* headers show, and the age of its read
SCOPE_HEADER = b"x-gpupool-ratelimit-scope"
AGE_HEADER = b"x-gpupool-ratelimit-age-s"
HOUR_S = 3600.0
DAY_S = 86_400.0
MAX_RUNS_PER_TENANT = 10_000  # run states kept per tenant (stopped runs stay refused while kept)
MAX_SESSIONS_PER_TENANT = 10_000  # sessions whose run numbering is kept, least recently used go
# a dispatched step that ended so counts toward max_steps (an engine error or the engine's own
# 4xx does not: nothing was generated)
_STEP_OUTCOMES = frozenset({"ok", "aborted", "timeout"})


@dataclass(frozen=True, slots=True)
class StepSignals:
    """What the governor reads from one request besides its context."""

    tenant: TenantConfig
    run_end: bool = False  # x-gpupool-run-end: 1 (this is the run's last step)
    task_type: str | None = None  # x-gpupool-task-type
    messages: list[Any] | None = field(default=None, repr=False)  # chat history (loops)


@dataclass(frozen=True, slots=True)
class RunEnd:
    """Why and when a run ended (`ended_at_s` on the governor's clock), with its totals."""

    tenant: str
    run_id: str
    reason: str  # client_end, idle_timeout, or a guard's code (run_steps, ...)
    ended_at_s: float
    started_at_s: float
    steps: int
    tokens: int
    gpu_seconds: float


@dataclass(slots=True)
class _Ticket:
    tenant: str
    reserved_tokens: float
    reserved_request: bool
    run: RunState | None
    run_end: bool
    counted: bool = False  # the step was dispatched and counts toward the run's max_steps
    shared: _SharedTake | None = None  # what it took from the shared store (store.url)


@dataclass(slots=True)
class _SharedTake:
    """What a request took from the shared store: its tokens and request from the replica's
    leases, its request slot and (a run becoming active) its run's slot."""

    tokens: float = 0.0
    request: bool = False
    slot: str | None = None
    run_slot: str | None = None  # `<session or run id>` whose slot was taken
    step: int | None = None  # the run's step number, from the store
    home: NextStep | None = None  # with the run's home there (any replica's latest answer)
    # the step went on before the store answered (`step`: the known number until it does)
    speculation: Speculation | None = None
    # the step went on with no statement at all: numbered when its record is committed
    # (`step`: the known number until then; None once read)
    deferred: DeferredStep | None = None
    # a session's step: the run the store numbered it in (`<session>:<n>`), when the store
    # mapped its task anchor (None: the run `prepare` gave it)
    run_id: str | None = None
    loan: Loan | None = None  # its tokens' shortfall borrowed (given back to the lender)
    leased: bool = False  # numbered from its run's lease here (`_Lease`)


@dataclass(frozen=True, slots=True)
class _Loan:
    """One router's loan to a request: `short` tokens from `lender`'s bucket, out of the
    borrower's allowance (a refusal gives them back there, `_give_back`)."""

    lender: str
    short: float


@dataclass(eq=False, slots=True)
class _Early:
    """A governed request's slot and its run's step number, asked for at `prepare` (the
    statement sent then) and awaited at `enter`, where admission needs them: the round trip
    overlaps the request's estimate and the gateway's work between the two."""

    tenant: str
    task: asyncio.Task[tuple[bool, str | None, NextStep | None]]
    started_s: float
    claimed: bool = False  # `enter` took its answer: its slot is the ticket's
    dropped: bool = False  # given up: its slot is released when the answer comes
    # a session's step numbered in the run this replica knows (else the store's mapping
    # decides its run, and it cannot go on before the answer)
    pinned: bool = False
    # its run is held here (`_Lease`): only its slot was asked for, the step numbered here
    held: bool = False


@dataclass(eq=False, slots=True)
class _Lease:
    """A run this replica holds (store.run_lease, docs/replicas.md s48): it numbers the run's
    steps from `next_step` until `until_s` (its clock, from before the statement that took or
    renewed the lease: the database's expiry is later), and its sweep writes `next_step`."""

    until_s: float
    next_step: int
    seen_s: float  # its latest step here (the sweep lets a run unseen for long go)
    # the latest step answered here since the sweep's last write: (instance, step, tokens),
    # the run's home, written by the sweep (not a statement per step)
    home: tuple[str, int, int] | None = None

    def row(self, key: tuple[str, str], release: bool = False) -> HeldRun:
        return HeldRun(key[0], key[1], self.next_step, release, self.home)

    def take(self, now_s: float) -> int:
        step, self.next_step, self.seen_s = self.next_step, self.next_step + 1, now_s
        return step


EARLY_TTL_S = 10.0  # an early take nobody claimed (a request cancelled before `enter`)
# a run's lease lasts this many sweeps from its last renewal; this replica stops numbering
# from memory this fraction of a sweep before that (its clock may run faster than the
# database's by that much over one lease)
LEASE_SWEEPS = 2.0
LEASE_MARGIN_SWEEPS = 0.25
LEASE_POLL_SWEEPS = 0.25  # a step whose run another replica holds asks again this often
LEASE_FIRST_POLL_S = 0.005  # at first sooner: 5 ms, doubling up to the above


@dataclass(eq=False)
class _Tenant:
    config: TenantConfig
    limits: TenantLimits
    tokens: TokenBucket | None
    requests: TokenBucket | None
    allowance: TokenBucket | None = None  # what it may still borrow (borrow_max_frac)
    shared_waiting: int = 0  # its requests waiting for its shared bucket (store.url)
    hour: WindowSum = field(default_factory=lambda: WindowSum(HOUR_S, 60))
    day: WindowSum = field(default_factory=lambda: WindowSum(DAY_S, 96))
    inflight: int = 0
    reserved_tokens: float = 0.0
    runs: OrderedDict[str, RunState] = field(default_factory=OrderedDict)
    sessions: OrderedDict[str, SessionRuns] = field(default_factory=OrderedDict)
    session_seen_s: dict[str, float] = field(default_factory=dict)
    active: dict[str, RunState] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # FIFO among its rate waiters
    refilled: asyncio.Event = field(default_factory=asyncio.Event)
    alerted: bool = False
    # the other replicas' cost windows (store.url), as of the last sweep
    others_hour: WindowSum | None = None
    others_day: WindowSum | None = None
    # nothing to enforce for a request outside any run: no bucket, no request slot, no cost
    # cap or daily budget (set at config load and reload: `_decide_unlimited`)
    unlimited: bool = False
    plain: StepSignals | None = None  # the signals of its requests outside any run (shared)


class Governor:
    def __init__(
        self,
        config: Config,
        metrics: GovernanceMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_run_end: Callable[[RunEnd], None] | None = None,
        sweep_interval_s: float = 1.0,
        max_runs_per_tenant: int = MAX_RUNS_PER_TENANT,
        store: GovernanceStore | None = None,
        wall_clock: Callable[[], float] = time.time,
        replica_id: str | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.on_run_end = on_run_end
        # a shared store's home of a run whose step arrives here: (its home key, the instance,
        # the step number it answered, that step's tokens); the gateway's `RunAffinity.adopt`,
        # which keeps the later of it and its own
        self.on_home: Callable[[Hashable, str, int, int], None] | None = None
        self._max_runs = max_runs_per_tenant
        self._task_types = dict(config.governance.task_types_s)
        self._idle_timeout_s = config.governance.run_idle_timeout_s
        self._max_wait_s = {p.name: p.queue.max_wait_s for p in config.pools}
        self._tenants: dict[str, _Tenant] = {}
        self._tickets: dict[str, _Ticket] = {}
        self._early: dict[str, _Early] = {}  # request id -> its slot and step under way
        # the ledger numbers a known run's step with its record's commit (PostgreSQL; set by
        # router/settlement.py): such a step sends no statement of its own (`_fold`)
        self._fold_steps = False
        # the runs this replica holds (store.run_lease, on with `fold_steps`: the ledger is
        # in the store's database): (tenant, run id) -> its lease
        self._leases: dict[tuple[str, str], _Lease] = {}
        self._lease_s = LEASE_SWEEPS * sweep_interval_s
        self._lease_margin_s = LEASE_MARGIN_SWEEPS * sweep_interval_s
        self._lease_poll_s = LEASE_POLL_SWEEPS * sweep_interval_s
        # the notifications of another replica asking for a run held here (`listen`)
        self._listener: asyncio.Task[None] | None = None
        self._sweep_loop = Periodic(
            "gpupool-governance-sweep", self._sweep_and_save, sweep_interval_s
        )
        # with a shared store: a lender no replica marked active for this long is idle
        self._lender_idle_after_s = IDLE_AFTER_SWEEPS * sweep_interval_s
        self._lends = any(t.borrow_max_frac for t in config.tenants)  # sweeps mark demand
        self._store = store
        self._wall_clock = wall_clock
        self._dirty: dict[tuple[str, str], RunState] = {}  # runs changed since the last save
        self._pending_tenants: dict[str, TenantRow] = {}  # restored, applied at first use
        self._pending_runs: dict[str, list[RunRow]] = {}
        self._pending_sessions: dict[str, list[SessionRow]] = {}
        self._dirty_sessions: set[tuple[str, str]] = set()
        # a session's runs this replica numbered while the shared store could not be asked:
        # (tenant, session) -> {task anchor: run}, handed to the store when it answers again
        self._numbered_alone: dict[tuple[str, str], dict[str, int]] = {}
        self._saves = 0
        # budgets, slots and cost windows shared with the other routers on the database
        self._replica: ReplicaBudgets | None = None
        if store is not None and config.store.url is not None:
            sc = config.store
            self._replica = ReplicaBudgets(
                store.store,
                metrics,
                on_outage=sc.budgets_on_outage,
                chunk_frac=sc.budget_chunk_frac,
                slot_lease_s=sc.slot_lease_s,
                wall_clock=wall_clock,
                replica_id=replica_id,
                clock=clock,
                idle_timeout_s=self._idle_timeout_s,
            )
        for tenant in config.tenants:
            self._state(tenant)

    @property
    def fold_steps(self) -> bool:
        return self._fold_steps

    @fold_steps.setter
    def fold_steps(self, value: bool) -> None:
        """Set by router/settlement.py: the ledger numbers steps in the store's database
        (PostgreSQL, durable). With `store.run_lease` that also turns the run leases on."""
        self._fold_steps = value
        replica = self._replica
        if replica is not None:
            postgres = replica.db.store.dialect == "postgresql"
            lease = value and self.config.store.run_lease and postgres
            replica.run_lease_s = self._lease_s if lease else None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Restore the saved state (if a store is given) and start the sweep."""
        if self._sweep_loop.running:
            return
        if self._store is not None:
            await asyncio.to_thread(self._store.open)
            tenants, runs = await asyncio.to_thread(self._store.load)
            sessions = await asyncio.to_thread(self._store.load_sessions)
            self._restore(tenants, runs, sessions)
        self.listen()
        self._sweep_loop.start()

    def listen(self) -> None:
        """Under leases: hand a run over as soon as another replica asks for it (a
        notification), not at the next sweep (`start` calls it)."""
        replica = self._replica
        if replica is None or replica.run_lease_s is None or self._listener is not None:
            return
        self._listener = asyncio.get_running_loop().create_task(
            replica.listen_wanted(self._wanted), name="gpupool-run-lease-listener"
        )

    def _wanted(self, tenant: str, run_id: str) -> None:
        """Another replica asked for a run: written and let go now, if held here."""
        lease = self._leases.pop((tenant, run_id), None)
        if lease is not None and self._replica is not None:
            self.metrics.lease_handovers.inc()
            self._replica.hand_over([lease.row((tenant, run_id), release=True)])

    async def aclose(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
            self._listener = None
        await self._sweep_loop.aclose()
        early = [e.task for e in self._early.values()]
        for request_id in list(self._early):
            self.abandon(request_id)
        if early:  # their slots' releases start before the replica leaves
            await asyncio.gather(*early, return_exceptions=True)
        if self._replica is not None:  # its leases and slots back before the last save
            await self._release_leases()
            await self._replica.aclose()
        if self._store is not None:
            await self.save()
            # closed once: a second aclose (the gateway's, after a failed start) finds nothing
            store, self._store = self._store, None
            await asyncio.to_thread(store.close)

    async def _sweep_and_save(self) -> None:
        """The sweep loop's tick, every `sweep_interval_s`."""
        self.sweep()
        if self._replica is not None:
            await self.sync_replicas()
            await self.write_leases()
        await self.save()

    # ------------------------------------------------------------------ durability

    def _unix(self, mono_s: float) -> float:
        return self._wall_clock() - (self.clock() - mono_s)

    def _mono(self, unix_s: float) -> float:
        return self.clock() - (self._wall_clock() - unix_s)

    async def save(self) -> None:
        """Write every tenant's buckets and windows and the runs changed since the last save
        (a worker thread; the state is copied on the event loop first)."""
        if self._store is None:
            return
        now = self.clock()
        # shared: the buckets and windows live in the store's shared tables instead
        tenants = (
            []
            if self._replica is not None
            else [
                TenantRow(
                    st.config.name,
                    self._unix(now),
                    None if st.tokens is None else st.tokens.level(now),
                    None if st.requests is None else st.requests.level(now),
                    None if st.allowance is None else st.allowance.level(now),
                    [(self._unix(t), a) for t, a in st.hour.slices(now)],
                    [(self._unix(t), a) for t, a in st.day.slices(now)],
                )
                for st in self._tenants.values()
            ]
        )
        runs = [
            RunRow(
                tenant,
                run.run_id,
                self._unix(run.started_at_s),
                self._unix(run.last_seen_s),
                dataclasses.asdict(run.limits),
                run.steps,
                run.tokens,
                run.gpu_seconds,
                None if run.stopped is None else run.stopped.code,
                None if run.stopped is None else run.stopped.message,
                run.ended,
                run.active_s,
                run.settings,
            )
            for (tenant, _), run in self._dirty.items()
        ]
        self._dirty = {}
        sessions = []
        for tenant, session_id in self._dirty_sessions:
            st = self._tenants.get(tenant)
            runs_of = None if st is None else st.sessions.get(session_id)
            if st is not None and runs_of is not None:
                sessions.append(
                    SessionRow(
                        tenant,
                        session_id,
                        self._unix(st.session_seen_s.get(session_id, now)),
                        runs_of.last,
                        runs_of.current,
                        list(runs_of.anchors.items()),
                    )
                )
        self._dirty_sessions = set()
        await asyncio.to_thread(self._store.save, tenants, runs, sessions)
        self._saves += 1
        if self._saves % 600 == 1:  # about every 10 minutes: runs idle for a day go
            await asyncio.to_thread(
                self._store.forget_runs_before,
                self._wall_clock() - DAY_S,
                sessions_per_tenant=MAX_SESSIONS_PER_TENANT,
            )

    async def sync_replicas(self) -> None:
        """The shared half of the sweep (store.url): give back the leases, renew this
        replica's slots, publish its cost windows and read the others' (see `replica`)."""
        replica = self._replica
        if replica is None:
            return
        now = self.clock()
        windows = [
            (
                name,
                [(self._unix(t), a) for t, a in st.hour.slices(now)],
                [(self._unix(t), a) for t, a in st.day.slices(now)],
            )
            for name, st in self._tenants.items()
            if st.limits.cost_cap_gpu_seconds_per_hour is not None
            or st.limits.daily_budget_gpu_seconds is not None
        ]
        busy = [  # not lenders (borrowing, with a borrower configured)
            name
            for name, st in self._tenants.items()
            if self._lends and (st.inflight or st.shared_waiting or st.lock.locked())
        ]
        others = await replica.sync(windows, busy)
        if others is None:  # unreachable: the last windows read stay
            return
        if self._numbered_alone:  # the store answers again: what was numbered here meanwhile
            await self._hand_over_sessions()
        for name, st in self._tenants.items():
            hour_day = others.get(name)
            st.others_hour = st.others_day = None
            if hour_day is not None:
                st.others_hour = WindowSum(HOUR_S, 60)
                st.others_day = WindowSum(DAY_S, 96)
                for window, slices in ((st.others_hour, hour_day[0]), (st.others_day, hour_day[1])):
                    for start, amount in slices:
                        window.add(amount, self._mono(start))

    async def write_leases(self) -> None:
        """The runs this replica holds, written once (their next step number) with their
        leases renewed; a run unseen for `SPECULATE_WITHIN_S` (or ended) let go. What the
        answer says: another replica's stop (the run stops here: its next step is refused),
        another replica wanting the run (handed over now: written and let go), or the lease
        lost (it ran out and another replica took the run: its next step here goes to the
        store)."""
        replica = self._replica
        if replica is None or not self._leases:
            return
        now = self.clock()  # before the statement: the database's renewal is later
        renew: list[tuple[tuple[str, str], _Lease]] = []
        rows = []
        for key, lease in list(self._leases.items()):
            st = self._tenants.get(key[0])
            run = None if st is None else st.runs.get(key[1])
            if run is None or run.ended is not None or now - lease.seen_s > SPECULATE_WITHIN_S:
                del self._leases[key]  # no step numbered here from now on
                rows.append(lease.row(key, release=True))
            else:
                renew.append((key, lease))
        released = len(rows)
        rows += [lease.row(key) for key, lease in renew]
        answers = await replica.write_held(rows)
        if answers is None:  # the store cannot be reached: the leases run out here
            return
        handed = []
        for (key, lease), row, answer in zip(
            renew, rows[released:], answers[released:], strict=True
        ):
            if lease.home == row.home:  # written (a step answered since stays for the next)
                lease.home = None
            if self._leases.get(key) is not lease:
                continue
            if answer is None:  # lost: it ran out and another replica took the run
                del self._leases[key]
                if row.home is not None:  # its home as for a step numbered in the store
                    replica.record_home(key[0], key[1], *row.home)
                continue
            lease.until_s = now + self._lease_s
            stop_code, wanted = answer
            st = self._tenants[key[0]]
            run = st.runs.get(key[1])
            if stop_code is not None and run is not None:  # an operator's or another replica's
                stop = self._stored_stop(run, stop_code)
                if stop is not None:
                    self._stop(st, run, stop, self.clock())
            if wanted:  # another replica has a step of it: written and let go now
                del self._leases[key]
                handed.append(lease.row(key, release=True))
        if handed:
            await replica.write_held(handed)

    async def _release_leases(self) -> None:
        """Leaving: every run this replica holds written and let go."""
        replica = self._replica
        if replica is None or not self._leases:
            return
        rows = [lease.row(key, release=True) for key, lease in self._leases.items()]
        self._leases.clear()
        await replica.write_held(rows)

    def _held(self, st: _Tenant, ctx: RequestContext) -> _Lease | None:
        """The lease of the request's run when this replica holds it now (its next step is
        numbered here, from memory), else None. A session's runs are never held."""
        if not self._leases or ctx.run_id is None:
            return None
        lease = self._leases.get((st.config.name, ctx.run_id))
        replica = self._replica
        if lease is None or replica is None or replica.down_since_s is not None:
            return None
        if ctx.run_id not in st.runs:  # forgotten here (its guards' counts with it): the store
            return None
        if self.clock() >= lease.until_s - self._lease_margin_s:
            return None  # running out: its sweep renews it, else the store numbers the step
        return lease

    async def _wait_held(self, st: _Tenant, ctx: RequestContext, end_s: float, waits: int) -> None:
        """The request's run is held by another replica's lease: ask the holder to hand it
        over (it does at its next sweep), then wait a little before asking the store again.
        Raises 503 `run_held` once past `end_s` (the holder neither handed it over nor let
        its lease run out: it cannot reach the store, or a clock is off)."""
        replica = self._replica
        assert replica is not None and ctx.run_id is not None
        if waits == 0:  # a step that waits, counted once
            self.metrics.lease_moves.inc()
        replica.want_held(st.config.name, ctx.run_id)
        # the holder answers a notification within a round trip or two: ask again soon, then
        # every quarter sweep (its sweep reads the mark when the notification is lost)
        wait_s = min(self._lease_poll_s, LEASE_FIRST_POLL_S * 2**waits)
        if self.clock() + wait_s > end_s:
            raise StoreUnavailable(
                f"run {ctx.run_id[:64]!r} is held by another router replica, which did not"
                " hand it over in time; retry",
                "run_held",
                retry_after_s=self._lease_s,
            )
        await asyncio.sleep(wait_s)

    def _restore(
        self, tenants: list[TenantRow], runs: list[RunRow], sessions: Sequence[SessionRow] = ()
    ) -> None:
        if self._replica is None:  # shared: the shared tables hold the buckets and windows
            self._pending_tenants = {t.tenant: t for t in tenants}
        for row in runs:
            self._pending_runs.setdefault(row.tenant, []).append(row)
        for srow in sorted(sessions, key=lambda x: x.last_seen_s):
            self._pending_sessions.setdefault(srow.tenant, []).append(srow)
        for st in list(self._tenants.values()):  # the configured tenants exist already
            self._apply_saved(st)

    def _apply_saved(self, st: _Tenant) -> None:
        name = st.config.name
        row = self._pending_tenants.pop(name, None)
        if row is not None:
            at = self._mono(row.saved_at_s)
            for bucket, level in (
                (st.tokens, row.tokens_level),
                (st.requests, row.requests_level),
                (st.allowance, row.allowance_level),
            ):
                if bucket is not None and level is not None:
                    bucket.set_level(level, at)
            for window, slices in ((st.hour, row.hour_slices), (st.day, row.day_slices)):
                for start, amount in slices:
                    window.add(amount, self._mono(start))
        for r in self._pending_runs.pop(name, []):
            run = RunState(
                run_id=r.run_id,
                started_at_s=self._mono(r.started_at_s),
                last_seen_s=self._mono(r.last_seen_s),
                limits=RunLimits(**r.limits),  # type: ignore[arg-type]
                steps=r.steps,
                tokens=r.tokens,
                gpu_seconds=r.gpu_seconds,
                stopped=(
                    None
                    if r.stop_code is None
                    else Stop(
                        r.stop_code,
                        r.stop_message or "",
                        r.settings.get(STOP_FIELDS.get(r.stop_code, "")),
                    )
                ),
                ended=r.ended,
                restored_gpu_seconds=r.gpu_seconds,
                active_s=r.active_s,
                settings=dict(r.settings),
            )
            run.active_since_s = run.last_seen_s  # its stretch before the restart: unknown
            st.runs[run.run_id] = run
            if run.ended is None:
                st.active[run.run_id] = run
        for srow in self._pending_sessions.pop(name, []):
            st.sessions[srow.session_id] = SessionRuns(
                srow.last_run, srow.current_run, OrderedDict(srow.anchors)
            )
            st.session_seen_s[srow.session_id] = self._mono(srow.last_seen_s)
        for run in st.runs.values():  # a session's run: `<session>:<n>`
            session_id, _, number = run.run_id.rpartition(":")
            if number.isdigit() and session_id in st.sessions:
                run.session_id = session_id
        self._forget_old_sessions(st)
        self._forget_old_runs(st, self.clock())

    def sweep(self) -> None:
        """End the runs idle past `run_idle_timeout_s` (no step in flight, none arrived)."""
        now = self.clock()
        for st in self._tenants.values():
            self._expire_idle(st, now)
            self._export(st, now)
        for request_id, early in list(self._early.items()):
            if now - early.started_s > EARLY_TTL_S:
                self.abandon(request_id)

    # ------------------------------------------------------------------ the request path

    def prepare(
        self,
        ctx: RequestContext,
        tenant: TenantConfig,
        headers: Mapping[str, str],
        body: dict[str, Any],
    ) -> tuple[RequestContext, StepSignals]:
        """The step's signals, and the context with the tier's queue weight and, for a step of
        a session, the run it belongs to (`<session>:<n>`, see `boundary` and `runtable`).
        Raises `BadRequest` for an unknown task type."""
        task_type = headers.get(TASK_TYPE_HEADER) or None
        if task_type is not None and task_type not in self._task_types:
            raise BadRequest(
                f"{TASK_TYPE_HEADER} {task_type[:40]!r} is not a task type (known:"
                f" {', '.join(sorted(self._task_types))})",
                "invalid_header",
                param=TASK_TYPE_HEADER,
            )
        st = self._state(tenant)
        weight = st.limits.queue_weight
        if st.unlimited and ctx.run_id is None and ctx.session_id is None and st.plain is not None:
            # outside any run and any session (classify gives a session's step a run id; a
            # context made otherwise is mapped below) the run end, the task type and the
            # history guard nothing: the tenant's shared signals
            if weight != 1.0:
                ctx = dataclasses.replace(ctx, tenant_weight=ctx.tenant_weight * weight)
            return ctx, st.plain
        messages = body.get("messages")
        signals = StepSignals(
            tenant=tenant,
            run_end=headers.get(RUN_END_HEADER, "").strip().lower() in ("1", "true", "yes"),
            task_type=task_type,
            messages=messages if isinstance(messages, list) else None,
        )
        if ctx.session_id is not None:
            runs_of = self._session(st, ctx.session_id)
            replica = self._replica
            if replica is not None and replica.down_since_s is None:
                # the store maps the step's anchor (`_begin`): the replica's guess until then
                number = runs_of.peek(ctx.session_turn)
            else:
                number = runs_of.run_for(ctx.session_turn)
                if replica is not None:  # numbered here during an outage
                    self._numbered_here(st, ctx.session_id, ctx.session_turn, number)
            ctx = dataclasses.replace(ctx, run_id=session_run_id(ctx.session_id, number))
        if weight != 1.0:
            ctx = dataclasses.replace(ctx, tenant_weight=ctx.tenant_weight * weight)
        if self._replica is not None:
            early = self._begin(st, ctx)
            if early is not None:
                self._early[ctx.request_id] = early
        return ctx, signals

    def _begin(self, st: _Tenant, ctx: RequestContext, fold: bool = True) -> _Early | None:
        """Ask the shared store for the request's slot and its run's step number now (None:
        it needs neither, or, `fold`, its step is numbered with its ledger record)."""
        replica = self._replica
        assert replica is not None
        limit = st.limits.max_concurrent_requests
        if limit is None and ctx.run_id is None:
            return None
        if fold and self._foldable(st, ctx) is not None:
            return None
        if self._held(st, ctx) is not None:  # numbered here: its slot only, if any
            if limit is None:
                return None
            task = replica.begin(st.config.name, ctx.request_id, limit, None)
            return _Early(st.config.name, task, self.clock(), held=True)
        session, pinned = self._session_step(st, ctx)
        span_s = self._span(st, ctx.run_id)
        task = replica.begin(st.config.name, ctx.request_id, limit, ctx.run_id, session, span_s)
        return _Early(st.config.name, task, self.clock(), pinned=pinned)

    def _span(self, st: _Tenant, run_id: str | None) -> float:
        """How long the run has been active here without a pause, now (0: a run not known
        here): the stretch an event of it tells the shared store (its active time across
        replicas, router/governance/shared.py)."""
        run = None if run_id is None else st.runs.get(run_id)
        if run is None:
            return 0.0
        return active_span_s(run, self.clock(), self._idle_timeout_s)

    def _session_step(self, st: _Tenant, ctx: RequestContext) -> tuple[SessionStep | None, bool]:
        """A session's step for the store to map, and whether it is pinned to the run
        `prepare` gave it. Pinned when this replica knows that run (its step may go on
        before the answer): numbered there whatever the store maps its anchor to; within
        SESSION_FRESH_S of this replica's last mapping of the same task, with the run's own
        statement (`NEXT_STEP_SQL`, None here: the mapping would change nothing, and the
        store's rows are fresh). Not pinned: numbered in the run the store maps it to."""
        if ctx.session_id is None or ctx.run_id is None:
            return None, False
        runs_of = self._session(st, ctx.session_id)
        now = self.clock()
        known = self._known_run(st, ctx) is not None
        if known and now - runs_of.mapped_s.get(ctx.session_turn, -SESSION_FRESH_S) < (
            SESSION_FRESH_S
        ):
            return None, True
        runs_of.mapped(ctx.session_turn, now)
        number = int(ctx.run_id.rpartition(":")[2]) if known else None
        return SessionStep(ctx.session_id, ctx.session_turn, number, runs_of.floor), known

    def abandon(self, request_id: str) -> None:
        """The request ends before `enter` (refused or failed in the gateway): what
        `prepare` asked the store for is given back when its answer comes."""
        early = self._early.pop(request_id, None)
        if early is not None:
            self._drop_early(early)

    def _drop_early(self, early: _Early) -> None:
        if early.claimed or early.dropped:
            return
        early.dropped = True
        replica = self._replica
        assert replica is not None

        def release(task: asyncio.Task[tuple[bool, str | None, NextStep | None]]) -> None:
            if task.cancelled() or task.exception() is not None:
                return  # no slot taken (a refusal, an outage under `closed`)
            _, holder, _ = task.result()
            if holder is not None:
                replica.release(early.tenant, "requests", holder)

        early.task.add_done_callback(release)

    def enter_now(self, ctx: RequestContext, signals: StepSignals) -> bool:
        """`enter` for a request that has nothing to wait for or be refused by: a tenant with
        nothing to enforce (`_Tenant.unlimited`, decided at config load and reload) and a
        request outside any run. Counted in flight with its ticket (`finished` settles it, as
        after `enter`); it has no rate-limit headers and no speculation. True: done, as
        `enter` would have done it with no wait; False: nothing done, await `enter`."""
        st = self._tenants.get(signals.tenant.name)
        if st is None or not st.unlimited or ctx.run_id is not None:
            return False
        st.inflight += 1
        self._tickets[ctx.request_id] = _Ticket(ctx.tenant, 0.0, False, None, False)
        return True

    async def enter(
        self,
        ctx: RequestContext,
        estimate: Estimate,
        signals: StepSignals,
        *,
        speculate: bool = False,
    ) -> float:
        """Let the request through its tenant's and run's limits, or raise `RunStopped` (403)
        or `RateLimited` (429). Holds a reservation until `finished(outcome)`. Returns the
        seconds it waited for the tenant's bucket (0.0 when it did not).

        `speculate` (a caller that awaits `speculation(request_id)` before the response's
        first byte): a step of a run this replica knows returns without the shared store's
        answer, which may still refuse it (router/governance/speculation.py)."""
        early = self._early.pop(ctx.request_id, None)
        try:
            return await self._enter(ctx, estimate, signals, early, speculate)
        except BaseException:
            if early is not None:
                self._drop_early(early)  # not when `enter` took its slot (undone with it)
            raise

    async def _enter(
        self,
        ctx: RequestContext,
        estimate: Estimate,
        signals: StepSignals,
        early: _Early | None,
        speculate: bool = False,
    ) -> float:
        st = self._state(signals.tenant)
        now = self.clock()
        self._apply_daily_budget(st, now)
        self._check(st, ctx, signals, now)
        need = float(estimate.total_tokens)

        def on_wait() -> None:  # a request waiting for its budget holds no slot meanwhile
            if early is not None:
                self._drop_early(early)

        waited_s, borrowed = await self._take_rate(st, ctx, need, now, on_wait)
        past_own = borrowed is True  # to the shared buckets, to borrow there
        loan = borrowed if isinstance(borrowed, _Loan) else None
        shared: _SharedTake | None = None
        if self._replica is not None:
            try:
                shared = await self._take_shared(
                    st, ctx, need, now, early, signals if speculate else None, past_own
                )
            except BaseException:
                self._give_back(st, need, True, self.clock(), loan)
                raise
            if shared.run_id is not None and shared.run_id != ctx.run_id:
                # the store mapped the session's step to another run than this replica's
                # guess: the step is that run's (`dispatched` tells the outcome)
                ctx = dataclasses.replace(ctx, run_id=shared.run_id)
        now = self.clock()
        try:  # the wait may have let another step stop the run or take the last slot
            run, new_run = self._check(
                st, ctx, signals, now, None if shared is None else shared.home
            )
        except BaseException:
            self._give_back(st, need, True, now, loan)
            if shared is not None:
                self._undo_shared(st, shared)
            raise
        made = loan if loan is not None else None if shared is None else shared.loan
        if made is not None:  # a loan counts once its request is admitted (a refusal gave it back)
            self.metrics.borrowed.labels(st.config.name).inc(made.short)
            self.metrics.lent.labels(made.lender).inc(made.short)
        if run is not None:
            if new_run:
                if run.ended is not None:  # back after an idle timeout: active again
                    run.ended = None
                st.runs[run.run_id] = run
                st.active[run.run_id] = run
            st.runs.move_to_end(run.run_id)
            touch(run, now, self._idle_timeout_s)
            run.inflight += 1
            if shared is not None and shared.step is not None and shared.speculation is None:
                # the store's number of this step: the next one here may go on as this + 1
                run.store_step = max(shared.step, -1 if run.store_step is None else run.store_step)
            self._dirty[(st.config.name, run.run_id)] = run
            self._forget_old_runs(st, now)
        st.inflight += 1
        st.reserved_tokens += need if st.tokens is not None else 0.0
        self._tickets[ctx.request_id] = _Ticket(
            ctx.tenant,
            need if st.tokens is not None else 0.0,
            st.requests is not None,
            run,
            signals.run_end,
            shared=shared,
        )
        self._adopt_home(ctx, None if shared is None else shared.home)
        return waited_s

    async def _take_shared(
        self,
        st: _Tenant,
        ctx: RequestContext,
        need: float,
        now_s: float,
        early: _Early | None = None,
        speculate: StepSignals | None = None,
        past_own: bool = False,
    ) -> _SharedTake:
        """Take the request's tokens and request from the shared buckets (waiting, as the
        local buckets do, while they refill within the deadline and the pool's max wait),
        then its request slot and its run's step number (`early`: asked for at `prepare`;
        given up, and asked for again after, when the request waits for its budget) and,
        for a run not active here, its run's slot. `speculate` (the step's signals): a
        known run's step does not wait for its slot and number (`_speculate`)."""
        replica = self._replica
        assert replica is not None
        name = st.config.name
        took = _SharedTake()
        end_s = min(ctx.deadline_s, now_s + self._max_wait_s.get(ctx.pool, 0.0))
        try:
            for bucket, local, amount, reason in (
                ("tokens", st.tokens, need, "token_rate"),
                ("requests", st.requests, 1.0, "request_rate"),
            ):
                if local is None:
                    continue
                while (
                    wait := await replica.take(
                        name,
                        bucket,
                        amount,
                        capacity=local.capacity,
                        rate_per_s=local.rate_per_s,
                        decides=not (bucket == "tokens" and past_own),
                    )
                ) > 0.0:
                    if bucket == "tokens" and (loan := await self._borrow_shared(st, amount)):
                        took.loan = loan
                        break
                    if self.clock() + wait > end_s:
                        per_minute = round(local.rate_per_s * 60)
                        self._refuse(
                            st,
                            reason,
                            f"tenant {name!r} is over its {per_minute} {bucket} per minute"
                            f" across the router replicas (this request takes {amount:.0f});"
                            f" retry after {wait:.1f} s",
                            wait,
                        )
                    if early is not None:
                        self._drop_early(early)
                    st.shared_waiting += 1
                    try:
                        await asyncio.sleep(wait)
                    finally:
                        st.shared_waiting -= 1
                if bucket == "tokens" and past_own and replica.down_since_s is not None:
                    # the store went down as the request went past its own bucket to borrow:
                    # no loan during an outage, its own bucket decides (it did not hold it)
                    replica.give(name, bucket, amount)  # what `take` ran into debt
                    own = local.level(self.clock()) + amount
                    self._refuse_rate(
                        st, reason, amount, max(1e-3, (amount - own) / local.rate_per_s)
                    )
                if bucket == "tokens":
                    took.tokens = amount
                else:
                    took.request = True
            lease_end_s = self.clock() + self._lease_s + self._lease_poll_s
            waits = 0
            while True:
                held = self._held(st, ctx)
                if early is not None and not early.dropped and early.held != (held is not None):
                    self._drop_early(early)  # the run was taken or let go since `prepare`
                    early = None
                if held is not None:  # numbered here, now (a refusal below leaves a gap)
                    took.step = held.take(self.clock())
                    took.leased = True
                    self.metrics.lease_steps.inc()
                if early is None or early.dropped:
                    if held is None and speculate is not None and self._fold(st, ctx, took):
                        return took
                    early = self._begin(st, ctx, fold=False)
                if (
                    held is None
                    and speculate is not None
                    and early is not None
                    and (spec := self._speculate(st, ctx, early, took, speculate)) is not None
                ):
                    took.speculation = spec
                    return took
                admitted, stored = True, None
                if early is not None:
                    try:  # shielded: a request cancelled while it waits gives the slot back
                        admitted, took.slot, stored = await asyncio.shield(early.task)
                    except BaseException:
                        self._drop_early(early)
                        raise
                    early.claimed = True
                if not admitted:
                    raise self._slot_refusal(st)
                if stored is None or not stored.held_elsewhere:
                    break
                if took.slot is not None:  # given back while the step waits for its run
                    replica.release(name, "requests", took.slot)
                    took.slot = None
                early = None
                await self._wait_held(st, ctx, min(ctx.deadline_s, lease_end_s), waits)
                waits += 1
            run_limit = st.limits.max_concurrent_runs
            slot_id = ctx.session_id or ctx.run_id
            if slot_id is not None and run_limit is not None and slot_id not in _slot_ids(st):
                admitted, holder = await replica.acquire(name, "runs", f"run:{slot_id}", run_limit)
                took.run_slot = slot_id if holder is not None else None
                if not admitted:
                    self._refuse(
                        st,
                        "tenant_concurrency",
                        f"tenant {name!r} has {run_limit} agent runs active across the router"
                        f" replicas, its limit (max_concurrent_runs): end one or wait for it"
                        " to go idle",
                        1.0,
                    )
            if ctx.run_id is not None and held is None:
                took.home = stored
                took.step = None if stored is None else stored.step
                if stored is not None and replica.run_lease_s and _leased(ctx):
                    # the statement made this replica the run's holder: its next steps here
                    # are numbered from memory (a step seen at `enter`'s send time, or later)
                    assert early is not None
                    self._leases[(name, ctx.run_id)] = _Lease(
                        early.started_s + self._lease_s, stored.step + 1, self.clock()
                    )
                if stored is not None:  # a session's: the run its task maps to, learned
                    mapped = self._session_answer(st, ctx, stored)
                    if early is not None and not early.pinned:  # and the step's run
                        took.run_id = mapped
                elif ctx.session_id is not None:  # numbered here: an outage
                    number = int(ctx.run_id.rpartition(":")[2])
                    self._numbered_here(st, ctx.session_id, ctx.session_turn, number)
        except BaseException:
            self._undo_shared(st, took)
            raise
        return took

    def _speculate(
        self,
        st: _Tenant,
        ctx: RequestContext,
        early: _Early,
        took: _SharedTake,
        signals: StepSignals,
    ) -> Speculation | None:
        """Send a known run's step on before the store answers (None: it waits, as before).
        Known: this replica took the run's previous step within `SPECULATE_WITHIN_S` (so it
        knows the store's number of it), the run is neither stopped nor ended here, its
        steps and those in flight are under `max_steps`, and it holds its run slot here
        (none is asked for). The step takes the known number plus one until the answer."""
        replica = self._replica
        assert replica is not None
        run = self._known_run(st, ctx)
        if run is None or run.store_step is None or early.task.done():  # answered: no gain
            return None
        if ctx.session_id is not None and not early.pinned:  # the store decides its run
            return None
        early.claimed = True  # its answer (and slot) is the ticket's
        replica.unhurry(early.task)  # its answer is read while the engine works: not polled
        predicted = run.store_step = run.store_step + 1
        took.step = predicted

        def on_answer(spec: Speculation) -> None:
            try:
                self._answered(st, ctx, signals, run, took, spec)
            except Exception as err:  # a bug: the client gets a 500, not a hang
                log.exception("%s: reading the store's answer failed", ctx.request_id)
                spec.error = err

        return Speculation(early.task, predicted, on_answer)

    def _known_run(self, st: _Tenant, ctx: RequestContext) -> RunState | None:
        """The request's run when this replica knows it well enough to send its step on
        before the store numbers it (see `_speculate`), else None."""
        replica = self._replica
        run = None if ctx.run_id is None else st.runs.get(ctx.run_id)
        if (
            replica is None
            or run is None
            or run.store_step is None
            or run.stopped is not None
            or run.ended is not None
            or replica.down_since_s is not None
            or self.clock() - run.last_seen_s > SPECULATE_WITHIN_S
            # under leases a run's steps here are numbered from memory while it holds the
            # run, else by the store's statement awaited (it may find the run held)
            or (replica.run_lease_s is not None and _leased(ctx))
        ):
            return None
        max_steps = run.limits.max_steps
        if max_steps is not None and run.steps + run.inflight + 1 >= max_steps:
            return None  # its last step (or past it) waits for the store's count
        slot_id = ctx.session_id or ctx.run_id
        if st.limits.max_concurrent_runs is not None and slot_id not in _slot_ids(st):
            return None
        return run

    def _foldable(self, st: _Tenant, ctx: RequestContext) -> RunState | None:
        """The request's run when its step can be numbered with its ledger record (`_fold`):
        a known run's non-streaming step that needs no request slot, the ledger able to."""
        if not self.fold_steps or ctx.stream or st.limits.max_concurrent_requests is not None:
            return None
        return self._known_run(st, ctx)

    def _fold(self, st: _Tenant, ctx: RequestContext, took: _SharedTake) -> bool:
        """Send a known run's step on with no statement: the statement that commits its
        ledger record numbers it (router/settlement.py: `deferred_step`). False: it waits
        for its number as before."""
        run = self._foldable(st, ctx)
        if run is None or run.store_step is None:
            return False
        replica = self._replica
        assert replica is not None and ctx.run_id is not None
        name, run_id = st.config.name, ctx.run_id
        predicted = run.store_step = run.store_step + 1
        took.step = predicted
        session, _ = self._session_step(st, ctx)  # a session's: numbered in this run
        sql, _ = replica.step_statement(name, run_id, session)

        def params() -> Sequence[object]:  # when the record is committed: the step's end
            return replica.step_statement(name, run_id, session, self._span(st, run_id))[1]

        def read(stored: NextStep | None, failed: bool) -> BaseException | None:
            try:
                return self._read_deferred(st, ctx, run, took, stored, failed)
            except Exception as err:  # a bug: the client gets a 500, not a wrong answer
                log.exception("%s: reading the store's answer failed", ctx.request_id)
                return err

        took.deferred = DeferredStep(
            sql,
            params,
            predicted,
            lambda: replica.next_step(name, run_id, session=session, span_s=self._span(st, run_id)),
            read,
        )
        return True

    def deferred_step(self, outcome: RequestOutcome) -> DeferredStep | None:
        """The request's step, sent on with no statement, when it is to be numbered with its
        ledger record now (its response is next); None otherwise."""
        ticket = self._tickets.get(outcome.ctx.request_id)
        if ticket is None or ticket.shared is None or ticket.shared.deferred is None:
            return None
        replica = self._replica
        if replica is None or replica.down_since_s is not None or outcome.instance_id is None:
            return None  # the known number stands (as the ledger numbers in an outage)
        return ticket.shared.deferred

    def _read_deferred(
        self,
        st: _Tenant,
        ctx: RequestContext,
        run: RunState,
        took: _SharedTake,
        stored: NextStep | None,
        failed: bool,
    ) -> GpupoolError | None:
        """The store numbered a step sent on with no statement (`_fold`), as its record was
        committed: its number and home, or the refusal `enter` would have given (the ticket
        then counts no step; `x-gpupool-run-end` on it does not end the run)."""
        replica = self._replica
        assert replica is not None
        predicted = took.step if took.deferred is None else took.deferred.predicted
        took.deferred = None
        ticket = self._tickets.get(ctx.request_id)
        error: GpupoolError | None = None
        if stored is None:
            label = "unanswered"  # the known number stands
            if failed and ctx.run_id is not None:  # the commit failed: count the step there
                replica.number_later(st.config.name, ctx.run_id)
        else:
            error = self._read_stored(
                st, ctx, run, took, stored, ticket is not None and ticket.run_end
            )
            if error is not None:
                label = "refused"
                self._refused_speculation(ctx)
            else:
                took.step = stored.step
                self._adopt_home(ctx, stored)
                label = "confirmed" if stored.step == predicted else "renumbered"
        self.metrics.folded.labels(label).inc()
        return error

    def _answered(
        self,
        st: _Tenant,
        ctx: RequestContext,
        signals: StepSignals,
        run: RunState,
        took: _SharedTake,
        spec: Speculation,
    ) -> None:
        """The store answered a step sent on before it (`_speculate`): take its slot, number
        and home, or refuse the step as `enter` would have (`spec.error`)."""
        replica = self._replica
        assert replica is not None
        name = st.config.name
        if spec.task.cancelled():  # the governor closing: the known number stands
            spec.label = "unanswered"
            return
        if (err := spec.task.exception()) is not None:  # StoreUnavailable (fail closed)
            spec.error, spec.label = err, "refused"
            self.metrics.speculated.labels("refused").inc()
            self._refused_speculation(ctx)
            return
        admitted, holder, stored = spec.task.result()
        if spec.closed:  # the request ended first: give the slot back, count nothing
            if holder is not None:
                replica.release(name, "requests", holder)
            return
        took.slot = holder
        error: GpupoolError | None = None
        if not admitted:
            error = self._slot_refusal(st)
        elif stored is not None:
            error = self._read_stored(st, ctx, run, took, stored, signals.run_end)
            if error is None:
                spec.step = took.step = stored.step
                self._adopt_home(ctx, stored)
        if error is not None:
            spec.error, spec.label = error, "refused"
            self._refused_speculation(ctx)
        elif stored is None:
            spec.label = "unanswered"  # failed open: the known number stands
        else:
            spec.label = "confirmed" if stored.step == spec.predicted else "renumbered"
        self.metrics.speculated.labels(spec.label).inc()
        if spec.awaited:
            self.metrics.speculated_awaited.inc()

    def _read_stored(
        self,
        st: _Tenant,
        ctx: RequestContext,
        run: RunState,
        took: _SharedTake,
        stored: NextStep,
        run_end: bool,
    ) -> GpupoolError | None:
        """The store's answer for a step sent on before it: its home taken, the guards run
        on the stored counters as `enter` runs them (the step itself not counted); the stop's
        refusal, else None."""
        took.home = stored
        run.store_step = max(run.store_step or 0, stored.step)
        self._session_answer(st, ctx, stored)  # numbered in this run; its anchor's run kept
        ticket = self._tickets.get(ctx.request_id)
        counted = 1 if ticket is not None and ticket.counted else 0
        now = self.clock()
        run.steps -= counted  # the steps before this one, as `enter` counts them
        try:
            stored_stop = self._merge_stored(st, run, stored, now)
            stop = check_step(run, now, None, self._idle_timeout_s) or stored_stop
        finally:
            run.steps += counted
        if stop is None:
            return None
        self._stop(st, run, stop, now)
        if run_end:
            self._release(st, run)
        return RunStopped(stop.message, stop.code, param=stop.setting)

    def _session_answer(self, st: _Tenant, ctx: RequestContext, stored: NextStep) -> str | None:
        """The store's answer for a session's step: the run its task anchor maps to,
        remembered here (this replica's next steps of the task are predicted from it).
        Returns that run's id (None: not a session's step)."""
        if ctx.session_id is None or stored.run is None:
            return None
        runs_of = self._session(st, ctx.session_id)
        runs_of.adopt(ctx.session_turn, stored.run)
        return session_run_id(ctx.session_id, stored.run)

    def _numbered_here(
        self, st: _Tenant, session_id: str, anchor_key: str | None, number: int
    ) -> None:
        """This replica gave a session's step run `number` without the store (an outage):
        its own count goes on past it, and the store learns it when it answers again."""
        runs_of = self._session(st, session_id)
        runs_of.adopt(anchor_key, number)
        runs_of.floor = max(runs_of.floor, number)
        anchors = self._numbered_alone.setdefault((st.config.name, session_id), {})
        if anchor_key is not None:
            anchors[anchor_key] = number

    async def _hand_over_sessions(self) -> None:
        """The store answers again: each session's highest number given here meanwhile, and
        the tasks numbered here, to the store (a session's new runs are numbered past them on
        every replica; a task no replica mapped keeps its run)."""
        replica = self._replica
        assert replica is not None
        rows = []
        for (tenant, session_id), anchors in self._numbered_alone.items():
            st = self._tenants.get(tenant)
            runs_of = None if st is None else st.sessions.get(session_id)
            if runs_of is not None:
                rows.append((tenant, session_id, runs_of.floor, list(anchors.items())))
        handed, self._numbered_alone = self._numbered_alone, {}
        if not await replica.adopt_session_runs(rows):
            for key, anchors in handed.items():  # kept for the next sweep that gets through
                self._numbered_alone.setdefault(key, {}).update(anchors)

    def _refused_speculation(self, ctx: RequestContext) -> None:
        """A step the store's answer refused: as a step refused at `enter`, it does not end
        its run (`x-gpupool-run-end` only ends a run whose step was served)."""
        ticket = self._tickets.get(ctx.request_id)
        if ticket is not None:
            ticket.run_end = False

    def speculation(self, request_id: str) -> Speculation | None:
        """The request's step went on before the store's answer (`enter(speculate=True)`):
        what the caller awaits before the response's first byte. None: nothing to await."""
        ticket = self._tickets.get(request_id)
        if ticket is None or ticket.shared is None:
            return None
        return ticket.shared.speculation

    def _undo_shared(self, st: _Tenant, took: _SharedTake) -> None:
        """Give back what `_take_shared` took for a request refused after all."""
        replica = self._replica
        if replica is None:
            return
        name = st.config.name
        if took.speculation is not None and not took.speculation.resolved:
            took.speculation.closed = True  # its slot, if the answer brings one, goes back
        loan = took.loan
        # a loan goes back to the lender's and the allowance's shared buckets with the
        # leases, at the next sweep (its statement); the rest to the borrower's lease
        replica.give(name, "tokens", took.tokens - (0.0 if loan is None else loan.short))
        if loan is not None:
            replica.give(loan.lender, "tokens", loan.short)
            replica.give(name, "allowance", loan.short)
        replica.give(name, "requests", 1.0 if took.request else 0.0)
        if took.slot is not None:
            replica.release(name, "requests", took.slot)
        if took.run_slot is not None and took.run_slot not in _slot_ids(st):
            replica.release(name, "runs", replica.holder(f"run:{took.run_slot}"))

    def _check(
        self,
        st: _Tenant,
        ctx: RequestContext,
        signals: StepSignals,
        now_s: float,
        stored: NextStep | None = None,
    ) -> tuple[RunState | None, bool]:
        """Guards, cost caps and concurrency (no state changes but a run's stop and its step
        count). Returns the request's run (None: no run id) and whether it starts (or
        restarts) being active. `stored`: the run in the shared store as this step was
        numbered there: the steps numbered before it on every replica count toward
        `max_steps`, the usage every replica's sweeps added (plus this replica's not yet
        added) toward `max_tokens` and `max_gpu_seconds`, its active time on every replica
        toward `max_duration_s`, and a guard that stopped the run on another replica stops it
        here."""
        run: RunState | None = None
        new_run = True
        if ctx.run_id is not None:
            run = st.runs.get(ctx.run_id)
            if run is None or run.ended == "client_end":
                run = RunState(
                    run_id=ctx.run_id,
                    started_at_s=now_s,
                    last_seen_s=now_s,
                    limits=run_limits(self.config, ctx.class_name, st.config, signals.task_type),
                    settings=run_limit_settings(
                        self.config, ctx.class_name, st.config, signals.task_type
                    ),
                    session_id=ctx.session_id,
                )
            else:
                new_run = run.ended is not None
            stored_stop = None
            if stored is not None:  # what other replicas served counts here too
                stored_stop = self._merge_stored(st, run, stored, now_s)
            looping = None
            if signals.messages is not None:
                looping = repeated_tool_call(signals.messages, run.limits.loop_repeats)
            stop = check_step(run, now_s, looping, self._idle_timeout_s) or stored_stop
            if stop is not None:
                self._stop(st, run, stop, now_s)
                if signals.run_end:  # refused, and the client ends it: its id starts afresh
                    self._release(st, run)
                raise RunStopped(stop.message, stop.code, param=stop.setting)
        if new_run:
            self._check_cost(st, now_s)
            self._check_runs(st, now_s, ctx)
        limit = st.limits.max_concurrent_requests
        if limit is not None and st.inflight >= limit:
            self._refuse(
                st,
                "tenant_concurrency",
                f"tenant {st.config.name!r} has {st.inflight} requests in flight, its tier's"
                f" limit is {limit} (max_concurrent_requests)",
                1.0,
            )
        return run, new_run

    def _merge_stored(
        self, st: _Tenant, run: RunState, stored: NextStep, now_s: float
    ) -> Stop | None:
        """Count what the store says the run did on every replica; the stop another replica's
        guard gave it, if any. Its active time: the larger of this replica's (the step an
        event here, `touch`) and the store's (this step's arrival counted, so the run's
        time up to now), never less than it was."""
        run.steps = max(run.steps, stored.step)
        assert self._replica is not None
        pending_tokens, pending_gpu_s = self._replica.pending_usage(st.config.name, run.run_id)
        run.tokens = max(run.tokens, stored.tokens + pending_tokens)
        run.gpu_seconds = max(run.gpu_seconds, stored.gpu_seconds + pending_gpu_s)
        touch(run, now_s, self._idle_timeout_s)
        run.active_s = max(run.active_s, stored.active_s)
        return None if stored.stop_code is None else self._stored_stop(run, stored.stop_code)

    @staticmethod
    def _stored_stop(run: RunState, code: str) -> Stop | None:
        """The stop another replica's guard (or an operator) wrote for the run in the store
        (`code`), unless the run is stopped here already."""
        if run.stopped is not None:
            return None
        setting = run.setting(STOP_FIELDS[code]) if code in STOP_FIELDS else None
        return Stop(
            code,
            f"run {run.run_id[:64]!r} stopped on another router replica ({code}); end the"
            " run (POST /v1/runs/{run_id}/end, or x-gpupool-run-end: 1) and its id starts"
            " a fresh run",
            setting,
        )

    def _check_cost(self, st: _Tenant, now_s: float) -> None:
        lim = st.limits
        for cap, window, what in (
            (
                lim.cost_cap_gpu_seconds_per_hour,
                _window(st.hour, st.others_hour, now_s),
                "this hour (cost_cap_gpu_seconds_per_hour)",
            ),
            (
                lim.daily_budget_gpu_seconds,
                _window(st.day, st.others_day, now_s),
                "of the last 24 h (daily_budget_gpu_seconds)",
            ),
        ):
            if cap is not None and (used := window.total(now_s)) >= cap:
                self._refuse(
                    st,
                    "cost_cap",
                    f"tenant {st.config.name!r} used {used:.1f} of its {cap:g} GPU-seconds"
                    f" {what}: new runs wait, running ones may finish",
                    window.wait_below_s(cap, now_s),
                )

    def _check_runs(self, st: _Tenant, now_s: float, ctx: RequestContext) -> None:
        """`max_concurrent_runs`: a new run needs a free slot. A session's runs share one
        slot (its next task is not a second agent working at once)."""
        limit = st.limits.max_concurrent_runs
        if ctx.run_id is None or limit is None:
            return
        self._expire_idle(st, now_s)
        slots = _slot_ids(st)
        if len(slots) < limit or (ctx.session_id is not None and ctx.session_id in slots):
            return
        idle_ends = [
            r.last_seen_s + self._idle_timeout_s - now_s
            for r in st.active.values()
            if r.inflight == 0
        ]
        self._refuse(
            st,
            "tenant_concurrency",
            f"tenant {st.config.name!r} has {len(slots)} agent runs active, its limit is"
            f" {limit} (max_concurrent_runs): end one (x-gpupool-run-end: 1 on its last step,"
            " or POST /v1/runs/{run_id}/end) or wait for it to go idle",
            min(idle_ends, default=1.0),
        )

    async def _take_rate(
        self,
        st: _Tenant,
        ctx: RequestContext,
        need: float,
        now_s: float,
        on_wait: Callable[[], None] | None = None,
    ) -> tuple[float, _Loan | bool]:
        """Reserve `need` tokens and one request, waiting (FIFO) while the buckets refill
        (`on_wait` called before it waits). Returns the seconds waited, and what `_borrow`
        did: the loan, True (the tokens went past the own bucket to the shared buckets to
        borrow there) or False (no borrowing)."""
        tokens, requests = st.tokens, st.requests
        if tokens is None and requests is None:
            return 0.0, False

        def wait_s(at_s: float) -> tuple[float, str]:
            t = tokens.wait_s(need, at_s) if tokens is not None else 0.0
            r = requests.wait_s(1, at_s) if requests is not None else 0.0
            return (t, "token_rate") if t >= r else (r, "request_rate")

        def reserve(at_s: float) -> None:
            if tokens is not None:
                tokens.try_reserve(need, at_s)
            if requests is not None:
                requests.try_reserve(1, at_s)

        wait, reason = wait_s(now_s)
        if wait == 0.0 and not st.lock.locked():
            reserve(now_s)
            return 0.0, False
        if not st.lock.locked() and (borrowed := self._borrow(st, need, now_s)):
            return 0.0, borrowed
        end_s = min(ctx.deadline_s, now_s + self._max_wait_s.get(ctx.pool, 0.0))
        if now_s + wait > end_s:
            self._refuse_rate(st, reason, need, wait)
        if on_wait is not None:
            on_wait()
        name = st.config.name
        self.metrics.waits.labels(name, reason).inc()
        waiting = self.metrics.waiting.labels(name, reason)
        waiting.inc()
        try:
            try:
                await asyncio.wait_for(st.lock.acquire(), timeout=max(0.0, end_s - now_s))
            except TimeoutError:
                wait, reason = wait_s(self.clock())
                self._refuse_rate(st, reason, need, max(wait, 1.0))
            try:
                while True:
                    at_s = self.clock()
                    wait, reason = wait_s(at_s)
                    if wait == 0.0:
                        reserve(at_s)
                        return at_s - now_s, False
                    if borrowed := self._borrow(st, need, at_s):
                        return at_s - now_s, borrowed
                    if at_s + wait > end_s:
                        self._refuse_rate(st, reason, need, wait)
                    st.refilled.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(st.refilled.wait(), timeout=wait)
            finally:
                st.lock.release()
        finally:
            waiting.dec()
            self.metrics.wait_seconds.labels(reason).observe(self.clock() - now_s)

    def _borrow(self, st: _Tenant, need: float, now_s: float) -> _Loan | bool:
        """Reserve `need` with the shortfall borrowed from an idle tenant's bucket (see
        `borrowing`; a debt in the own bucket is paid off: its level after the loan is 0),
        when the tenant may borrow and its requests bucket holds one. Returns the loan, True
        when the shared buckets decide (store.url: the own bucket took it all) or False: not
        borrowed."""
        tokens, allowance = st.tokens, st.allowance
        if tokens is None or allowance is None:
            return False
        if st.requests is not None and st.requests.wait_s(1, now_s) > 0.0:
            return False
        if self._replica is not None:
            if self._replica.down_since_s is not None:
                return False  # no borrowing during an outage: the own buckets as they are
            # the shared buckets decide (the shortfall borrowed there, `_borrow_shared`); this
            # replica's own bucket keeps counting what it spent
            tokens.settle(0.0, need, now_s)
            if st.requests is not None:
                st.requests.try_reserve(1, now_s)
            return True
        short = need - tokens.level(now_s)
        if short <= 0.0 or allowance.wait_s(short, now_s) > 0.0 or short > allowance.capacity:
            return False
        views = [
            LenderView(o.config.name, o.tokens.level(now_s), o.tokens.capacity, o.inflight == 0)
            for o in self._tenants.values()
            if o is not st and o.tokens is not None and not o.lock.locked()
        ]
        lender_name = pick_lender(short, views)
        if lender_name is None:
            return False
        lender = self._tenants[lender_name]
        assert lender.tokens is not None
        lender.tokens.settle(0.0, short, now_s)  # the loan leaves the lender's bucket
        allowance.settle(0.0, short, now_s)
        tokens.settle(0.0, need - short, now_s)  # the rest (all it holds) from its own
        if st.requests is not None:
            st.requests.try_reserve(1, now_s)
        return _Loan(lender_name, short)

    async def _borrow_shared(self, st: _Tenant, need: float) -> Loan | None:
        """With a shared store: `need` tokens whose shortfall in the tenant's shared bucket
        is borrowed from an idle tenant's (router/governance/shared.py, `gpupool_borrow`),
        out of its shared allowance; the rest from its lease and its own shared bucket.
        Returns the loan (then the request holds `need` as if taken from the lease), None:
        not borrowed."""
        replica, tokens, allowance = self._replica, st.tokens, st.allowance
        if replica is None or tokens is None or allowance is None:
            return None
        name = st.config.name
        lenders = [  # idle here; the store decides whether idle on every replica
            (o.config.name, o.tokens.capacity, o.tokens.rate_per_s)
            for o in self._tenants.values()
            if o is not st
            and o.tokens is not None
            and not (o.inflight or o.shared_waiting or o.lock.locked())
        ]
        if not lenders:
            return None
        terms = Terms(
            tokens.capacity,
            tokens.rate_per_s,
            allowance.capacity,
            allowance.rate_per_s,
            tuple(lenders),
            self._lender_idle_after_s,
        )
        return await replica.borrow(name, need, terms)

    def _refuse_rate(self, st: _Tenant, reason: str, need: float, wait_s: float) -> None:
        name = st.config.name
        if reason == "token_rate":
            assert st.tokens is not None
            message = (
                f"tenant {name!r} is over its {st.limits.tokens_per_minute} tokens per minute:"
                f" this request reserves ~{need:.0f} tokens (prompt + expected output), the"
                f" budget holds {max(0.0, st.tokens.level(self.clock())):.0f} now"
            )
        else:
            message = (
                f"tenant {name!r} is over its {st.limits.requests_per_minute} requests per minute"
            )
        self._refuse(st, reason, f"{message}; retry after {wait_s:.1f} s", wait_s)

    def _refuse(self, st: _Tenant, code: str, message: str, retry_after_s: float) -> None:
        raise self._refusal(st, code, message, retry_after_s)

    def _slot_refusal(self, st: _Tenant) -> RateLimited:
        """The store refused the request a `max_concurrent_requests` slot."""
        return self._refusal(
            st,
            "tenant_concurrency",
            f"tenant {st.config.name!r} has {st.limits.max_concurrent_requests} requests in"
            " flight across the router replicas, its tier's limit (max_concurrent_requests)",
            1.0,
        )

    def _refusal(self, st: _Tenant, code: str, message: str, retry_after_s: float) -> RateLimited:
        self.metrics.refusals.labels(st.config.name, code).inc()
        return RateLimited(message, code, retry_after_s=max(retry_after_s, 0.001))

    def _stop(self, st: _Tenant, run: RunState, stop: Stop, now_s: float) -> None:
        self.metrics.refusals.labels(st.config.name, stop.code).inc()
        if run.stopped is not None:
            return
        run.stopped = stop
        st.runs[run.run_id] = run
        st.runs.move_to_end(run.run_id)
        self._forget_old_runs(st, now_s)
        log.info("run stopped (%s) for tenant %s", stop.code, st.config.name)
        self._end(st, run, stop.code, now_s)

    # ------------------------------------------------------------------ settling

    def dispatched(self, outcome: RequestOutcome) -> None:
        """The step reached an engine: it counts toward its run's `max_steps` (once, however
        many attempts it takes)."""
        ticket = self._tickets.get(outcome.ctx.request_id)
        if ticket is not None:
            _own_run(outcome, ticket)
        if ticket is not None and ticket.shared is not None and outcome.step_index is None:
            outcome.step_index = ticket.shared.step  # numbered in the store (None: not)
        if ticket is None or ticket.run is None or ticket.counted:
            return
        ticket.counted = True
        ticket.run.steps += 1
        self._dirty[(ticket.tenant, ticket.run.run_id)] = ticket.run

    def finished(self, outcome: RequestOutcome) -> None:
        """Settle the request's reservation to its real usage; add its tokens and
        GPU-seconds to its run and its tenant's cost windows."""
        ticket = self._tickets.pop(outcome.ctx.request_id, None)
        if ticket is None:
            self.abandon(outcome.ctx.request_id)  # failed between `prepare` and `enter`
            return
        _own_run(outcome, ticket)
        st = self._tenants[ticket.tenant]
        now = self.clock()
        used = outcome.prompt_tokens + outcome.completion_tokens
        if used == 0 and outcome.dispatched_at_s is not None and outcome.estimate is not None:
            used = outcome.estimate.prompt_tokens  # the engine read the prompt, usage unknown
        st.reserved_tokens -= ticket.reserved_tokens
        if st.tokens is not None:
            st.tokens.settle(ticket.reserved_tokens, used, now)
        if st.requests is not None and ticket.reserved_request and outcome.dispatched_at_s is None:
            st.requests.settle(1, 0, now)  # never reached an engine: the request is given back
        st.inflight -= 1
        took = ticket.shared
        if took is not None and (spec := took.speculation) is not None:
            spec.closed = True  # an answer still to come gives its slot back
            if spec.resolved and spec.error is None and outcome.step_index is not None:
                outcome.step_index = took.step  # the store's number, for the ledger
        if took is not None and took.deferred is not None:  # ended before its record's commit
            took.deferred = None
            run_id = outcome.ctx.run_id
            if ticket.counted and run_id is not None and self._replica is not None:
                self._replica.number_later(ticket.tenant, run_id)  # counted there, as before
        elif took is not None and took.step is not None and outcome.step_index is not None:
            outcome.step_index = took.step  # the store's number (a folded step's, read now)
        if took is not None and self._replica is not None:
            self._replica.give(ticket.tenant, "tokens", took.tokens - used if took.tokens else 0.0)
            if took.request and outcome.dispatched_at_s is None:
                self._replica.give(ticket.tenant, "requests", 1.0)
            if took.slot is not None:
                self._replica.release(ticket.tenant, "requests", took.slot)
            # where the run's step was answered, for its next step on any replica (not a
            # session's run: a session's home follows the session, which is not shared)
            home, step, run_id = outcome.instance_id, took.step, outcome.ctx.run_id
            alone = outcome.ctx.session_id is None
            if run_id is not None and ticket.run is not None:  # and its end, at `now`
                span_s = active_span_s(ticket.run, now, self._idle_timeout_s)
                self._replica.add_run_usage(
                    ticket.tenant, run_id, used, outcome.gpu_seconds, ended_s=now, span_s=span_s
                )
            if outcome.outcome == "ok" and home and step is not None and run_id and alone:
                lease = self._leases.get((ticket.tenant, run_id)) if took.leased else None
                if lease is not None:  # held here: the sweep writes it
                    if lease.home is None or lease.home[1] < step:
                        lease.home = (home, step, used)
                else:
                    stored = None if took.home is None else took.home.home
                    self._replica.record_home(
                        ticket.tenant, run_id, home, step, used, stored_home=stored
                    )
        gpu_s = outcome.gpu_seconds
        st.hour.add(gpu_s, now)
        st.day.add(gpu_s, now)
        self.metrics.tenant(st.config.name).tokens_settled.inc(used)
        run = ticket.run
        if run is not None:
            touch(run, now, self._idle_timeout_s)
            run.inflight -= 1
            if ticket.counted and outcome.outcome not in _STEP_OUTCOMES:
                run.steps -= 1  # the engine failed it (or never got it): not a step
            run.tokens += used
            run.gpu_seconds += gpu_s
            self._dirty[(st.config.name, run.run_id)] = run
            if ticket.run_end:
                self._end(st, run, "client_end", now)
                self._session_run_ended(st, run.run_id)
        self._check_alert(st, now)
        st.refilled.set()

    def _adopt_home(self, ctx: RequestContext, stored: NextStep | None) -> None:
        """Hand the store's home of the step's run to `on_home` (the run table keeps the later
        of it and this replica's own). Not a session's: its home follows the session across
        its runs, whose step numbers are not comparable."""
        if stored is None or stored.home is None or stored.home_step is None:
            return
        if self.on_home is not None and ctx.session_id is None and ctx.run_key is not None:
            self.on_home(ctx.run_key, stored.home, stored.home_step, stored.context_tokens)

    def _give_back(
        self, st: _Tenant, need: float, request: bool, now_s: float, loan: _Loan | None = None
    ) -> None:
        """A request refused after it took `need` (and `request`): its own part back to its
        bucket, a `loan`'s back to the lender's bucket and the borrower's allowance."""
        short = 0.0 if loan is None else loan.short
        if st.tokens is not None:
            st.tokens.settle(need - short, 0, now_s)
        if st.requests is not None and request:
            st.requests.settle(1, 0, now_s)
        st.refilled.set()
        if loan is None:
            return
        if st.allowance is not None:
            st.allowance.settle(short, 0, now_s)
        lender = self._tenants.get(loan.lender)
        if lender is not None and lender.tokens is not None:
            lender.tokens.settle(short, 0, now_s)
            lender.refilled.set()

    def _check_alert(self, st: _Tenant, now_s: float) -> None:
        cap = st.limits.cost_cap_gpu_seconds_per_hour
        if cap is None:
            return
        used_frac = _window(st.hour, st.others_hour, now_s).total(now_s) / cap
        self.metrics.cost_used_frac.labels(st.config.name).set(used_frac)
        alert_frac = self.config.governance.cost_alert_frac
        if used_frac >= alert_frac and not st.alerted:
            st.alerted = True
            self.metrics.cost_alerts.labels(st.config.name).inc()
            log.warning(
                "tenant %s used %.0f%% of its hourly cost cap (%g GPU-seconds; alert at %.0f%%)",
                st.config.name,
                used_frac * 100,
                cap,
                alert_frac * 100,
            )
        elif used_frac < alert_frac:
            st.alerted = False

    # ------------------------------------------------------------------ runs

    def restored_service(self, tenant: str, run_id: str) -> tuple[float, float] | None:
        """(GPU-seconds settled before the router's last restart, when the run was last seen
        on the router's clock) for a run restored from the store; None for any other run."""
        st = self._tenants.get(tenant)
        run = None if st is None else st.runs.get(run_id)
        if run is None or run.restored_gpu_seconds <= 0:
            return None
        return run.restored_gpu_seconds, run.last_seen_s

    def end_run(self, tenant: str, run_id: str) -> RunState | None:
        """End a run now (`POST /v1/runs/{run_id}/end`); a run a guard stopped is released,
        so its id starts a fresh run. Returns it, None when unknown."""
        st = self._tenants.get(tenant)
        if st is None:
            return None
        session = st.sessions.get(run_id)
        if run_id not in st.runs and session is not None and session.current:
            run_id = session_run_id(run_id, session.current)  # a session: its current run
        run = st.runs.get(run_id)
        if run is None:
            return None
        self._end(st, run, "client_end", self.clock())
        self._release(st, run)
        return run

    def session(self, tenant: str, session_id: str) -> dict[str, Any] | None:
        """`GET /v1/runs/{session}`: a session's runs (the latest 100), or None when the id
        is not a session the tenant has used."""
        st = self._tenants.get(tenant)
        runs_of = None if st is None else st.sessions.get(session_id)
        if runs_of is None:
            return None
        first = max(1, runs_of.last - 99)
        return {
            "object": "gpupool.session",
            "session_id": session_id,
            "runs": [session_run_id(session_id, n) for n in range(first, runs_of.last + 1)],
            "current_run": (
                session_run_id(session_id, runs_of.current) if runs_of.current else None
            ),
        }

    def _session(self, st: _Tenant, session_id: str) -> SessionRuns:
        runs_of = st.sessions.get(session_id)
        if runs_of is None:
            runs_of = st.sessions[session_id] = SessionRuns()
            self._forget_old_sessions(st)
        st.sessions.move_to_end(session_id)
        st.session_seen_s[session_id] = self.clock()
        self._dirty_sessions.add((st.config.name, session_id))
        return runs_of

    def _forget_old_sessions(self, st: _Tenant) -> None:
        while len(st.sessions) > MAX_SESSIONS_PER_TENANT:
            session_id, _ = st.sessions.popitem(last=False)
            st.session_seen_s.pop(session_id, None)

    def _release(self, st: _Tenant, run: RunState) -> None:
        """A run the client ended: its id starts a fresh run next (a guard that stopped it
        already reported why it ended)."""
        if run.ended != "client_end":
            run.ended = "client_end"
            self._dirty[(st.config.name, run.run_id)] = run
        self._session_run_ended(st, run.run_id)

    def _session_run_ended(self, st: _Tenant, run_id: str) -> None:
        """A session's run the client ended: its task's next step starts the next run."""
        session_id, _, number = run_id.rpartition(":")
        runs_of = st.sessions.get(session_id)
        if runs_of is not None and number.isdigit():
            runs_of.ended(int(number))
            self._dirty_sessions.add((st.config.name, session_id))
            if self._replica is not None:  # every replica's next step of its task: a new run
                self._replica.forget_session_run(st.config.name, session_id, int(number))

    def _end(self, st: _Tenant, run: RunState, reason: str, now_s: float) -> None:
        if run.ended is not None and run.ended != "idle_timeout":
            return
        if run.ended == "idle_timeout" and reason == "idle_timeout":
            return
        run.ended = reason
        st.active.pop(run.run_id, None)
        if self._replica is not None and reason != "idle_timeout":  # the others learn it
            self._replica.mark_run(
                st.config.name, run.run_id, None if reason == "client_end" else reason
            )
        slot_id = run.session_id or run.run_id
        if (
            self._replica is not None
            and st.limits.max_concurrent_runs is not None
            and slot_id not in _slot_ids(st)
        ):
            self._replica.release(st.config.name, "runs", self._replica.holder(f"run:{slot_id}"))
        self._dirty[(st.config.name, run.run_id)] = run
        self.metrics.runs_ended.labels(st.config.name, reason).inc()
        self.metrics.active_runs.labels(st.config.name).set(len(st.active))
        if self.on_run_end is not None:
            self.on_run_end(
                RunEnd(
                    st.config.name,
                    run.run_id,
                    reason,
                    now_s,
                    run.started_at_s,
                    run.steps,
                    run.tokens,
                    run.gpu_seconds,
                )
            )

    def _expire_idle(self, st: _Tenant, now_s: float) -> None:
        idle = [
            r
            for r in st.active.values()
            if r.inflight == 0 and now_s - r.last_seen_s >= self._idle_timeout_s
        ]
        for run in idle:
            self._end(st, run, "idle_timeout", now_s)

    def _forget_old_runs(self, st: _Tenant, now_s: float) -> None:
        """Keep at most `max_runs_per_tenant` runs (see `runtable`: ended runs first, then
        idle active ones, which end as `evicted`; never one with a step in flight)."""
        if len(st.runs) <= self._max_runs:
            return
        inflight = {run_id: run.inflight for run_id, run in st.runs.items()}
        for run_id in runs_to_forget(inflight, st.active, self._max_runs):
            run = st.runs.pop(run_id)
            if run_id in st.active:
                self._end(st, run, "evicted", now_s)

    # ------------------------------------------------------------------ reading

    def rate_headers(self, tenant: str) -> list[tuple[bytes, bytes]]:
        """No round trip: with a shared store, the shared levels this replica last learned
        (`x-gpupool-ratelimit-scope: shared` and the read's age in
        `x-gpupool-ratelimit-age-s`), else its own buckets (`scope: replica`)."""
        st = self._tenants.get(tenant)
        if st is None or st.unlimited:  # no bucket to show
            return []
        now = self.clock()
        self._apply_daily_budget(st, now)
        if self._replica is None:
            return rate_limit_headers(st.requests, st.tokens, now)
        shared = self._shared_views(st, now)
        if shared is None:
            out = rate_limit_headers(st.requests, st.tokens, now)
            return [*out, (SCOPE_HEADER, b"replica")] if out else out
        views, age_s = shared
        out = view_headers(views["requests"], views["tokens"])
        return [*out, (SCOPE_HEADER, b"shared"), (AGE_HEADER, f"{age_s:.3f}".encode())]

    def _shared_views(
        self, st: _Tenant, now: float
    ) -> tuple[dict[str, BucketView | None], float] | None:
        """The tenant's buckets as the shared store holds them for this replica (each the
        least of its own bucket and the shared level last learned plus its lease) and the
        oldest read's age; None when a limited bucket has no shared level (none learned
        yet, or the store is down): then only the replica's own view can be given."""
        replica = self._replica
        assert replica is not None
        views: dict[str, BucketView | None] = {}
        age_s = 0.0
        for name, local in (("requests", st.requests), ("tokens", st.tokens)):
            if local is None:
                views[name] = None
                continue
            learned = replica.shared_level(st.config.name, name)
            if learned is None:
                return None
            views[name] = shared_view(local, now, learned[0])
            age_s = max(age_s, learned[1])
        return views, age_s

    async def budget_now(self, tenant: TenantConfig) -> dict[str, Any]:
        """`GET /v1/budget`: `budget` after reading the tenant's shared buckets (one read of
        the database when `store.url` is set, bounded by the store's connect timeout; if it
        fails the answer is the replica's own view, `"scope": "replica"`, and says why)."""
        st = self._state(tenant)
        replica = self._replica
        problem = None
        if replica is not None:
            buckets = [
                (name, b.capacity, b.rate_per_s)
                for name, b in (("tokens", st.tokens), ("requests", st.requests))
                if b is not None
            ]
            if buckets:
                problem = await replica.read_levels(tenant.name, buckets)
        return self.budget(tenant, problem)

    def budget(self, tenant: TenantConfig, problem: str | None = None) -> dict[str, Any]:
        """What the tenant has left and when each limit refills: with a shared store, the
        shared view (`"scope": "shared"`, docs/replicas.md) as last learned (`budget_now`
        reads it first), or the replica's own (`"scope": "replica"`, `problem` saying why)."""
        st = self._state(tenant)
        now = self.clock()
        self._apply_daily_budget(st, now)
        self._expire_idle(st, now)
        lim = st.limits
        scope: dict[str, Any] = {}
        shared = None
        if self._replica is not None:
            shared = None if problem is not None else self._shared_views(st, now)
            scope = {"scope": "replica" if shared is None else "shared"}
            if shared is None and (st.tokens is not None or st.requests is not None):
                scope["scope_reason"] = problem or "no shared level read yet"
            elif shared is not None:
                scope["as_of_s"] = round(shared[1], 3)  # the read's age

        def bucket(name: str, b: TokenBucket | None) -> dict[str, Any] | None:
            if b is None:
                return None
            view = local_view(b, now) if shared is None else shared[0][name]
            assert view is not None
            return {
                "limit_per_minute": view.limit_per_minute,
                "remaining": view.remaining,
                "reset_s": round(view.reset_s, 3),
            }

        def window(cap: float | None, w: WindowSum) -> dict[str, Any] | None:
            if cap is None:
                return None
            total = w.total(now)
            return {
                "cap_gpu_seconds": cap,
                "used_gpu_seconds": round(total, 6),
                "used_frac": round(total / cap, 6),
                "reset_s": round(w.wait_below_s(cap, now), 3) if total >= cap else 0.0,
            }

        return {
            "object": "gpupool.budget",
            "tenant": tenant.name,
            "tier": tenant.tier,
            **scope,
            "tokens": bucket("tokens", st.tokens),
            "tokens_reserved": round(st.reserved_tokens),
            "requests": bucket("requests", st.requests),
            "concurrency": {
                "runs": {"limit": lim.max_concurrent_runs, "active": len(st.active)},
                "requests": {"limit": lim.max_concurrent_requests, "in_flight": st.inflight},
                "run_idle_timeout_s": self._idle_timeout_s,
            },
            "cost": {
                "hourly": window(
                    lim.cost_cap_gpu_seconds_per_hour, _window(st.hour, st.others_hour, now)
                ),
                "daily": window(lim.daily_budget_gpu_seconds, _window(st.day, st.others_day, now)),
            },
            "active_runs": [
                {
                    "run_id": r.run_id,
                    "steps": r.steps,
                    "max_steps": r.limits.max_steps,
                    "tokens": r.tokens,
                    "gpu_seconds": round(r.gpu_seconds, 6),
                    "age_s": round(now - r.started_at_s, 3),
                    "active_s": round(active_time_s(r, now, self._idle_timeout_s), 3),
                    "max_duration_s": r.limits.max_duration_s,
                    "idle_s": round(now - r.last_seen_s, 3),
                }
                for r in st.active.values()
            ],
        }

    # ------------------------------------------------------------------ reload

    def reload(self, config: Config) -> list[str]:
        """Apply `config`'s governance settings without dropping anything: tenants' budgets,
        tiers and cost caps change now (bucket levels, reservations in flight, cost windows
        and runs stay; a run keeps the guards it started with; new runs get the new ones).
        Returns the tenants it configured. API keys are not reloaded here."""
        now = self.clock()
        self.config = config
        self._task_types = dict(config.governance.task_types_s)
        self._idle_timeout_s = config.governance.run_idle_timeout_s
        self._max_wait_s = {p.name: p.queue.max_wait_s for p in config.pools}
        self._lends = any(t.borrow_max_frac for t in config.tenants)
        for tenant in config.tenants:
            st = self._tenants.get(tenant.name)
            if st is None:
                self._state(tenant)
                continue
            limits = tenant_limits(config, tenant)
            tpm, frac = limits.tokens_per_minute, tenant.borrow_max_frac
            st.config, st.limits = tenant, limits
            st.tokens = _rebucket(st.tokens, tpm, now)
            st.requests = _rebucket(st.requests, limits.requests_per_minute, now)
            st.allowance = _rebucket(st.allowance, tpm * frac if tpm and frac else None, now)
            self._decide_unlimited(st)
            self._export(st, now)
        if self._replica is not None:  # a parked slot would skip a lowered limit's check
            self._replica.release_parked()
            self._replica.idle_timeout_s = self._idle_timeout_s
        log.info("governance settings reloaded for %d tenants", len(config.tenants))
        return [t.name for t in config.tenants]

    # ------------------------------------------------------------------ state

    def _state(self, tenant: TenantConfig) -> _Tenant:
        st = self._tenants.get(tenant.name)
        if st is not None:
            return st
        limits = tenant_limits(self.config, tenant)
        now = self.clock()
        tpm, rpm = limits.tokens_per_minute, limits.requests_per_minute
        frac = tenant.borrow_max_frac
        st = _Tenant(
            config=tenant,
            limits=limits,
            tokens=None if tpm is None else TokenBucket(tpm, tpm / 60.0, now),
            requests=None if rpm is None else TokenBucket(rpm, rpm / 60.0, now),
            allowance=(
                None if tpm is None or not frac else TokenBucket(tpm * frac, tpm * frac / 60, now)
            ),
        )
        self._decide_unlimited(st)
        self._tenants[tenant.name] = st
        self._apply_saved(st)
        return st

    def _decide_unlimited(self, st: _Tenant) -> None:
        """Whether the tenant's requests outside any run have nothing to enforce (`enter_now`):
        no token or request bucket (nor a borrowing allowance), no request slot, no hourly
        cost cap or daily budget. A run's step is always governed (its guards come from its
        class). Decided per config: `_state` and `reload` call it.

        A shared store (store.url) changes nothing here: for such a request `enter` takes
        nothing from it (no bucket to take from, hence no lease and nothing an outage policy
        refuses; no request slot, the store's only in-flight count; no run to number or
        speculate on), and what the replicas share of the tenant, its cost windows, is kept
        by `finished` and published by the sweep once a cap or budget needs it."""
        lim = st.limits
        st.unlimited = (
            st.tokens is None
            and st.requests is None
            and st.allowance is None
            and lim.max_concurrent_requests is None
            and lim.cost_cap_gpu_seconds_per_hour is None
            and lim.daily_budget_gpu_seconds is None
        )
        st.plain = StepSignals(tenant=st.config)

    def _apply_daily_budget(self, st: _Tenant, now_s: float) -> None:
        """A daily budget scales the tenant's rates by what is left of it (never below
        `governance.daily_min_rate_frac`)."""
        daily = st.limits.daily_budget_gpu_seconds
        if daily is None:
            return
        floor = self.config.governance.daily_min_rate_frac
        frac = max(floor, 1.0 - _window(st.day, st.others_day, now_s).total(now_s) / daily)
        for bucket, per_minute in (
            (st.tokens, st.limits.tokens_per_minute),
            (st.requests, st.limits.requests_per_minute),
        ):
            if bucket is not None and per_minute is not None:
                bucket.set_rate(per_minute * frac, per_minute * frac / 60.0, now_s)

    def refresh_gauges(self) -> None:
        """Set each tenant's gauges (`GET /metrics` calls it; the sweep too, every second):
        not per request (four `Gauge.set`, ~4 us of CPU)."""
        now = self.clock()
        for st in self._tenants.values():
            self._export(st, now)

    def _export(self, st: _Tenant, now_s: float) -> None:
        series = self.metrics.tenant(st.config.name)
        if st.tokens is not None:
            series.tokens_remaining.set(max(0.0, st.tokens.level(now_s)))
            series.tokens_reserved.set(st.reserved_tokens)
        series.inflight.set(st.inflight)
        series.active_runs.set(len(st.active))


def _rebucket(
    bucket: TokenBucket | None, per_minute: float | None, now_s: float
) -> TokenBucket | None:
    """`bucket` at a new per-minute limit (its level kept), a new full one, or None."""
    if per_minute is None:
        return None
    if bucket is None:
        return TokenBucket(per_minute, per_minute / 60.0, now_s)
    bucket.set_rate(per_minute, per_minute / 60.0, now_s)
    return bucket


def _own_run(outcome: RequestOutcome, ticket: _Ticket) -> None:
    """The outcome names the run the step was counted in: a session's step the store mapped
    to another run than `prepare`'s guess carries the store's (ledger, meter, run table)."""
    run = ticket.run
    if run is not None and outcome.ctx.run_id != run.run_id:
        outcome.ctx = dataclasses.replace(outcome.ctx, run_id=run.run_id)


def _leased(ctx: RequestContext) -> bool:
    """Whether the request's run is numbered under leases when they are on (not a
    session's: `shared.leasable`)."""
    return ctx.session_id is None and ctx.run_id is not None and leasable(ctx.run_id)


def _slot_ids(st: _Tenant) -> set[str]:
    """What holds a `max_concurrent_runs` slot: each active session (its runs share one),
    each active run outside a session."""
    return {r.session_id or r.run_id for r in st.active.values()}


def _window(own: WindowSum, others: WindowSum | None, now_s: float) -> WindowSum:
    """A tenant's cost window: its own, or with the other replicas' slices (store.url), in
    time order (`wait_below_s` reads the oldest first)."""
    if others is None:
        return own
    merged = WindowSum(own.window_s, round(own.window_s / own.slice_s))
    for start, amount in sorted((*own.slices(now_s), *others.slices(now_s))):
        merged.add(amount, start)
    return merged
