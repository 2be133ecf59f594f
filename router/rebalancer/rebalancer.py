"""The rebalancer's shell: the loop that moves the pool ratio with demand, the drains, the SRE
controls, and the decision log. The decision itself is pure (`pools.rebalance.decide`), and
so is the placement (`pools.allocation.plan_moves`); this component gathers their inputs,
applies their outputs to the `PoolMap`, and writes down what happened.

Every `rebalancer.interval_s` (when `rebalancer.enabled`) `tick()`:
1. gathers each pool's signals: queue waits (p95 of the waits that ended in the interval,
   counted when the request is dispatched, or the age of the request at the head of the
   queue, whichever is longer; target: the pool's TTFT target),
   KV use of the pool's part of its instances, TTFT and TPOT p95 of the interval's streaming
   requests, and the fraction refused for capacity (`SignalWindow`, a `RequestObserver`).
   Only what admission did counts: its refusals (`capacity_exceeded`: queue full, queue
   timeout, shed, deadline unmeetable) and the time in the pool's queue. A tenant's own
   budget (governance: `token_rate`, `tenant_concurrency`, `cost_cap`, run guards, and the
   time waited for the tenant's bucket) says nothing about the pool's capacity, so a request
   refused before admission is not counted at all;
2. decides (bounds from the config, its time-of-day schedule, or an SRE override; a pinned
   ratio or a freeze from the SREs; home: the configured `initial_frac` ratio as placed);
3. places the target with as few changes as possible: the split instance is resized at once
   (admission enforces fractions on every request), a whole instance drains (see
   `pools.allocation`) and joins its new pool when its old pool's sequences there have
   finished (checked on every lease release) or at `drain_timeout_s`; while one drains, no
   other whole move starts;
4. logs the decision with the signals behind it (SQLite, `GET /admin/decisions`) and updates
   the metrics.

Between decisions, every `RECALL_CHECK_S`, `check_recall()` applies the recall rule alone over
the trailing interval (`decide(..., recall_only=True)`): share lent away comes back as soon as
the lender misses its target, not at the next decision; otherwise nothing changes.

SRE changes (`set_bounds`, `pin`, `unpin`, `pin_instance`, `unpin_instance`, `freeze`,
`unfreeze`, `move`, `move_instance`) take effect at once, are saved in the store with the
decision log (they survive a restart; router.state_path is read once, the JSON file gpupool
kept them in before) and are audited (who, when, what, before and after).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from pools.allocation import Allocation, Drain, PoolMap, plan_allocation, plan_moves
from pools.config import Config
from pools.fleet import Fleet
from pools.periodic import Periodic
from pools.rebalance import (
    Bounds,
    Decision,
    LoopState,
    Move,
    PoolSignals,
    bounds_at,
    clamp_shares,
    decide,
    effective_bounds,
)
from pools.tasks import cancel_and_wait
from router.admission.queueing import PoolQueue
from router.errors import BadRequest, CapacityExceeded, NotFound
from router.metrics import RouterMetrics
from router.rebalancer.store import DecisionLog, Ratio, SreSettings
from router.request import RequestOutcome
from router.store.leader import CHECK_S, Leadership, leadership_for, new_replica_id

__all__ = ["RECALL_CHECK_S", "SYNC_S", "Rebalancer", "SignalWindow", "recall_check_offsets_s"]

log = logging.getLogger(__name__)

_RECENT_DECISIONS = 20
# how often the loop checks the recall rule between decisions (`check_recall`)
RECALL_CHECK_S = 1.0
# how often a replica on a shared store reads the SRE settings and the target ratio
SYNC_S = 1.0
_SHARE_TOLERANCE = 0.01  # a pinned ratio must sum to 1 within this


def recall_check_offsets_s(interval_s: float) -> list[float]:
    """When, within one interval, the loop checks the recall rule: every `RECALL_CHECK_S`,
    short of the decision at the interval's end."""
    return [k * RECALL_CHECK_S for k in range(1, math.ceil(interval_s / RECALL_CHECK_S - 1e-9))]


def _p95(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


@dataclass(frozen=True, slots=True)
class _Seen:
    at_s: float
    queue_s: float
    ttft_s: float | None
    tpot_s: float | None
    rejected: bool


def _queue_wait_s(outcome: RequestOutcome) -> float | None:
    """The time the request waited for admission (its pool's queue), not for its tenant's
    budget before that; None when it never asked admission (refused or answered before)."""
    start = outcome.admission_started_at_s
    if start is None:
        return None
    if outcome.admitted_at_s is not None:
        return max(0.0, outcome.admitted_at_s - start)
    return max(0.0, outcome.ended_at_s - start) if outcome.rejected else 0.0


def _capacity_refusal(outcome: RequestOutcome) -> bool:
    """Admission refused it for capacity (429 `capacity_exceeded`); a tenant's own limit
    (429 `rate_limit_error`, 403 `run_stopped`) is not the pool's capacity."""
    return outcome.status == 429 and outcome.error_type == CapacityExceeded.type


class SignalWindow:
    """A `RequestObserver` that remembers each pool's requests for one window: queue waits
    when they end (at dispatch: a long agent step's wait counts at once, not when the step
    finishes seconds later; or at the end for a request never dispatched), TTFT, TPOT and
    capacity refusals when the request ends. Requests that never reached admission
    (governance refusals, bad requests) are not counted."""

    def __init__(self, pools: Sequence[str], *, max_events: int = 50_000) -> None:
        self._seen: dict[str, deque[_Seen]] = {p: deque(maxlen=max_events) for p in pools}
        self._waits: dict[str, deque[tuple[float, float]]] = {
            p: deque(maxlen=max_events) for p in pools
        }
        self._wait_counted: set[str] = set()  # request ids whose wait is in, until they end

    def dispatched(self, outcome: RequestOutcome) -> None:
        waits = self._waits.get(outcome.ctx.pool)
        request_id = outcome.ctx.request_id
        if waits is None or request_id in self._wait_counted:  # a retry: counted once
            return
        self._wait_counted.add(request_id)
        at_s = outcome.dispatched_at_s
        wait_s = _queue_wait_s(outcome) or 0.0
        waits.append((at_s if at_s is not None else outcome.ctx.received_at_s, wait_s))

    def usage_extra(self, outcome: RequestOutcome) -> dict[str, Any]:
        return {}

    def finished(self, outcome: RequestOutcome) -> None:
        seen = self._seen.get(outcome.ctx.pool)
        counted = outcome.ctx.request_id in self._wait_counted
        self._wait_counted.discard(outcome.ctx.request_id)
        wait_s = _queue_wait_s(outcome)
        if seen is None or wait_s is None:  # never reached admission: not the pool's doing
            return
        if not counted:
            self._waits[outcome.ctx.pool].append((outcome.ended_at_s, wait_s))
        rejected = _capacity_refusal(outcome)
        seen.append(_Seen(outcome.ended_at_s, wait_s, outcome.ttft_s, outcome.tpot_s, rejected))

    def waits(self, pool: str, since_s: float) -> list[float]:
        """The queue waits that ended (dispatch, or the end of a request never dispatched)
        after `since_s`."""
        waits = self._waits.get(pool, deque())
        while waits and waits[0][0] < since_s - 3600:  # keep at most an hour
            waits.popleft()
        out = []
        for at_s, wait_s in reversed(waits):
            if at_s < since_s:
                break
            out.append(wait_s)
        return out

    def summary(self, pool: str, since_s: float) -> tuple[list[_Seen], int]:
        """The pool's requests that finished after `since_s`, and how many were refused."""
        seen = self._seen.get(pool, deque())
        while seen and seen[0].at_s < since_s - 3600:  # keep at most an hour
            seen.popleft()
        recent = []
        for s in reversed(seen):  # appended as requests end: newest last
            if s.at_s < since_s:
                break
            recent.append(s)
        return recent, sum(1 for s in recent if s.rejected)


class Rebalancer:
    def __init__(
        self,
        config: Config,
        fleet: Fleet,
        pool_map: PoolMap,
        queues: Mapping[str, PoolQueue],
        metrics: RouterMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        decision_log: DecisionLog | None = None,
        replica_id: str | None = None,
        leader_check_s: float = CHECK_S,
        sync_s: float = SYNC_S,
    ) -> None:
        self.config = config
        self.rc = config.rebalancer
        self.fleet = fleet
        self.pool_map = pool_map
        self.queues = queues
        self.metrics = metrics
        self.clock = clock
        self.wall_clock = wall_clock
        self.pools = tuple(p.name for p in config.pools)
        self.signals = SignalWindow(self.pools)
        self.decision_log = decision_log or DecisionLog(
            self.rc.decision_log_path, retention_days=self.rc.decision_log_retention_days
        )
        self.state_path = config.router.state_path
        self.replica = replica_id or new_replica_id()
        # one replica decides (the others follow the ratio it publishes): an advisory lock on
        # a PostgreSQL store, the router alone on the embedded one (router/store/leader.py)
        self.leadership: Leadership = leadership_for(
            self.decision_log.store, self.replica, check_s=leader_check_s
        )
        self.leadership.on_change = self._leading_changed
        self.shared = self.decision_log.store.dialect == "postgresql"
        self._sync_loop = Periodic("gpupool-rebalancer-sync", self.sync, sync_s)
        self._ratio = Ratio(0, "", {})  # the newest ratio published in the store, as seen
        self._sre_edits = 0  # SRE changes begun here (a sync read before one is stale)
        self._sre_saving = 0  # SRE changes being saved now
        self.sre = SreSettings()
        capacity = fleet.capacity_gpus()
        self.loop_state = LoopState(
            shares={p: pool_map.current.share_of(p, capacity) for p in self.pools}
        )
        self.last_signals: dict[str, PoolSignals] = {}
        self.recent: deque[dict[str, Any]] = deque(maxlen=_RECENT_DECISIONS)
        self.moves = 0
        self._task: asyncio.Task[None] | None = None
        self._writes: set[asyncio.Task[None]] = set()
        self._timers: list[asyncio.TimerHandle] = []
        self._started = False
        fleet.on_capacity_change(lambda _iid: self.check_drains())

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Restore the SREs' settings (pins, bounds, the last ratio), open the decision log
        and, when enabled, start the loop."""
        if self._started:
            return
        self._started = True
        await self.decision_log.start()
        self.sre = await self.decision_log.load_settings(self.state_path)
        self._restore()
        if self.shared:  # start from the ratio the replicas follow now
            await self.sync()
            self._sync_loop.start()
        await self.leadership.start()
        if self.rc.enabled:
            self._task = asyncio.create_task(self._run(), name="rebalancer")
        log.info(
            "rebalancer %s (interval %.0f s); shares %s; replica %s (%s)",
            "running" if self.rc.enabled else "off: SRE moves only",
            self.rc.interval_s,
            _fmt(self.loop_state.shares),
            self.replica,
            "leader election on the shared store" if self.shared else "the only one",
        )

    async def aclose(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        await self._sync_loop.aclose()
        await self.leadership.aclose()
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
        await self.decision_log.aclose()
        self._started = False

    async def _run(self) -> None:
        while True:
            elapsed_s = 0.0
            for at_s in recall_check_offsets_s(self.rc.interval_s):
                await asyncio.sleep(at_s - elapsed_s)
                elapsed_s = at_s
                if self.leadership.leading:  # the others follow its ratio (`sync`)
                    self._guarded(self.check_recall)
            await asyncio.sleep(self.rc.interval_s - elapsed_s)
            if self.leadership.leading:
                self._guarded(self.tick)

    # ------------------------------------------------------------------ replicas

    def _leading_changed(self, leading: bool) -> None:
        self.metrics.rebalancer_leader.set(1 if leading else 0)

    async def sync(self) -> None:
        """On a shared store, every `SYNC_S`: read the SRE settings and the target ratio the
        replicas share. Settings changed through another replica take effect here; a ratio
        published by another replica (the leader's decision, an SRE move) is placed here; the
        leader publishes its own decisions. Skipped while an SRE change of this replica is
        being saved (what was read may predate it)."""
        edits = self._sre_edits
        settings, ratio = await self.decision_log.load_shared()
        if self._sre_saving or self._sre_edits != edits:
            return
        if settings is not None:
            settings.shares = self.sre.shares
            self.sre = settings
        if ratio is not None and ratio.version > self._ratio.version:
            self._adopt(ratio)
        elif self.leadership.leading and (
            _differs_shares(self.loop_state.shares, self._ratio.shares)
            or self._ratio.placement is None
            or _differs(self.pool_map.current.fracs, self._ratio.placement)
        ):
            await self._publish()

    def _adopt(self, ratio: Ratio) -> None:
        """Follow a ratio published in the store (by another replica, or this one before)."""
        self._ratio = ratio
        if set(ratio.shares) != set(self.pools):  # written for other pools: not ours to follow
            return
        placement = ratio.placement
        if placement is not None and not self._same_instances(placement):
            placement = None  # placed over another fleet (one joining or leaving): the ratio
        if not _differs_shares(ratio.shares, self.loop_state.shares) and (
            placement is None or not _differs(placement, self.pool_map.current.fracs)
        ):
            return
        now = self.clock()
        if self.leadership.leading and ratio.replica != self.replica:
            # an SRE's change through another replica: the cooldown starts, as for one here
            self.loop_state = replace(
                self.loop_state, shares=dict(ratio.shares), history=(), last_move_at_s=now
            )
        else:
            self.loop_state = replace(self.loop_state, shares=dict(ratio.shares))
        log.info("following the pool ratio %s (from %s)", _fmt(ratio.shares), ratio.replica)
        if placement is None:
            self._place(ratio.shares, now)
        else:
            self._place_exactly(placement, now)

    def _same_instances(self, placement: Mapping[str, Mapping[str, float]]) -> bool:
        return set(placement) == set(self.fleet.capacity_gpus())

    def _place_exactly(self, placement: Mapping[str, Mapping[str, float]], now_s: float) -> None:
        """Take the allocation another replica published, instance by instance: an instance
        it moved to another pool whole drains from its old pool here too (this replica's own
        sequences there finish first), a split instance is resized in place, and a drain
        still under way here is kept."""
        current = self.pool_map.current
        draining = dict(current.draining)
        fracs = {}
        for instance_id, by_pool in placement.items():
            new = {p: f for p, f in by_pool.items() if f > 1e-9}
            old = dict(current.pools_of(instance_id))
            fracs[instance_id] = MappingProxyType(new)
            if not _differs({instance_id: new}, {instance_id: old}):
                continue  # unchanged: a drain of it goes on
            left = [p for p in old if p not in new]
            if len(new) == 1 and left:
                (to_pool,) = new
                from_pool = max(left, key=lambda p: old[p])
                draining[instance_id] = Drain(
                    from_pool, to_pool, now_s, now_s + self.rc.drain_timeout_s
                )
            else:
                draining.pop(instance_id, None)
        placed = Allocation(MappingProxyType(fracs), current.version, MappingProxyType(draining))
        if not _differs(placed.fracs, current.fracs) and placed.draining == current.draining:
            return
        self.pool_map.replace(placed)
        for instance_id in set(draining) - set(current.draining):
            drain = draining[instance_id]
            log.info(
                "%s drains from pool %s to pool %s, as replica %s placed it (at most %.0f s)",
                instance_id,
                drain.from_pool,
                drain.to_pool,
                self._ratio.replica,
                drain.deadline_s - now_s,
            )
            self._schedule_drain_check(drain.deadline_s - now_s)
        self.check_drains()

    async def _publish(self, *, insist: bool = False) -> None:
        """Publish this replica's target ratio. When another replica published first, the
        next sync follows theirs; `insist` (an SRE's change) reads the newest version and
        publishes over it once more."""
        shares = dict(self.loop_state.shares)
        for _ in range(2 if insist else 1):
            placement = {i: dict(f) for i, f in self.pool_map.current.fracs.items()}
            version = await self.decision_log.publish_ratio(
                self._ratio.version, self.replica, shares, placement
            )
            if version is not None:
                self._ratio = Ratio(version, self.replica, shares, placement)
                return
            _, newest = await self.decision_log.load_shared()
            if newest is None:
                return
            self._ratio = replace(newest, shares=self._ratio.shares)  # its version, to retry

    @staticmethod
    def _guarded(step: Callable[[], object]) -> None:
        try:
            step()
        except Exception:  # one bad tick must not end the loop
            log.exception("rebalancer step failed")

    def _restore(self) -> None:
        """Start from the saved ratio and pins (placed from scratch: nothing runs yet)."""
        shares = self.sre.shares or dict(self.loop_state.shares)
        limits = self._limits(traffic={})
        shares = clamp_shares(self.sre.pinned_shares or shares, limits)
        capacity = self.fleet.capacity_gpus()
        allocation = plan_allocation(capacity, shares, pinned=self.pinned_instances())
        if _differs(allocation.fracs, self.pool_map.current.fracs):
            self.pool_map.replace(allocation)
        self.loop_state = LoopState(
            shares={p: self.pool_map.current.share_of(p, capacity) for p in self.pools}
        )

    # ------------------------------------------------------------------ inputs

    def bounds(self) -> dict[str, Bounds]:
        """Each pool's bounds now: an SRE override, else the schedule's at this time of day
        (UTC), else the config's."""
        minute = (self.wall_clock() % 86_400.0) / 60.0
        out = {}
        for pool in self.config.pools:
            override = self.sre.bounds.get(pool.name)
            if override is not None:
                out[pool.name] = Bounds(*override)
            else:
                out[pool.name] = bounds_at(pool.share.bounds, pool.share.schedule, minute)
        return out

    def _limits(self, traffic: Mapping[str, bool]) -> dict[str, tuple[float, float]]:
        return effective_bounds(self.bounds(), traffic, self._instance_frac())

    def _instance_frac(self) -> float:
        capacity = self.fleet.capacity_gpus()
        total = sum(capacity.values())
        return min(capacity.values()) / total if capacity and total > 0 else 0.0

    def home_shares(self) -> dict[str, float]:
        """Where the loop takes the ratio back once no pool would be pressured there: the
        configured initial ratio (`share.initial_frac`) as placed on the instances there are
        (0.34 of three engines is one engine, 1/3)."""
        given = {p.name: p.share.initial_frac for p in self.config.pools}
        capacity = self.fleet.capacity_gpus()
        if sum(given.values()) <= 0 or not capacity:
            return given
        placed = plan_allocation(capacity, given, pinned=self.pinned_instances())
        return {p: placed.share_of(p, capacity) for p in self.pools}

    def pinned_instances(self) -> dict[str, str]:
        pins = {i: p.name for p in self.config.pools for i in p.pinned_instances}
        pins.update(self.sre.pinned_instances)
        return pins

    def gather(self, now_s: float, since_s: float | None = None) -> dict[str, PoolSignals]:
        """Each pool's signals over the requests since `since_s` (default: the last decision,
        or one interval back)."""
        since = self.loop_state.last_decision_at_s if since_s is None else since_s
        since = now_s - self.rc.interval_s if since is None else since
        allocation = self.pool_map.current
        out = {}
        for pool in self.config.pools:
            name = pool.name
            recent, rejected = self.signals.summary(name, since)
            queue = self.queues.get(name)
            waiting = len(queue) if queue is not None else 0
            head = queue.peek() if queue is not None else None
            head_wait_s = now_s - head.enqueued_at_s if head is not None else 0.0
            waits = self.signals.waits(name, since)
            running = sum(
                s.running_by_pool.get(name, 0)
                for s in self.fleet
                if s.instance_id in allocation.fracs
            )
            out[name] = PoolSignals(
                queue_wait_s=max(_p95(waits) or 0.0, head_wait_s),
                queue_wait_target_s=pool.slo.ttft_p95_ms / 1e3,
                kv_usage_frac=self._pool_kv_frac(name, allocation),
                ttft_p95_s=_p95([s.ttft_s for s in recent if s.ttft_s is not None]),
                ttft_target_s=pool.slo.ttft_p95_ms / 1e3,
                tpot_p95_s=_p95([s.tpot_s for s in recent if s.tpot_s is not None]),
                tpot_target_s=pool.slo.tpot_p95_ms / 1e3,
                rejected_frac=rejected / len(recent) if recent else 0.0,
                requests=len(recent) + waiting + running,
            )
        return out

    def _pool_kv_frac(self, pool: str, allocation: Allocation) -> float:
        """The pool's KV use of its part of its instances: on a whole instance the measured
        use (or the router's reservations, if larger); on a split one the pool's reservations
        over its part. Weighted by the part's blocks."""
        used = total = 0.0
        for instance_id in allocation.instances_for(pool):
            state = self.fleet.get(instance_id)
            cap = state.capacity_blocks if state is not None else None
            if state is None or not cap:
                continue
            frac = allocation.frac(instance_id, pool)
            part = frac * cap
            mine = float(state.reserved_by_pool.get(pool, 0))
            if frac >= 1.0 - 1e-9:
                mine = max(mine, self.fleet.kv_usage_frac(state) * cap)
            used += min(mine, part)
            total += part
        return used / total if total > 0 else 0.0

    # ------------------------------------------------------------------ the loop

    def tick(self) -> Decision:
        """One decision: gather, decide, place, log. Synchronous (no await between reading the
        fleet and changing the allocation)."""
        now = self.clock()
        signals = self.gather(now)
        self.last_signals = signals
        decision = self._decide(signals, now, recall_only=False)
        self.loop_state = decision.state
        if decision.reason != "not_due":
            self._place(decision.shares, now)
            kind = "auto" if decision.reason in ("moved", "home", "recalled") else decision.reason
            self._record(decision, kind, signals, who="loop")
        return decision

    def check_recall(self) -> Decision | None:
        """Between decisions: the recall rule alone, over the trailing interval (see
        `pools.rebalance`, "Recall"). The recall when it fires (placed, logged), else None;
        nothing else changes."""
        now = self.clock()
        signals = self.gather(now, since_s=now - self.rc.interval_s)
        decision = self._decide(signals, now, recall_only=True)
        if decision.reason != "recalled":
            return None
        self.last_signals = signals
        self.loop_state = decision.state
        self._place(decision.shares, now)
        self._record(decision, "auto", signals, who="loop")
        return decision

    def _decide(
        self, signals: Mapping[str, PoolSignals], now_s: float, *, recall_only: bool
    ) -> Decision:
        return decide(
            self.loop_state,
            signals,
            self.bounds(),
            self.rc.settings,
            now_s,
            instance_frac=self._instance_frac(),
            frozen=self.sre.frozen,
            pinned=self.sre.pinned_shares,
            home=self.home_shares(),
            recall_only=recall_only,
        )

    def _place(self, shares: Mapping[str, float], now_s: float) -> None:
        """Move the allocation toward `shares` (no whole move while another drains)."""
        current = self.pool_map.current
        if current.draining:
            return
        capacity = self.fleet.capacity_gpus()
        planned = plan_moves(
            current,
            capacity,
            shares,
            now_s=now_s,
            drain_timeout_s=self.rc.drain_timeout_s,
            pinned=self.pinned_instances(),
        )
        if not _differs(planned.fracs, current.fracs):
            return
        self.pool_map.replace(planned)
        for instance_id, drain in planned.draining.items():
            log.info(
                "%s drains from pool %s to pool %s (at most %.0f s)",
                instance_id,
                drain.from_pool,
                drain.to_pool,
                drain.deadline_s - now_s,
            )
            self._schedule_drain_check(drain.deadline_s - now_s)
        self.check_drains()

    def _places_itself(self) -> bool:
        """Whether this replica plans its own moves: alone, or leading; a follower takes the
        placement the leader published (while there is one for this fleet)."""
        if not self.shared or self.leadership.leading:
            return True
        placement = self._ratio.placement
        return placement is None or not self._same_instances(placement)

    def placed_shares(self) -> dict[str, float]:
        capacity = self.fleet.capacity_gpus()
        return {p: self.pool_map.current.share_of(p, capacity) for p in self.pools}

    # ------------------------------------------------------------------ drains

    def _schedule_drain_check(self, delay_s: float) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._timers = [t for t in self._timers if not t.cancelled()]
        self._timers.append(loop.call_later(max(0.0, delay_s) + 0.01, self.check_drains))

    def check_drains(self) -> None:
        """End every drain whose old pool has nothing left on the instance, or whose deadline
        has passed (its old sequences then finish where they are)."""
        current = self.pool_map.current
        if not current.draining:
            return
        now = self.clock()
        ended: list[tuple[str, Drain, str]] = []
        allocation = current
        for instance_id, drain in current.draining.items():
            state = self.fleet.get(instance_id)
            left = 0 if state is None else state.running_by_pool.get(drain.from_pool, 0)
            if left == 0 or now >= drain.deadline_s:
                allocation = allocation.without_drain(instance_id)
                ended.append((instance_id, drain, "finished" if left == 0 else "timeout"))
        if not ended:
            return
        self.pool_map.replace(allocation)
        for instance_id, drain, how in ended:
            log.info(
                "%s joined pool %s after %.1f s (%s)",
                instance_id,
                drain.to_pool,
                now - drain.started_at_s,
                how,
            )
            self.metrics.drains_done.labels(how).inc()
            self._log_event(
                {
                    "reason": "drain_done",
                    "instance": instance_id,
                    "from_pool": drain.from_pool,
                    "to_pool": drain.to_pool,
                    "drain_s": round(now - drain.started_at_s, 3),
                    "ended_by": how,
                    "shares": _round(self.placed_shares()),
                }
            )
        if not self.pool_map.current.draining and self._places_itself():
            self._place(self.loop_state.shares, now)  # what the last decision still owes

    # ------------------------------------------------------------------ logging

    def _record(
        self,
        decision: Decision,
        kind: str,
        signals: Mapping[str, PoolSignals] | None,
        who: str,
    ) -> None:
        move = decision.move
        if move is not None and decision.changed:
            self.moves += 1
            self.metrics.rebalance_moves.labels(move.from_pool, move.to_pool, kind).inc()
        for pool, by_signal in decision.pressure.items():
            for signal, value in by_signal.items():
                self.metrics.pool_pressure.labels(pool, signal).set(value)
            self.metrics.pool_pressure.labels(pool, "smoothed").set(decision.smoothed[pool])
        for pool, share in decision.shares.items():
            self.metrics.pool_target_share.labels(pool).set(share)
        row: dict[str, Any] = {
            "reason": decision.reason,
            "kind": kind,
            "who": who,
            "move": None if move is None or not decision.changed else _move_dict(move),
            "shares": _round(decision.shares),
            "placed_shares": _round(self.placed_shares()),
            "pressure": {p: _round(v) for p, v in decision.pressure.items()},
            "smoothed_pressure": _round(decision.smoothed),
            "bounds": {p: [round(lo, 4), round(hi, 4)] for p, (lo, hi) in decision.bounds.items()},
            "frozen": self.sre.frozen,
            "pinned_shares": self.sre.pinned_shares,
            "draining": sorted(self.pool_map.current.draining),
        }
        if signals is not None:
            row["signals"] = {p: _signals_dict(s) for p, s in signals.items()}
        self._log_event(row)

    def _log_event(self, row: dict[str, Any]) -> None:
        at = self.wall_clock()
        row = {"at_unix_s": round(at, 3), **row}
        self.recent.appendleft(row)
        if self._started:
            self._spawn(self.decision_log.record_decision(at, row))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._writes.add(task)
        task.add_done_callback(self._write_done)

    def _write_done(self, task: asyncio.Task[None]) -> None:
        self._writes.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("decision log write failed: %s", task.exception())

    # ------------------------------------------------------------------ SRE controls

    async def _changed(self, who: str, action: str, detail: dict[str, Any]) -> None:
        """Save the settings, publish the ratio to the other replicas (shared store) and
        audit the change (who, when, what)."""
        self._sre_edits += 1
        self._sre_saving += 1
        try:
            self.sre.shares = dict(self.loop_state.shares)
            await self.decision_log.save_settings(self.sre)
            if self.shared:
                await self._publish(insist=True)
        finally:
            self._sre_saving -= 1
        await self.decision_log.record_audit(self.wall_clock(), who, action, detail)
        log.info("SRE %s by %s: %s", action, who, detail)

    def _apply_now(self, who: str, kind: str) -> Decision:
        """Decide at once with the new settings (bounds, pins): no wait for the interval."""
        now = self.clock()
        signals = self.last_signals or self.gather(now)
        decision = decide(
            replace(self.loop_state, last_decision_at_s=None),  # due now
            signals,
            self.bounds(),
            self.rc.settings,
            now,
            instance_frac=self._instance_frac(),
            frozen=False,
            pinned=self.sre.pinned_shares,
        )
        if decision.reason in ("bounds", "pinned"):
            self.loop_state = decision.state
            self._place(decision.shares, now)
            self._record(decision, kind, signals, who)
        return decision

    def _check_pool(self, pool: str) -> None:
        if pool not in self.pools:
            raise NotFound(f"no pool {pool!r} (pools: {', '.join(self.pools)})", "unknown_pool")

    async def set_bounds(
        self, who: str, pool: str, floor_frac: float | None, ceiling_frac: float | None
    ) -> dict[str, Any]:
        """Override a pool's bounds (None: keep that side); both None: back to the config."""
        self._check_pool(pool)
        before = self.sre.bounds.get(pool)
        if floor_frac is None and ceiling_frac is None:
            self.sre.bounds.pop(pool, None)
        else:
            now = self.bounds()[pool]
            lo = now.floor_frac if floor_frac is None else floor_frac
            hi = now.ceiling_frac if ceiling_frac is None else ceiling_frac
            if not (0.0 <= lo <= hi <= 1.0):
                raise BadRequest(
                    f"bounds for pool {pool!r} need 0 <= floor_frac <= ceiling_frac <= 1, got"
                    f" {lo:g} / {hi:g}",
                    "invalid_bounds",
                )
            trial = {**self.bounds(), pool: Bounds(lo, hi)}
            floors = sum(b.floor_frac for b in trial.values())
            ceilings = sum(b.ceiling_frac for b in trial.values())
            if floors > 1 + 1e-9 or ceilings < 1 - 1e-9:
                raise BadRequest(
                    f"with these bounds the floors sum to {floors:.3f} and the ceilings to"
                    f" {ceilings:.3f}: floors must sum to at most 1 and ceilings to at least 1",
                    "invalid_bounds",
                )
            self.sre.bounds[pool] = (lo, hi)
        self._apply_now(who, "bounds")
        after = self.sre.bounds.get(pool)
        await self._changed(
            who,
            "set_bounds",
            {"pool": pool, "before": before and list(before), "after": after and list(after)},
        )
        return self.view()

    async def pin(self, who: str, shares: Mapping[str, float]) -> dict[str, Any]:
        """Pin the ratio: the loop holds it (within bounds) until `unpin`."""
        for pool in shares:
            self._check_pool(pool)
        given = {p: float(v) for p, v in shares.items()}
        if any(not 0.0 <= v <= 1.0 for v in given.values()):
            raise BadRequest("pinned shares must be between 0 and 1", "invalid_shares")
        missing = [p for p in self.pools if p not in given]
        if len(missing) == 1:
            given[missing[0]] = max(0.0, 1.0 - sum(given.values()))
        elif missing:
            raise BadRequest(
                f"pin a share for every pool but at most one (missing {', '.join(missing)})",
                "invalid_shares",
            )
        if abs(sum(given.values()) - 1.0) > _SHARE_TOLERANCE:
            raise BadRequest(
                f"pinned shares sum to {sum(given.values()):.3f}; they must sum to 1",
                "invalid_shares",
            )
        limits = self._limits({})
        outside = [
            p for p, v in given.items() if not limits[p][0] - 1e-9 <= v <= limits[p][1] + 1e-9
        ]
        if outside:
            raise BadRequest(
                "pinned shares outside the bounds: "
                + ", ".join(
                    f"{p} {given[p]:g} not in [{limits[p][0]:g}, {limits[p][1]:g}]" for p in outside
                ),
                "outside_bounds",
            )
        before = self.sre.pinned_shares
        self.sre.pinned_shares = given
        self._apply_now(who, "pinned")
        await self._changed(who, "pin", {"before": before, "after": given})
        return self.view()

    async def unpin(self, who: str) -> dict[str, Any]:
        before = self.sre.pinned_shares
        self.sre.pinned_shares = None
        await self._changed(who, "unpin", {"before": before})
        return self.view()

    async def pin_instance(self, who: str, instance_id: str, pool: str | None) -> dict[str, Any]:
        """Pin an instance to a pool (None: unpin it). A pin never moves the instance by
        itself; the loop and `move_instance` then leave it where it is pinned."""
        if self.fleet.get(instance_id) is None:
            raise NotFound(f"no instance {instance_id!r}", "unknown_instance")
        before = self.sre.pinned_instances.get(instance_id)
        if pool is None:
            self.sre.pinned_instances.pop(instance_id, None)
        else:
            self._check_pool(pool)
            self.sre.pinned_instances[instance_id] = pool
        action = "pin_instance" if pool is not None else "unpin_instance"
        await self._changed(who, action, {"instance": instance_id, "before": before, "after": pool})
        return self.view()

    async def freeze(self, who: str, frozen: bool) -> dict[str, Any]:
        before = self.sre.frozen
        self.sre.frozen = frozen
        await self._changed(who, "freeze" if frozen else "unfreeze", {"before": before})
        return self.view()

    async def move(
        self, who: str, from_pool: str, to_pool: str, share_frac: float
    ) -> dict[str, Any]:
        """Move `share_frac` of total capacity from one pool to another now (within bounds;
        the cooldown starts)."""
        self._check_pool(from_pool)
        self._check_pool(to_pool)
        if from_pool == to_pool or not 0.0 < share_frac <= 1.0:
            raise BadRequest(
                "a move needs two different pools and 0 < share_frac <= 1", "invalid_move"
            )
        shares = dict(self.loop_state.shares)
        shares[from_pool] -= share_frac
        shares[to_pool] += share_frac
        return await self._forced(
            who, shares, {"from_pool": from_pool, "to_pool": to_pool, "share_frac": share_frac}
        )

    async def move_instance(self, who: str, instance_id: str, to_pool: str) -> dict[str, Any]:
        """Move one whole instance to a pool now: it drains from its old pool first."""
        self._check_pool(to_pool)
        state = self.fleet.get(instance_id)
        if state is None:
            raise NotFound(f"no instance {instance_id!r}", "unknown_instance")
        pin = self.pinned_instances().get(instance_id)
        if pin is not None and pin != to_pool:
            raise BadRequest(
                f"{instance_id} is pinned to pool {pin!r}: unpin it first", "instance_pinned"
            )
        current = self.pool_map.current
        if instance_id in current.draining:
            raise BadRequest(f"{instance_id} is draining already", "drain_in_progress")
        old = dict(current.pools_of(instance_id))
        if old == {to_pool: 1.0}:
            raise BadRequest(f"{instance_id} is in pool {to_pool!r} already", "invalid_move")
        capacity = self.fleet.capacity_gpus()
        fracs = {i: dict(current.pools_of(i)) for i in current.fracs}
        fracs[instance_id] = {to_pool: 1.0}
        moved = Allocation(fracs)
        shares = {p: moved.share_of(p, capacity) for p in self.pools}
        self._within_bounds(shares)
        now = self.clock()
        from_pool = max((p for p in old if p != to_pool), key=lambda p: old[p])
        drain = Drain(from_pool, to_pool, now, now + self.rc.drain_timeout_s)
        draining = {**current.draining, instance_id: drain}
        self.pool_map.replace(Allocation(moved.fracs, current.version, draining))
        self._schedule_drain_check(self.rc.drain_timeout_s)
        detail = {"instance": instance_id, "from_pool": from_pool, "to_pool": to_pool}
        self._record_forced(
            who,
            shares,
            Move(from_pool, to_pool, shares[to_pool] - self.loop_state.shares.get(to_pool, 0.0)),
            now,
        )
        await self._changed(who, "move_instance", detail)
        self.check_drains()
        return self.view()

    def _within_bounds(self, shares: Mapping[str, float]) -> None:
        limits = self._limits({})
        for pool, share in shares.items():
            lo, hi = limits[pool]
            if not lo - 1e-6 <= share <= hi + 1e-6:
                raise BadRequest(
                    f"the move would put pool {pool!r} at {share:.3f}, outside its bounds"
                    f" [{lo:g}, {hi:g}]: set the bounds first",
                    "outside_bounds",
                )

    async def _forced(
        self, who: str, shares: dict[str, float], detail: dict[str, Any]
    ) -> dict[str, Any]:
        self._within_bounds(shares)
        now = self.clock()
        move = Move(detail["from_pool"], detail["to_pool"], detail["share_frac"])
        self._record_forced(who, shares, move, now)
        self._place(shares, now)
        await self._changed(who, "move", detail)
        return self.view()

    def _record_forced(
        self, who: str, shares: Mapping[str, float], move: Move, now_s: float
    ) -> None:
        self.loop_state = replace(
            self.loop_state, shares=dict(shares), history=(), last_move_at_s=now_s
        )
        self.moves += 1
        self.metrics.rebalance_moves.labels(move.from_pool, move.to_pool, "forced").inc()
        self._log_event(
            {
                "reason": "forced",
                "kind": "forced",
                "who": who,
                "move": _move_dict(move),
                "shares": _round(shares),
                "placed_shares": _round(self.placed_shares()),
            }
        )

    # ------------------------------------------------------------------ views

    def view(self) -> dict[str, Any]:
        """What `gpupool pools show` prints: settings, shares, bounds, pressure, drains."""
        current = self.pool_map.current
        now = self.clock()
        limits = self._limits({p: s.has_traffic for p, s in self.last_signals.items()})
        last = self.recent[0] if self.recent else None
        return {
            "enabled": self.rc.enabled,
            "interval_s": self.rc.interval_s,
            "hysteresis_frac": self.rc.hysteresis_frac,
            "cooldown_s": self.rc.cooldown_s,
            "drain_timeout_s": self.rc.drain_timeout_s,
            "borrow_max_frac": self.rc.borrow_max_frac,
            "borrowed_frac": _round(self.borrowed_fracs()),
            "frozen": self.sre.frozen,
            "pinned_shares": self.sre.pinned_shares,
            "pinned_instances": self.pinned_instances(),
            "bounds_overrides": {p: list(b) for p, b in self.sre.bounds.items()},
            "target_shares": _round(self.loop_state.shares),
            "placed_shares": _round(self.placed_shares()),
            "bounds": {p: [round(lo, 4), round(hi, 4)] for p, (lo, hi) in limits.items()},
            "pressure": last.get("pressure") if last else None,
            "smoothed_pressure": last.get("smoothed_pressure") if last else None,
            "moves": self.moves,
            "cooldown_left_s": None
            if self.loop_state.last_move_at_s is None
            else round(max(0.0, self.rc.cooldown_s - (now - self.loop_state.last_move_at_s)), 1),
            "draining": {
                i: {
                    "from_pool": d.from_pool,
                    "to_pool": d.to_pool,
                    "for_s": round(now - d.started_at_s, 1),
                    "deadline_in_s": round(d.deadline_s - now, 1),
                    "old_sequences_left": (
                        s.running_by_pool.get(d.from_pool, 0)
                        if (s := self.fleet.get(i)) is not None
                        else 0
                    ),
                }
                for i, d in current.draining.items()
            },
            "last_decisions": list(self.recent)[:5],
            "leader": self.leadership.view(),
        }

    def refresh_gauges(self) -> None:
        m = self.metrics
        m.drains_in_progress.set(len(self.pool_map.current.draining))
        for pool, share in self.loop_state.shares.items():
            m.pool_target_share.labels(pool).set(share)
        for pool, frac in self.borrowed_fracs().items():
            m.borrowed_frac.labels(pool).set(frac)

    def borrowed_fracs(self) -> dict[str, float]:
        """Per pool, the capacity its sequences hold on instances it has no part of (borrowed
        KV blocks over the instance's blocks, times its GPUs), as a share of all GPUs."""
        allocation = self.pool_map.current
        total = sum(self.fleet.capacity_gpus().values())
        out = dict.fromkeys(self.pools, 0.0)
        for state in self.fleet:
            cap = state.capacity_blocks
            if not cap or total <= 0:
                continue
            for pool in self.pools:
                if allocation.frac(state.instance_id, pool) > 0:
                    continue
                blocks = state.reserved_by_pool.get(pool, 0)
                out[pool] += min(1.0, blocks / cap) * state.spec.gpus / total
        return out


def _differs(a: Mapping[str, Mapping[str, float]], b: Mapping[str, Mapping[str, float]]) -> bool:
    if set(a) != set(b):
        return True
    for i, by_pool in a.items():
        other = b[i]
        if set(by_pool) != set(other) or any(abs(f - other[p]) > 1e-9 for p, f in by_pool.items()):
            return True
    return False


def _differs_shares(a: Mapping[str, float], b: Mapping[str, float]) -> bool:
    return set(a) != set(b) or any(abs(v - b[p]) > 1e-6 for p, v in a.items())


def _round(values: Mapping[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in values.items()}


def _fmt(shares: Mapping[str, float]) -> str:
    return ", ".join(f"{p} {v:.2f}" for p, v in sorted(shares.items()))


def _move_dict(move: Move) -> dict[str, Any]:
    return {
        "from_pool": move.from_pool,
        "to_pool": move.to_pool,
        "share_frac": round(move.share_frac, 4),
    }


def _signals_dict(s: PoolSignals) -> dict[str, Any]:
    def r(v: float | None) -> float | None:
        return None if v is None else round(v, 4)

    return {
        "queue_wait_s": r(s.queue_wait_s),
        "kv_usage_frac": r(s.kv_usage_frac),
        "ttft_p95_s": r(s.ttft_p95_s),
        "tpot_p95_s": r(s.tpot_p95_s),
        "rejected_frac": r(s.rejected_frac),
        "requests": s.requests,
    }
