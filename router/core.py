"""`build_core(config, engines, clock, rng)`: the router's decision components, wired once.

The fleet (leases, telemetry freshness, operating points), the pool map, run affinity, the
picker, the admitter (the pools' queues and the synchronous dispatch core) and the rebalancer.
The `Gateway` (router.gateway.app) builds them here and adds the I/O around them; the simulator
(router.simulate) builds them here and drives them in simulated time, so the two cannot wire
them differently. Nothing here starts a task or touches the network.

Must not import the request path (router.gateway); nor the benchmark harness.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from pools.allocation import PoolMap, plan_allocation
from pools.config import Config
from pools.fleet import Fleet
from pools.launchers.base import InstanceSpec
from pools.operating_point import OperatingPoint
from router.admission.admitter import Admitter
from router.admission.picking import Picker, RunAffinity, default_picker, placement_patience_s
from router.admission.queueing import RunUsage
from router.metrics import RouterMetrics
from router.rebalancer.rebalancer import Rebalancer
from router.rebalancer.store import DecisionLog

__all__ = ["Core", "build_core"]


@dataclass(frozen=True, slots=True)
class Core:
    """The decision components, sharing one fleet, pool map, affinity and metrics."""

    metrics: RouterMetrics
    fleet: Fleet
    pool_map: PoolMap
    affinity: RunAffinity
    picker: Picker
    admitter: Admitter
    rebalancer: Rebalancer
    max_num_seqs: int  # the engines' --max-num-seqs, every operating point's ceiling


def build_core(
    config: Config,
    engines: list[InstanceSpec],
    clock: Callable[[], float],
    rng: random.Random,
    *,
    metrics: RouterMetrics | None = None,
    affinity: RunAffinity | None = None,
    run_usage: Callable[[Hashable, float], RunUsage | None] | None = None,
    wall_clock: Callable[[], float] = time.time,
    decision_log: DecisionLog | None = None,
) -> Core:
    """The components over `engines`, each pool at its `share.initial_frac` (pinned instances
    to their pool). `clock`: monotonic seconds for every decision; `wall_clock`: epoch seconds
    for the rebalancer's decision log; `rng`: the picker's tie-breaks. `run_usage((tenant,
    run_id), now_s)`: a run's attained service, which `queue.order: run_las` pools order by
    (none: every run counts as new). `decision_log`: the rebalancer's, in the router's store
    (none: its own file at rebalancer.decision_log_path)."""
    metrics = metrics or RouterMetrics()
    rc = config.router
    fleet = Fleet(
        engines,
        stale_after_s=rc.stale_after_s,
        unhealthy_after=rc.unhealthy_after_failures,
        clock=clock,
    )
    fleet.on_health_change(lambda iid, ok: metrics.healthy.labels(iid).set(1 if ok else 0))
    shares = {p.name: p.share.initial_frac for p in config.pools}
    pinned = {i: p.name for p in config.pools for i in p.pinned_instances}
    pool_map = PoolMap(plan_allocation(fleet.capacity_gpus(), shares, pinned=pinned))
    affinity = affinity or RunAffinity()
    picker = default_picker(
        fleet,
        affinity,
        rng,
        {p.name: p.placement for p in config.pools},
        placement_patience_s(config),
    )
    max_num_seqs = config.engines.max_num_seqs
    for state in fleet:
        state.op = OperatingPoint(max_num_seqs=max_num_seqs)
    admitter = Admitter(
        config, fleet, pool_map, picker, metrics, affinity, clock=clock, run_usage=run_usage
    )
    # the pool ratio follows demand; SRE controls; the decision log (router/rebalancer/)
    rebalancer = Rebalancer(
        config,
        fleet,
        pool_map,
        admitter.queues,
        metrics,
        clock=clock,
        wall_clock=wall_clock,
        decision_log=decision_log,
    )
    return Core(metrics, fleet, pool_map, affinity, picker, admitter, rebalancer, max_num_seqs)
