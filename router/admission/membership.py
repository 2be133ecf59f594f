"""Fleet membership at run time: the fleet follows what a dynamic engine source (Kubernetes,
Ray) answers, without a router restart.

`reconcile(specs)` takes one whole answer:

- an engine new to the fleet joins: it is added unhealthy (the next good scrape makes it
  healthy), starts being scraped and accounted, and is placed where the target shares need
  it, so admission sends it work at once;
- an engine missing from the answer is *leaving*: it is taken out of every pool at once (no
  new work), its sequences in flight finish where they are, and it leaves the fleet when the
  last one is released or `drain_timeout_s` passes (then what is still running keeps running
  and is still accounted; nothing is cut);
- placement goes through the rebalancer's `plan_moves` from the current allocation, not a plan
  from scratch: the engines that stay keep their pools (a split one may be resized) and a
  drain in progress goes on; only when a pool with a target share is left with no engine at
  all does one engine move to it (draining from its old pool); an engine that left and comes
  back under the same id goes back to the pool it was in;
- a leaving engine that reappears is taken back; an engine at a new address (Ray restarted
  it elsewhere) keeps its id, and is readmitted when the new address answers a scrape.

Pure bookkeeping over the fleet, the pool map and the accountant, with an injected clock;
the shell (`DiscoveryLoop`) does the polling.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

from pools.allocation import Allocation, PoolMap, plan_moves
from pools.fleet import Fleet, InstanceState
from pools.launchers.base import InstanceSpec
from pools.operating_point import OperatingPoint
from router.accounting.accountant import Accountant

__all__ = ["Membership"]

log = logging.getLogger(__name__)


class Membership:
    def __init__(
        self,
        fleet: Fleet,
        pool_map: PoolMap,
        accountant: Accountant,
        *,
        target_shares: Callable[[], Mapping[str, float]],
        drain_timeout_s: float,
        pinned: Callable[[], Mapping[str, str]] = dict,
        initial_shares: Mapping[str, float] | None = None,
        registry: CollectorRegistry,
        new_operating_point: Callable[[], OperatingPoint] = OperatingPoint,
        on_join: Callable[[str], None] = lambda _iid: None,
        on_gone: Callable[[str], None] = lambda _iid: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fleet = fleet
        self._pool_map = pool_map
        self._accountant = accountant
        self._target_shares = target_shares
        self._pinned = pinned
        self._initial_shares = dict(initial_shares or {})
        self._drain_timeout_s = drain_timeout_s
        self._new_op = new_operating_point
        self._on_join = on_join
        self._on_gone = on_gone
        self._clock = clock
        self._leaving_since_s: dict[str, float] = {}
        # the pool an engine that left was in (most of it): it goes back there if it returns
        self._last_pool: dict[str, str] = {}
        self.changes = Counter(
            "gpupool_fleet_changes_total",
            "Engines that joined, began leaving (drain), came back, moved, or left the fleet",
            ["change"],
            registry=registry,
        )
        self.leaving = Gauge(
            "gpupool_instances_leaving",
            "Engines draining before they leave the fleet",
            registry=registry,
        )
        fleet.on_capacity_change(self._maybe_drained)

    def reconcile(self, specs: Sequence[InstanceSpec]) -> None:
        """Make the fleet follow one whole answer of the source (see the module docstring)."""
        now = self._clock()
        wanted = {s.instance_id: s for s in specs}
        placement_changed = False
        for instance_id, spec in wanted.items():
            state = self._fleet.get(instance_id)
            if state is None:
                self._join(spec, now)
                placement_changed = True
                continue
            if state.leaving:
                state.leaving = False
                self._leaving_since_s.pop(instance_id, None)
                self.changes.labels("returned").inc()
                log.info("%s is back before it finished draining", instance_id)
                placement_changed = True
            if (state.spec.url, state.spec.api_key) != (spec.url, spec.api_key):
                log.info("%s moved: %s -> %s", instance_id, state.spec.url, spec.url)
                self._fleet.replace_spec(spec)
                self.changes.labels("moved").inc()
        for state in list(self._fleet):
            if state.instance_id not in wanted and not state.leaving:
                self._begin_leaving(state, now)
                placement_changed = True
        if placement_changed:
            self._place(now)
        for instance_id, since_s in list(self._leaving_since_s.items()):
            if now - since_s >= self._drain_timeout_s:
                state = self._fleet.get(instance_id)
                log.warning(
                    "%s: drain timeout (%.0f s) with %d sequence(s) still in flight; they"
                    " finish where they are",
                    instance_id,
                    self._drain_timeout_s,
                    state.inflight if state else 0,
                )
                self._gone(instance_id, now)
        self.leaving.set(len(self._leaving_since_s))

    def _join(self, spec: InstanceSpec, now_s: float) -> None:
        state = self._fleet.add(spec)
        state.op = self._new_op()
        self._accountant.add_instance(spec.instance_id, float(spec.gpus), {}, now_s)
        self.changes.labels("joined").inc()
        self._on_join(spec.instance_id)

    def _begin_leaving(self, state: InstanceState, now_s: float) -> None:
        state.leaving = True
        self._leaving_since_s[state.instance_id] = now_s
        self.changes.labels("leaving").inc()
        log.info(
            "%s left its source: draining %d sequence(s) in flight",
            state.instance_id,
            state.inflight,
        )
        if state.inflight == 0:
            self._gone(state.instance_id, now_s)

    def _maybe_drained(self, instance_id: str) -> None:
        """A lease was released or a reading arrived: a drained leaving engine leaves now."""
        if instance_id not in self._leaving_since_s:
            return
        state = self._fleet.get(instance_id)
        if state is None or state.inflight == 0:
            self._gone(instance_id, self._clock())
            self.leaving.set(len(self._leaving_since_s))

    def _gone(self, instance_id: str, now_s: float) -> None:
        pools = self._pool_map.current.pools_of(instance_id)
        if pools:
            self._last_pool[instance_id] = max(pools, key=lambda p: (pools[p], p))
        self._leaving_since_s.pop(instance_id, None)
        self._fleet.remove(instance_id)
        if self._accountant.has_instance(instance_id):
            self._accountant.remove_instance(instance_id, now_s)
        self.changes.labels("left").inc()
        self._on_gone(instance_id)

    def _place(self, now_s: float) -> None:
        """Place joining engines and drop leaving ones, from the current allocation (see the
        module docstring); a pool left without any engine gets one moved to it."""
        capacity = self._fleet.capacity_gpus()
        current = self._pool_map.current
        # an engine that comes back (same id) joins the pool it left, unless pinned elsewhere
        returning = {
            i: p for i, p in self._last_pool.items() if i in capacity and not current.pools_of(i)
        }
        pinned = {**returning, **{i: p for i, p in self._pinned().items() if i in capacity}}
        shares = dict(self._target_shares())
        if sum(shares.values()) <= 1e-9 and self._initial_shares:
            shares = dict(self._initial_shares)  # the fleet was empty: no ratio to keep yet
        total = sum(shares.values())
        if total > 0:
            shares = {p: v / total for p, v in shares.items()}

        def placed(whole_moves: bool) -> Allocation:
            return plan_moves(
                current,
                capacity,
                shares,
                now_s=now_s,
                drain_timeout_s=self._drain_timeout_s,
                pinned=pinned,
                whole_moves=whole_moves,
            )

        allocation = placed(whole_moves=False)
        served = {p for by_pool in allocation.fracs.values() for p, f in by_pool.items() if f > 0}
        if any(v > 0 and p not in served for p, v in shares.items()):
            allocation = placed(whole_moves=True)
        self._pool_map.replace(allocation)
