"""Admission's shell: the queues, the leases, and the event-driven dispatch around the pure
decision in `router.admission.decision`.

`await admitter.admit(ctx, estimate)` returns a `Lease` on the instance the request goes to:
at once when the pool's queue is empty and the sequence fits somewhere (the common case, no
await), else after waiting in the pool's `PoolQueue` until a lease is released, a scrape
arrives or the allocation changes and it is at the head and fits. It raises
`CapacityExceeded` (429: queue_full, shed, queue_timeout, deadline_unmeetable) or
`NoHealthyInstance` (503). A request cancelled while it waits (its client left) leaves the
queue at once and never reaches an engine.

The decision, the pick and the lease happen in one synchronous step, so no other request can
take the headroom a grant saw. The synchronous core is public, so the simulator
(`router.simulate`) runs the same code in simulated time: `admit_now` (a lease at once, a
refusal, or None: it must queue), `enqueue` (a `Waiter` joins its pool's queue, with the
waiting bookkeeping: steps waiting for their run's home, attained service), `dispatch_once(now)`
(one pass over the queued entries in order: decide → pick → lease, or keep waiting: for the
run's home, placement patience, affinity-or-move) and `withdraw` (an entry leaves unserved).
The async shell (`admit`, `pump`) only awaits, resolves futures and schedules passes.

A retry after a refused connection re-picks among the instances that fit now, without
queueing again (`repick`); only when none is left does it queue again.

With `router.admission: off` every request is leased to the best healthy instance at once
(the behaviour before admission, kept for comparison); reservations are still tracked so the
metrics show what admission would have seen.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

from pools.allocation import Allocation, PoolMap
from pools.config import Config, PoolConfig
from pools.fleet import Fleet, InstanceState, Lease
from router.admission.decision import Grant, InstanceView, Need, Reject, Wait, decide, fill_frac
from router.admission.engine_kv import EngineKV
from router.admission.estimate import Estimate
from router.admission.forecast import FORECAST_WINDOW_S, DemandForecaster, Forecast
from router.admission.picking import (
    Candidate,
    Picker,
    PickRequest,
    RunAffinity,
    expected_home_wait_s,
    uncached_prefill_tokens_per_s,
)
from router.admission.prefill_hold import (
    PrefillHold,
    hold_applies,
    hold_min_tokens,
    holding_target_s,
    serial_hold_ends,
)
from router.admission.queueing import AttainedService, PoolQueue, QueueEntry, QueueFull, RunUsage
from router.admission.shared_reservations import SharedReservations
from router.admission.tool_pauses import PauseHolds
from router.errors import CapacityExceeded, NoHealthyInstance
from router.metrics import RouterMetrics
from router.request import RequestContext
from router.runtable import RunTable

__all__ = ["Admitter", "Reserve", "Waiter"]

log = logging.getLogger(__name__)

_DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class _WaitsForHome:
    """`_try`'s answer for a sequence that fits but waits for its run's home instance."""


WAITS_FOR_HOME = _WaitsForHome()


class Waiter(Protocol):
    """A queued request as `dispatch_once` sees it: what it needs, where it may not go, and
    how to answer it. `admitted` and `refused` are called at most once, and never once
    `gone()` is true."""

    @property
    def ctx(self) -> RequestContext: ...

    @property
    def need(self) -> Need: ...

    @property
    def exclude(self) -> frozenset[str]: ...

    def gone(self) -> bool:
        """The request no longer waits (its client left, it timed out, it was shed)."""
        ...

    def admitted(self, lease: Lease) -> None: ...

    def refused(self, err: CapacityExceeded) -> None: ...


@dataclass(eq=False, slots=True)
class _Waiter:
    """The router's waiter: a future the request's task awaits."""

    ctx: RequestContext
    need: Need
    future: asyncio.Future[Lease]
    exclude: frozenset[str]

    def gone(self) -> bool:
        return self.future.done()

    def admitted(self, lease: Lease) -> None:
        self.future.set_result(lease)

    def refused(self, err: CapacityExceeded) -> None:
        if not self.future.done():
            self.future.set_exception(err)


class Admitter:
    def __init__(
        self,
        config: Config,
        fleet: Fleet,
        pool_map: PoolMap,
        picker: Picker,
        metrics: RouterMetrics,
        affinity: RunAffinity,
        *,
        clock: Callable[[], float] = time.monotonic,
        run_usage: Callable[[Hashable, float], RunUsage | None] | None = None,
    ) -> None:
        """`run_usage((tenant, run_id), now_s)`: a run's attained service (the accountant's
        `run_usage`), which `queue.order: run_las` pools order their queue by. The queues keep
        what they know of each run in the affinity's `RunTable` (the router's one)."""
        self.config = config
        self.enabled = config.router.admission == "on"
        self.fleet = fleet
        self.pool_map = pool_map
        self.picker = picker
        self.metrics = metrics
        self.affinity = affinity
        self.clock = clock
        self.margin_frac = config.router.kv_margin_frac
        self.unknown_kv_max_concurrency = config.router.unknown_kv_max_concurrency
        self.borrow_max_frac = config.rebalancer.borrow_max_frac
        self.peers: SharedReservations | None = None  # set by the gateway on a shared store
        self.pools: dict[str, PoolConfig] = {p.name: p for p in config.pools}
        runs = affinity.runs
        self.queues = {
            p.name: PoolQueue(
                p.name,
                max_depth=p.queue.max_depth,
                order=p.queue.order,
                aging_s=p.queue.run_las_aging_s,
                max_attained_gpu_s=p.queue.run_las_max_attained_gpu_s or math.inf,
                max_slowdown=p.queue.run_las_max_slowdown or math.inf,
                runs=runs,
            )
            for p in config.pools
        }
        self._run_usage = run_usage
        self._attained = {
            p.name: AttainedService(
                self._shared_run_usage,
                idle_decay_s=p.queue.run_las_idle_decay_s,
                pool=p.name,
                runs=runs,
            )
            for p in config.pools
            if p.queue.order == "run_las" and run_usage is not None
        }
        self._tpot_target_s = {p.name: p.slo.tpot_p95_ms / 1e3 for p in config.pools}
        self._allocation_cache: _ByAllocation | None = None
        # per pool: the queued entries of runs with a home, and how many wait for each home
        self._homebound: dict[str, dict[QueueEntry, str]] = {p.name: {} for p in config.pools}
        self._awaited: dict[str, Counter[str]] = {p.name: Counter() for p in config.pools}
        self._pump_scheduled = False
        # admission.reserve: forecast, admission.prefill_hold_* (docs/admission.md)
        adm = config.admission
        self.reserve_forecast = adm.reserve == "forecast"
        self.prefill_hold: PrefillHold | None = None
        if adm.prefill_hold_min_tokens is not None:
            fixed = adm.prefill_hold_min_tokens
            self.prefill_hold = PrefillHold(
                None if fixed == "auto" else fixed,
                adm.prefill_hold_budget_frac,
                adm.prefill_hold_max_wait_s,
                adm.prefill_hold_serial,
            )
        # queued entries a prefill hold keeps waiting: since when (the first pass that held)
        self._held_since: dict[QueueEntry, float] = {}
        # the reasons a queued entry has been found waiting for (gpupool_admission_waits_total)
        self._wait_reasons: dict[QueueEntry, set[str]] = {}
        self._hold_spent: set[QueueEntry] = set()  # held max_wait_s already: no more holds
        self._ttft_target_s = {p.name: p.slo.ttft_p95_ms / 1e3 for p in config.pools}
        self._forecasts: dict[tuple[str, str], DemandForecaster] = {}
        self._started_at_s = clock()
        self._wake: asyncio.TimerHandle | None = None
        self._wake_at_s = math.inf
        fleet.on_capacity_change(lambda _iid: self.schedule_pump())
        # KV use by what the engine allocates (router/admission/engine_kv.py)
        self.engine_kv = EngineKV()
        # admission.tool_pause_hold: paused runs' context blocks (router/admission/tool_pauses.py)
        self.pauses: PauseHolds | None = None
        # new_runs: the holds count only against sequences with no home yet (a run's first
        # step, a request outside a run), not against the later steps of other runs
        self._pauses_against_new_only = adm.tool_pause_hold_against == "new_runs"
        if adm.tool_pause_hold:
            self.pauses = PauseHolds(
                adm.tool_pause_max_s, adm.tool_pause_margin_frac, adm.tool_pause_max_frac
            )
        self._lease_runs: dict[Lease, Hashable] = {}  # with pauses: each live lease's run
        self._streamed: set[Lease] = set()  # with a prefill hold: live leases that stream
        fleet.on_lease_event(self._lease_event)
        pool_map.on_change(lambda _alloc: self.schedule_pump())

    # ------------------------------------------------------------------ the request's calls

    async def admit(
        self, ctx: RequestContext, estimate: Estimate, *, exclude: frozenset[str] = frozenset()
    ) -> Lease:
        need = self.need(ctx, estimate)
        now = self.clock()
        lease = self.admit_now(ctx, need, now, exclude)
        if lease is not None:
            return lease
        return await self._wait(ctx, need, exclude, now)

    def admit_now(
        self, ctx: RequestContext, need: Need, now_s: float, exclude: frozenset[str] = frozenset()
    ) -> Lease | None:
        """`admit`'s synchronous step: a lease at once (the pool's queue is empty and the
        sequence fits), or None (it must queue: `enqueue`). Raises `CapacityExceeded` or
        `NoHealthyInstance` for a refusal."""
        pauses, run = self.pauses, ctx.home_key
        if pauses is not None and run is not None and pauses.arrived(run, now_s):
            self.schedule_pump()  # its hold ended: others may fit
        if not self.enabled:
            lease = self._lease_unchecked(ctx, need, exclude)
            if lease is None:
                raise self._no_instance(ctx.pool)
            return lease
        queue = self.queues[ctx.pool]
        result: Lease | Grant | Wait | Reject | _WaitsForHome | None
        if len(queue) == 0:
            wait_s = 0.0  # what `expected_wait_s` answers for nobody ahead
            result = self._try(ctx, need, now_s, exclude)
            if isinstance(result, Lease):
                if log.isEnabledFor(logging.DEBUG):  # off: not even the arguments
                    log.debug(
                        "%s: admitted at once to %s (pool %s, %d tokens)",
                        ctx.request_id,
                        result.instance_id,
                        ctx.pool,
                        need.total_tokens,
                    )
                return result
        else:  # others wait: never jump the queue, only check the deadline can be met
            wait_s = queue.expected_wait_s(len(queue), now_s, default_s=0.0)
            result = decide(self._views(ctx.pool, now_s), need, now_s, queue_wait_s=wait_s)
        if isinstance(result, Reject):
            raise self._reject(ctx, result, wait_s)
        return None

    def repick(
        self, ctx: RequestContext, estimate: Estimate, exclude: frozenset[str]
    ) -> Lease | None:
        """A lease on another instance that fits now (for a retry), or None."""
        need = self.need(ctx, estimate)
        if not self.enabled:
            return self._lease_unchecked(ctx, need, exclude)
        result = self._try(ctx, need, self.clock(), exclude)
        return result if isinstance(result, Lease) else None

    # ------------------------------------------------------------------ deciding

    def need(self, ctx: RequestContext, estimate: Estimate) -> Need:
        """The request's need. A later step of a run, on the instance that served its last
        step, expects the last step's context (prompt + completion) in the prefix cache, as
        often as that instance's measured prefix-cache hit rate says cached tokens survive."""
        cached_on = self.affinity.get(ctx.home_key)
        cached = 0
        if cached_on is not None:
            state = self.fleet.get(cached_on)
            hit = state.prefix_hit_frac if state is not None else None
            context = self.affinity.context_tokens(ctx.home_key)
            cached = int(min(estimate.prompt_tokens, context) * (hit or 0.0))
        return Need(
            estimate.prompt_tokens,
            estimate.total_tokens,
            ctx.deadline_s,
            cached_on=cached_on,
            cached_tokens=cached,
            prefix=estimate.prefix,
        )

    def _views(
        self, pool: str, now_s: float, *, hold: bool = True, paused: bool = True
    ) -> list[InstanceView]:
        """`hold`: a prefill hold may keep the request waiting (False once it has been held
        for `admission.prefill_hold_max_wait_s`); `paused`: the paused runs' held blocks
        count as used (`_pauses_apply`)."""
        by_allocation = self._by_allocation()
        allocation = by_allocation.allocation
        views = []
        for instance_id in by_allocation.instances_for(pool):
            state = self.fleet.get(instance_id)
            if state is None:
                continue
            frac = allocation.frac(instance_id, pool)
            views.append(self._view(pool, state, frac, now_s, hold=hold, paused=paused))
        return views

    def instances_for(self, pool: str) -> tuple[str, ...]:
        """The instances taking new work for `pool` under the current allocation (read once
        per allocation)."""
        return self._by_allocation().instances_for(pool)

    def _by_allocation(self) -> _ByAllocation:
        """What depends only on the current allocation, kept until the pool map replaces it."""
        allocation = self.pool_map.current
        cached = self._allocation_cache
        if cached is None or cached.allocation is not allocation:
            cached = self._allocation_cache = _ByAllocation(allocation, self._tpot_target_s)
        return cached

    def _borrow_views(self, pool: str, now_s: float) -> list[InstanceView]:
        """Other pools' instances that `pool`'s overflow may borrow: `rebalancer.borrow_max_frac`
        of the lenders' part, and only of lenders with nobody waiting, so the owner's queue
        always wins a free slot. A borrowed sequence is never preempted by the router; it is
        capped, and admitted only after the request fits nowhere in its own pool."""
        if self.borrow_max_frac <= 0:
            return []
        allocation = self.pool_map.current
        views = []
        for instance_id, by_pool in allocation.fracs.items():
            if by_pool.get(pool, 0.0) > 0 or instance_id in allocation.draining:
                continue
            lent = sum(f for q, f in by_pool.items() if f > 0 and len(self.queues[q]) == 0)
            state = self.fleet.get(instance_id)
            if lent > 0 and state is not None:
                view = self._view(pool, state, self.borrow_max_frac * lent, now_s, lent=False)
                views.append(view)
        return views

    def _view(
        self,
        pool: str,
        state: InstanceState,
        frac: float,
        now_s: float,
        *,
        lent: bool = True,
        hold: bool = True,
        paused: bool = True,
    ) -> InstanceView:
        """`pool`'s view of the instance with `frac` of it; `lent`: past `frac` it may use
        what the reserves of `reserve: forecast` leave (not on another pool's instance, where
        `frac` is `rebalancer.borrow_max_frac`'s cap); `hold`: a prefill hold may apply."""
        reserve_forecast, others_blocks, others_slots = False, 0.0, 0
        if self.reserve_forecast and lent:
            reserve_forecast = True
            others_blocks, others_slots = self._others_reserve(pool, state, now_s)
        hold_min = None
        if self.prefill_hold is not None and hold:
            hold_min = self._prefill_hold(pool, state, now_s, self.prefill_hold)
        reading = state.reading
        # the fields in their order, positional: half the cost of naming each (issue 28)
        view = InstanceView(
            state.spec.instance_id,
            frac,
            state.healthy,
            self.fleet.is_fresh(state),  # fresh
            state.capacity_blocks or 0,  # capacity_blocks
            (reading.block_size if reading else None) or _DEFAULT_BLOCK_SIZE,  # block_size
            self.engine_kv.used_blocks(state)  # used_blocks
            + (self.pause_held_blocks(state, now_s) if paused else 0),
            state.reserved_by_pool.get(pool, 0),  # pool_reserved_blocks
            state.running_by_pool.get(pool, 0),  # pool_running
            state.inflight,  # running
            state.op.limit(self._tpot_target_s[pool]),  # pool_limit
            self.instance_limit(state),  # instance_limit
            state.pending_prefill_tokens(now_s),  # pending_prefill_tokens
            uncached_prefill_tokens_per_s(state.prefill_tokens_per_s, state.prefix_hit_frac),
            self._ttft_target_s[pool],  # ttft_target_s
            self.margin_frac,  # margin_frac
            _step_s(state),  # step_s
            # kv_known: the engine reports its KV capacity (`InstanceState.kv_capacity`)
            reading is None or reading.num_gpu_blocks is not None,
            reserve_forecast,
            others_blocks,  # others_reserve_blocks
            others_slots,  # others_reserve_slots
            hold_min,  # hold_prefill_min_tokens
        )
        # other router replicas' reservations there (router/admission/shared_reservations.py)
        return view if self.peers is None else self.peers.adjust(pool, state, view)

    # ------------------------------------------------------------------ sharing a split instance

    def _others_reserve(self, pool: str, state: InstanceState, now_s: float) -> tuple[float, int]:
        """What `admission.reserve: forecast` keeps free on the instance for the pools other
        than `pool`: (KV blocks, batch places)."""
        blocks, slots = 0.0, 0
        for reserve in self.reserves(state, now_s).values():
            if reserve.pool != pool:
                blocks += reserve.blocks
                slots += reserve.slots
        return blocks, slots

    def forecaster(self, pool: str, instance_id: str) -> DemandForecaster:
        """`pool`'s demand forecaster on the instance (made at first use)."""
        key = (pool, instance_id)
        forecaster = self._forecasts.get(key)
        if forecaster is None:
            for gone in [k for k in self._forecasts if self.fleet.get(k[1]) is None]:
                del self._forecasts[gone]  # engines that left the fleet
            adm = self.config.admission
            forecaster = self._forecasts[key] = DemandForecaster(
                horizon_s=adm.headroom_horizon_s,
                quantile=adm.headroom_quantile,
                window_s=FORECAST_WINDOW_S,
                started_at_s=self._started_at_s,
                on_error=self.metrics.forecast_error.labels(pool).observe,
            )
        return forecaster

    def reserves(self, state: InstanceState, now_s: float) -> dict[str, Reserve]:
        """What is kept free on the instance for each pool allocated there (`reserve:
        forecast`): of its unused share (its share of the usable blocks and of the batch, less
        what it holds), its forecast need over the horizon; all of it while the pool has
        requests waiting, or while its forecast is unmeasured in the router's first
        `FORECAST_WINDOW_S`."""
        iid = state.spec.instance_id
        usable = (state.capacity_blocks or 0) * (1.0 - self.margin_frac)
        instance_limit = self.instance_limit(state)
        out = {}
        for pool, frac in self.pool_map.current.pools_of(iid).items():
            if frac <= 0:
                continue
            limit = min(state.op.limit(self._tpot_target_s[pool]), instance_limit)
            unused_blocks = max(0.0, frac * usable - state.reserved_by_pool.get(pool, 0))
            unused_slots = max(0, max(1, int(frac * limit)) - state.running_by_pool.get(pool, 0))
            forecast = self.forecaster(pool, iid).forecast(now_s)
            waiting = len(self.queues[pool]) > 0
            cold = not forecast.measured and now_s - self._started_at_s < FORECAST_WINDOW_S
            if waiting or cold:
                blocks, slots = unused_blocks, unused_slots
            else:
                blocks = min(unused_blocks, float(forecast.need_blocks))
                slots = min(unused_slots, forecast.need_slots)
            out[pool] = Reserve(pool, blocks, slots, forecast, waiting, cold)
        return out

    def capacity_by_pool(self, state: InstanceState, now_s: float) -> dict[str, Any]:
        """Per pool allocated on the instance or holding sequences there: its share of the
        usable KV blocks and of the batch, what it holds of them (owned) and past them
        (borrowed), and with `reserve: forecast` what is kept free for it and its forecast
        (`/admin/pools`)."""
        iid = state.spec.instance_id
        fracs = self.pool_map.current.pools_of(iid)
        usable = (state.capacity_blocks or 0) * (1.0 - self.margin_frac)
        instance_limit = self.instance_limit(state)
        reserves = self.reserves(state, now_s) if self.reserve_forecast else {}
        out: dict[str, Any] = {}
        for pool in sorted(set(fracs) | set(state.running_by_pool)):
            frac = fracs.get(pool, 0.0)
            held = state.reserved_by_pool.get(pool, 0)
            running = state.running_by_pool.get(pool, 0)
            if frac <= 0 and running == 0:
                continue
            share_blocks = frac * usable
            limit = min(state.op.limit(self._tpot_target_s[pool]), instance_limit)
            share_slots = max(1, int(frac * limit)) if frac > 0 else 0
            entry: dict[str, Any] = {
                "frac": round(frac, 4),
                "share_blocks": round(share_blocks, 1),
                "owned_blocks": round(min(float(held), share_blocks), 1),
                "borrowed_blocks": round(max(0.0, held - share_blocks), 1),
                "share_slots": share_slots,
                "owned_slots": min(running, share_slots),
                "borrowed_slots": max(0, running - share_slots),
            }
            reserve = reserves.get(pool)
            if reserve is not None:
                fc = reserve.forecast
                entry["reserve"] = {
                    "blocks": round(reserve.blocks, 1),
                    "slots": reserve.slots,
                    "why": "waiting" if reserve.waiting else "cold" if reserve.cold else "forecast",
                    "forecast": {
                        "blocks": fc.blocks,
                        "slots": fc.slots,
                        "rate_per_s": round(fc.rate_per_s, 3),
                        "service_s": round(fc.service_s, 3),
                        "mean_in_flight": round(fc.mean_in_flight, 3),
                        "running": fc.running,  # the count its need is beyond
                        # the cap by the window's measured peak (None: the model alone)
                        "measured_blocks": fc.measured_blocks,
                        "measured_slots": fc.measured_slots,
                    },
                }
            out[pool] = entry
        return out

    def _prefill_hold(
        self, pool: str, state: InstanceState, now_s: float, hold: PrefillHold
    ) -> int | None:
        """The hold's threshold (tokens to prefill) for `pool` on the instance while a
        request of a pool with a stricter TTFT target is in its prefill there, or (`serial`)
        while a stricter pool is allocated there and another long prefill of a pool no
        stricter than `pool` is in its prefill there (`router.admission.prefill_hold`), else
        None. Schedules a dispatch pass for when the last such hold ends."""
        own_s = self._ttft_target_s[pool]
        in_prefill = [lease for lease in state.leases if lease.first_token_at_s is None]
        rate = uncached_prefill_tokens_per_s(state.prefill_tokens_per_s, state.prefix_hit_frac)
        thresholds = []
        holding = holding_target_s(
            ((lease.acquired_at_s, self._lease_target_s(lease)) for lease in in_prefill),
            own_s,
            now_s,
        )
        if holding is not None:
            strictest_s, ends_s = holding
            self._wake_at(ends_s)
            thresholds.append(hold_min_tokens(hold, strictest_s, rate))
        if hold.serial and in_prefill:
            fracs = self.pool_map.current.pools_of(state.spec.instance_id)
            stricter = [
                t
                for p, f in fracs.items()
                if f > 0 and (t := self._ttft_target_s.get(p, math.inf)) < own_s
            ]
            threshold = hold_min_tokens(hold, min(stricter), rate) if stricter else None
            if threshold is not None:
                ends = serial_hold_ends(
                    (
                        (
                            lease.prompt_tokens,
                            self._lease_target_s(lease),
                            lease.acquired_at_s,
                            lease.prefill_done_at_s,
                            lease in self._streamed,
                        )
                        for lease in in_prefill
                    ),
                    own_s,
                    threshold,
                    now_s,
                )
                if ends is not None:
                    self._wake_at(ends)
                    thresholds.append(threshold)
        held = [t for t in thresholds if t is not None]
        return min(held) if held else None

    def _lease_target_s(self, lease: Lease) -> float:
        return self._ttft_target_s.get(lease.pool, math.inf)

    def _wake_at(self, at_s: float) -> None:
        """A dispatch pass at `at_s` (the admitter's clock) unless one is due sooner."""
        if at_s >= self._wake_at_s:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # the simulator passes at every event
        if self._wake is not None:
            self._wake.cancel()
        self._wake_at_s = at_s

        def wake() -> None:
            self._wake, self._wake_at_s = None, math.inf
            self.pump()

        self._wake = loop.call_later(max(0.0, at_s - self.clock()), wake)

    def _pauses_apply(self, ctx: RequestContext) -> bool:
        """Whether the paused runs' held blocks count against this request: always, or with
        `admission.tool_pause_hold_against: new_runs` only while it has no home (a run's
        first step, a request outside a run): new runs wait for room beyond the paused runs'
        contexts, the runs in progress do not wait for each other's."""
        if not self._pauses_against_new_only:
            return True
        return ctx.home_key is None or self.affinity.get(ctx.home_key) is None

    def pause_held_blocks(self, state: InstanceState, now_s: float) -> int:
        """KV blocks held on the instance for runs paused between steps (0 without
        `admission.tool_pause_hold` or a known capacity)."""
        if self.pauses is None or not state.capacity_blocks:
            return 0
        return self.pauses.held_blocks(state.spec.instance_id, state.capacity_blocks, now_s)

    def _pause_started(self, lease: Lease) -> None:
        """A run's step ended: hold its context on the instance (unless governance ended the
        run), and look again when the hold passes."""
        run = self._lease_runs.pop(lease, None)
        if self.pauses is None or run is None or self.fleet.get(lease.instance_id) is None:
            return
        record = self.affinity.runs.get(run)
        if record is not None and record.ended:
            self.pauses.forget(run)
            return
        now = self.clock()
        self._wake_at(self.pauses.ended(run, lease.instance_id, lease.blocks, lease.pool, now))

    def _lease_event(self, lease: Lease, event: str) -> None:
        """A lease's first token (a prefill hold may end: dispatch) or its release (its pool's
        forecaster learns the service time)."""
        if event == "first":
            if self.prefill_hold is not None:
                self.schedule_pump()
            return
        self._streamed.discard(lease)
        self.engine_kv.released(lease)
        self._pause_started(lease)
        if self.fleet.get(lease.instance_id) is None:  # its engine left: forget its forecasts
            if self.pauses is not None:
                self.pauses.forget_instance(lease.instance_id)
            for gone in [k for k in self._forecasts if k[1] == lease.instance_id]:
                del self._forecasts[gone]
            return
        if self.reserve_forecast:
            forecaster = self._forecasts.get((lease.pool, lease.instance_id))
            if forecaster is not None:
                forecaster.departed(self.clock(), lease.blocks, lease.acquired_at_s)

    def instance_limit(self, state: InstanceState) -> int:
        """The operating point for the strictest TPOT target among the instance's pools; on an
        engine that does not report its KV capacity, at most `unknown_kv_max_concurrency`
        (nothing else keeps it short of running out of KV blocks)."""
        target_s = self._by_allocation().strictest_tpot_s(state.spec.instance_id)
        limit = state.op.limit(1e9 if target_s is None else target_s)
        if state.kv_capacity == "unknown":
            return min(limit, self.unknown_kv_max_concurrency)
        return limit

    @staticmethod
    def _block_size(state: InstanceState) -> int:
        reading = state.reading
        return (reading.block_size if reading else None) or _DEFAULT_BLOCK_SIZE

    def _try(
        self,
        ctx: RequestContext,
        need: Need,
        now_s: float,
        exclude: frozenset[str],
        waited_s: float = 0.0,
        *,
        queued: bool = False,
        hold: bool = True,
    ) -> Lease | Reject | Wait | _WaitsForHome:
        """Lease at once if the sequence fits; a `Reject`; `WAITS_FOR_HOME` (it fits, but the
        placement rule keeps it for its run's home instance, full now); or a `Wait` (it fits
        nowhere; why). `queued`: the request is in its pool's queue (it is then among the
        steps counted as waiting for its home); `hold`: a prefill hold may keep it."""
        views = self._views(ctx.pool, now_s, hold=hold, paused=self._pauses_apply(ctx))
        decision = decide(views, need, now_s)
        if not isinstance(decision, Grant):
            if isinstance(decision, Reject):
                return decision
            return self._borrow(ctx, need, now_s, exclude) or decision
        allowed = frozenset(decision.instance_ids) - exclude
        if not allowed:
            # it fits only where it may not go (a follow-up pinned to the engine that stored
            # its response, a retry's tried instances): it keeps its place, the rest may go
            return WAITS_FOR_HOME
        free = {v.instance_id: _free_slots(v) for v in views}
        fill = _fills(views) if need.prefix is not None else None
        lease = self._lease(
            ctx,
            need,
            allowed,
            exclude,
            now_s=now_s,
            waited_s=waited_s,
            free=free,
            fill=fill,
            queued=queued,
        )
        return WAITS_FOR_HOME if lease is None else lease

    def _borrow(
        self, ctx: RequestContext, need: Need, now_s: float, exclude: frozenset[str]
    ) -> Lease | None:
        """A lease on another pool's idle capacity (see `_borrow_views`), or None. The lease
        is the borrower's (its pool's counts, its GPU-seconds)."""
        views = self._borrow_views(ctx.pool, now_s)
        if not views or not isinstance(decision := decide(views, need, now_s), Grant):
            return None
        allowed = frozenset(decision.instance_ids) - exclude
        cands = [
            Candidate(state, v.frac)
            for v in views
            if v.instance_id in allowed and (state := self.fleet.get(v.instance_id)) is not None
        ]
        req = PickRequest(
            ctx.pool,
            ctx.home_key,
            exclude=exclude,
            allowed=allowed,
            prefix=need.prefix,
            fill_frac=_fills(views) if need.prefix is not None else None,
        )
        chosen = self.picker.pick(req, cands)
        if chosen is None:
            return None
        self.metrics.borrowed.labels(ctx.pool).inc()
        return self._acquire(chosen.state, ctx.pool, need, ctx.home_key, ctx.stream)

    def _home_wait_s(self, pool: str, need: Need, awaited: Counter[str]) -> float | None:
        """Expected wait for a slot on the run's home (`expected_home_wait_s`): its running
        sequences each take what this step is expected to (its output tokens at the home's
        TPOT for that batch), and `awaited` steps wait for it already. None when there is no
        home, nothing runs there, or its TPOT is unknown."""
        home = need.cached_on
        state = self.fleet.get(home) if home is not None else None
        if home is None or state is None or state.inflight <= 0:
            return None
        tpot_s = state.op.tpot_estimate_s(state.inflight)
        if not tpot_s:
            return None
        output_tokens = max(1, need.total_tokens - need.prompt_tokens)
        return expected_home_wait_s(
            running=state.inflight, waiting_ahead=awaited[home], step_s=output_tokens * tpot_s
        )

    def _lease(
        self,
        ctx: RequestContext,
        need: Need,
        allowed: frozenset[str] | None,
        exclude: frozenset[str],
        *,
        now_s: float | None = None,
        waited_s: float = 0.0,
        free: dict[str, int] | None = None,
        fill: dict[str, float] | None = None,
        queued: bool = False,
    ) -> Lease | None:
        """`fill`: each instance's `fill_frac` for the cached-prefix score (None with a
        prefix lookup: computed here, as for admission off)."""
        by_allocation = self._by_allocation()
        cands = self.picker.candidates(
            by_allocation.allocation, ctx.pool, by_allocation.instances_for(ctx.pool)
        )
        if need.prefix is not None and fill is None:
            fill = _fills(self._views(ctx.pool, self.clock() if now_s is None else now_s))
        awaited = self._awaited[ctx.pool]
        if queued and need.cached_on is not None:  # the others, not this request
            awaited = awaited - Counter({need.cached_on: 1})
        home_wait_s = (
            None
            if now_s is None or ctx.run_id is None
            else self._home_wait_s(ctx.pool, need, awaited)
        )
        req = PickRequest(
            ctx.pool,
            ctx.home_key,  # affinity follows the session: its runs share the prefix
            exclude,
            allowed,
            waited_s,
            home_wait_s,
            now_s=now_s,
            free_slots=free,
            awaited=awaited,
            prefix=need.prefix,
            fill_frac=fill,
        )
        chosen = self.picker.pick(req, cands)
        if chosen is None:
            return None
        return self._acquire(chosen.state, ctx.pool, need, ctx.home_key, ctx.stream)

    def _acquire(
        self,
        state: InstanceState,
        pool: str,
        need: Need,
        run: Hashable | None = None,
        stream: bool = False,
    ) -> Lease:
        rate = uncached_prefill_tokens_per_s(state.prefill_tokens_per_s, state.prefix_hit_frac)
        prefill = need.prefill_tokens(state.spec.instance_id)
        lease = self.fleet.acquire(
            state.spec.instance_id,
            pool,
            blocks=-(-need.total_tokens // self._block_size(state)),
            prompt_tokens=prefill,
            prefill_s=prefill / rate if rate else 0.0,
        )
        self.engine_kv.acquired(
            lease, need.total_tokens - need.prompt_tokens, self._block_size(state)
        )
        if self.reserve_forecast:
            forecaster = self.forecaster(pool, lease.instance_id)
            forecaster.arrived(lease.acquired_at_s, lease.blocks)
        if self.pauses is not None and run is not None:
            self._lease_runs[lease] = run
        if stream and self.prefill_hold is not None:
            self._streamed.add(lease)
        return lease

    def _lease_unchecked(
        self, ctx: RequestContext, need: Need, exclude: frozenset[str]
    ) -> Lease | None:
        return self._lease(ctx, need, None, exclude)

    # ------------------------------------------------------------------ waiting

    def enqueue(self, waiter: Waiter, now_s: float) -> QueueEntry:
        """`waiter` joins its pool's queue (counted among the steps waiting for its run's home
        when it has one); a lower-priority entry it sheds is refused. Raises
        `CapacityExceeded` (queue_full) when the queue is full."""
        ctx, need = waiter.ctx, waiter.need
        queue = self.queues[ctx.pool]
        entry = QueueEntry(
            tenant=ctx.tenant,
            priority=ctx.priority,
            cost_tokens=float(need.total_tokens),
            weight=ctx.tenant_weight,
            enqueued_at_s=now_s,
            payload=waiter,
            attained_gpu_s=self._attained_gpu_s(ctx, now_s),
            run_key=ctx.run_key,
        )
        try:
            shed = queue.push(entry)
        except QueueFull:
            retry_s = queue.expected_wait_s(1, now_s, default_s=1.0)
            self.metrics.rejected(ctx.pool, "queue_full")
            raise CapacityExceeded(
                f"pool {ctx.pool!r} queue is full ({queue.max_depth} waiting)",
                "queue_full",
                retry_after_s=retry_s,
            ) from None
        if need.cached_on is not None:
            self._homebound[ctx.pool][entry] = need.cached_on
            self._awaited[ctx.pool][need.cached_on] += 1
        if shed is not None:
            self._shed(shed, queue, now_s)
        self.metrics.queue_depth(ctx.pool, len(queue))
        return entry

    def max_wait_s(self, ctx: RequestContext, enqueued_at_s: float) -> float:
        """How long a request queued at `enqueued_at_s` may wait: its pool's
        `queue.max_wait_s`, or less when its deadline comes first (below 0 when it has
        passed)."""
        pool = self.pools[ctx.pool]
        return min(pool.queue.max_wait_s, ctx.deadline_s - enqueued_at_s)

    def withdraw(self, entry: QueueEntry) -> None:
        """`entry` leaves its pool's queue unserved (timed out, its client left)."""
        waiter: Waiter = entry.payload
        queue = self.queues[waiter.ctx.pool]
        queue.remove(entry)
        self._left(queue.pool, entry)
        self.metrics.queue_depth(queue.pool, len(queue))  # no pump pass may follow

    async def _wait(
        self,
        ctx: RequestContext,
        need: Need,
        exclude: frozenset[str],
        now_s: float,
    ) -> Lease:
        queue = self.queues[ctx.pool]
        future: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        entry = self.enqueue(_Waiter(ctx, need, future, exclude), now_s)
        self.schedule_pump()
        timeout_s = self.max_wait_s(ctx, now_s)
        try:
            done, _ = await asyncio.wait({future}, timeout=max(0.0, timeout_s))
        except asyncio.CancelledError:
            self._abandon(entry, future)
            raise
        if not done:
            self._abandon(entry, future)
            self.metrics.queue_depth(ctx.pool, len(queue))
            self.metrics.rejected(ctx.pool, "queue_timeout")
            self.metrics.observe_queue_wait(ctx.pool, ctx.class_name, self.clock() - now_s)
            # a retry joins the back of the queue: the time for those waiting now and then
            # itself to drain; with no drain measured, as long as it waited (max_wait_s, or
            # less if its deadline came first): a retry sooner would find nothing freed
            places = len(queue) + 1
            raise CapacityExceeded(
                f"waited {timeout_s:.1f} s in pool {ctx.pool!r}'s queue without capacity freeing",
                "queue_timeout",
                retry_after_s=queue.expected_wait_s(places, self.clock(), default_s=timeout_s),
            )
        waited_s = self.clock() - now_s
        self.metrics.observe_queue_wait(ctx.pool, ctx.class_name, waited_s)
        lease = future.result()
        log.debug(
            "%s: admitted to %s after %.3f s in pool %s's queue",
            ctx.request_id,
            lease.instance_id,
            waited_s,
            ctx.pool,
        )
        return lease

    @property
    def attained_runs(self) -> RunTable | None:
        """The router's `RunTable` when a pool orders its queue by run_las (what the other
        replicas are told of this one's attained service: `SharedReservations.for_store`),
        else None."""
        return self.affinity.runs if self._attained else None

    def _shared_run_usage(self, run_key: Hashable, now_s: float) -> RunUsage | None:
        """A run's usage for run_las: this replica's (`run_usage`), with the other replicas'
        shares on a shared store (router/admission/shared_attained.py): a dict lookup, no
        store round trip."""
        assert self._run_usage is not None
        own = self._run_usage(run_key, now_s)
        peers = self.peers.attained if self.peers is not None else None
        return own if peers is None else peers.with_peers(run_key, own)

    def _attained_gpu_s(self, ctx: RequestContext, now_s: float) -> float:
        """The GPU-seconds the request's run has received (run_las pools; 0 otherwise or for a
        request without a run, which counts as a run of its own)."""
        attained = self._attained.get(ctx.pool)
        if attained is None or ctx.run_id is None:
            return 0.0
        return attained.attained_gpu_s((ctx.tenant, ctx.run_id), now_s)

    def _abandon(self, entry: QueueEntry, future: asyncio.Future[Lease]) -> None:
        if future.done() and not future.cancelled() and future.exception() is None:
            future.result().release()  # granted just as the waiter gave up
        self.withdraw(entry)
        future.cancel()

    def homebound(self, pool: str) -> dict[str, int]:
        """Steps in `pool`'s queue per instance that is their run's home (a step counts from
        its enqueue until it leaves the queue, dispatched or not)."""
        return dict(self._awaited[pool])

    def _left(self, pool: str, entry: QueueEntry, now_s: float | None = None) -> None:
        """`entry` left the pool's queue: it no longer waits for its run's home, nor is it
        held (idempotent)."""
        self._unhold(pool, entry, self.clock() if now_s is None else now_s)
        self._hold_spent.discard(entry)
        self._wait_reasons.pop(entry, None)
        home = self._homebound[pool].pop(entry, None)
        if home is not None:
            awaited = self._awaited[pool]
            awaited[home] -= 1
            if awaited[home] <= 0:
                del awaited[home]

    def _unhold(self, pool: str, entry: QueueEntry, now_s: float) -> None:
        """A prefill hold no longer keeps `entry` waiting: the time it held it is observed."""
        since = self._held_since.pop(entry, None)
        if since is not None:
            self.metrics.prefill_held.labels(pool).observe(max(0.0, now_s - since))

    def _hold_applies(self, entry: QueueEntry, now_s: float) -> bool:
        """Whether a prefill hold may keep `entry` waiting (not once it has been held for
        `admission.prefill_hold_max_wait_s`)."""
        if self.prefill_hold is None:
            return True  # nothing holds anyway
        if entry in self._hold_spent:
            return False
        if hold_applies(self.prefill_hold, self._held_since.get(entry), now_s):
            return True
        self._hold_spent.add(entry)
        return False

    def _held(self, pool: str, entry: QueueEntry, result: object, now_s: float) -> None:
        """After a pass over `entry`: a prefill hold keeps it waiting (mark since when, and
        wake when its wait bound ends), or no longer does (observe how long it held)."""
        hold = self.prefill_hold
        if hold is None:
            return
        if isinstance(result, Wait) and result.reason == "prefill":
            if entry not in self._held_since:
                self._held_since[entry] = now_s
                self._wake_at(now_s + hold.max_wait_s)
        else:
            self._unhold(pool, entry, now_s)

    def _waited(self, pool: str, entry: QueueEntry, reason: str) -> None:
        """A dispatch pass found `entry` waiting for `reason`: counted the first time per
        entry and reason."""
        seen = self._wait_reasons.setdefault(entry, set())
        if reason not in seen:
            seen.add(reason)
            self.metrics.admission_waited(pool, reason)

    def _shed(self, entry: QueueEntry, queue: PoolQueue, now_s: float) -> None:
        self._left(queue.pool, entry)
        waiter: Waiter = entry.payload
        self.metrics.rejected(queue.pool, "shed")
        waiter.refused(
            CapacityExceeded(
                f"shed from pool {queue.pool!r}'s full queue for a higher-priority request"
                " (priority below 0 is shed first)",
                "shed",
                retry_after_s=queue.expected_wait_s(len(queue), now_s, default_s=1.0),
            )
        )

    # ------------------------------------------------------------------ dispatch

    def schedule_pump(self) -> None:
        """Dispatch what fits, once, soon (coalesces bursts of events into one pass). Nothing
        when no request waits: a lease's release calls this, and a pass over empty queues was a
        callback and two gauge updates per request (issue 28)."""
        if self._pump_scheduled or not any(map(len, self.queues.values())):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._pump_scheduled = True
        loop.call_soon(self.pump)

    def pump(self) -> None:
        """One dispatch pass now (`dispatch_once`), and another soon when it may lend more."""
        self._pump_scheduled = False
        if self.dispatch_once(self.clock()):
            self.schedule_pump()

    def dispatch_once(self, now: float) -> bool:
        """Give each pool's queue head a lease while it fits (head-of-line order): decide →
        pick → lease in one synchronous step per entry, with the waiting bookkeeping (the
        time it has waited feeds placement patience and the affinity-or-move wait; the steps
        waiting for each home). A head that fits but waits for its run's home instance (the
        placement rule) is passed over for this pass: the entries behind it may go, and it
        keeps its place. A head whose deadline can no longer be met is refused.

        Returns True when another pass may dispatch more: something was leased and pools
        may borrow (a queue that emptied may lend now to a pool passed over earlier: across
        instances with `rebalancer.borrow_max_frac`, within a split one with `admission.reserve:
        forecast`, where a pool with requests waiting lends nothing)."""
        dispatched = False
        for queue in self.queues.values():
            homebound: set[QueueEntry] = set()
            while (entry := queue.peek(now, homebound)) is not None:
                waiter: Waiter = entry.payload
                if waiter.gone():
                    queue.remove(entry)
                    self._left(queue.pool, entry)
                    continue
                hold = self._hold_applies(entry, now)
                result = self._try(
                    waiter.ctx,
                    waiter.need,
                    now,
                    waiter.exclude,
                    now - entry.enqueued_at_s,
                    queued=True,
                    hold=hold,
                )
                self._held(queue.pool, entry, result, now)
                if isinstance(result, Lease):
                    queue.pop(entry, now)
                    self._left(queue.pool, entry, now)
                    waiter.admitted(result)
                    dispatched = True
                    continue
                if isinstance(result, Reject) and result.code == "deadline_unmeetable":
                    queue.remove(entry)
                    self._left(queue.pool, entry, now)
                    self.metrics.rejected(queue.pool, result.code)
                    waiter.refused(self._capacity(result, 1.0))
                    continue
                if isinstance(result, _WaitsForHome):
                    self._waited(queue.pool, entry, "home")
                    homebound.add(entry)
                    continue
                if isinstance(result, Wait):
                    self._waited(queue.pool, entry, result.reason)
                break
            self.metrics.queue_depth(queue.pool, len(queue))
        return dispatched and (self.borrow_max_frac > 0 or self.reserve_forecast)

    # ------------------------------------------------------------------ errors

    def _reject(self, ctx: RequestContext, result: Reject, wait_s: float) -> Exception:
        if result.code == "no_instance":
            return self._no_instance(ctx.pool)
        self.metrics.rejected(ctx.pool, result.code)
        return self._capacity(result, max(wait_s, 1.0))

    @staticmethod
    def _capacity(result: Reject, retry_after_s: float) -> CapacityExceeded:
        return CapacityExceeded(result.message, result.code, retry_after_s=retry_after_s)

    def _no_instance(self, pool: str) -> NoHealthyInstance:
        total = len(self.pool_map.current.instances_for(pool))
        return NoHealthyInstance(
            f"no healthy instance in pool {pool!r} ({total} allocated)", "no_healthy_instance"
        )


class _ByAllocation:
    """What the admitter reads from one allocation on every request and what depends on it
    alone: each pool's instances taking new work, each instance's strictest TPOT target. An
    allocation is a frozen snapshot (`PoolMap.replace` puts a new one in its place), so this
    holds until the pool map's current allocation is another object."""

    __slots__ = ("_instances", "_strictest_s", "_tpot_target_s", "allocation")

    def __init__(self, allocation: Allocation, tpot_target_s: dict[str, float]) -> None:
        self.allocation = allocation
        self._tpot_target_s = tpot_target_s
        self._instances: dict[str, tuple[str, ...]] = {}
        self._strictest_s: dict[str, float | None] = {}

    def instances_for(self, pool: str) -> tuple[str, ...]:
        ids = self._instances.get(pool)
        if ids is None:
            ids = self._instances[pool] = self.allocation.instances_for(pool)
        return ids

    def strictest_tpot_s(self, instance_id: str) -> float | None:
        """The strictest TPOT target among the pools with a part of the instance (None:
        none has)."""
        try:
            return self._strictest_s[instance_id]
        except KeyError:
            pass
        pools = self.allocation.pools_of(instance_id)
        targets = [self._tpot_target_s[p] for p, f in pools.items() if f > 0]
        target_s = self._strictest_s[instance_id] = min(targets) if targets else None
        return target_s


@dataclass(frozen=True, slots=True)
class Reserve:
    """What `reserve: forecast` keeps free for one pool on one instance (`Admitter.reserves`)."""

    pool: str
    blocks: float  # KV blocks
    slots: int  # batch places
    forecast: Forecast
    waiting: bool  # the pool has requests waiting: all its unused share is kept
    cold: bool  # unmeasured in the router's first minute: all its unused share is kept


def _free_slots(view: InstanceView) -> int:
    """Sequences the pool may still start on the instance now by its operating points (the
    same counts `router.admission.decision.fit_reason` checks; KV may refuse sooner)."""
    limit = min(view.pool_limit, view.instance_limit)
    pool_free = max(1, int(view.frac * limit)) - view.pool_running
    if view.reserve_forecast:  # past its share, what the others' reserves leave
        lent = view.instance_limit - view.others_reserve_slots - view.running
        pool_free = max(pool_free, lent)
    return max(0, min(pool_free, view.instance_limit - view.running))


def _fills(views: list[InstanceView]) -> dict[str, float]:
    return {v.instance_id: fill_frac(v) for v in views}


def _step_s(state: InstanceState) -> float:
    """One engine step with one more sequence in the batch, from the measured TPOT (or the
    GPU's roofline prior until measured); 0 while there is neither."""
    return state.op.tpot_estimate_s(state.inflight + 1) or 0.0
