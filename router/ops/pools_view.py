"""The fleet as operators read it: `PoolsView.view()` answers `GET /admin/pools` (and feeds
`/ready` and the status page's history), `refresh_gauges()` sets the gauges `GET /metrics`
exports. Reads only; changes nothing it reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from pools.allocation import PoolMap
from pools.config import Config
from pools.fleet import Fleet
from router.admission.admitter import Admitter
from router.metrics import RouterMetrics
from router.prefix import PrefixCache
from router.rebalancer.rebalancer import Rebalancer

__all__ = ["PoolsView"]


class PoolsView:
    """Operators' view of the pools and instances; pure reads of the components it is given."""

    def __init__(
        self,
        config: Config,
        fleet: Fleet,
        pool_map: PoolMap,
        admitter: Admitter,
        rebalancer: Rebalancer,
        metrics: RouterMetrics,
        *,
        clock: Callable[[], float],
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.pool_map = pool_map
        self.admitter = admitter
        self.rebalancer = rebalancer
        self.metrics = metrics
        self.clock = clock
        self.prefix_cache = prefix_cache  # None: no engine publishes KV events

    def view(self) -> dict[str, Any]:
        """`GET /admin/pools`: the answering replica, each pool's share, bounds, instances, SLO
        and queue, each instance's telemetry, reservations (this replica's and the other
        replicas') and operating point, and the rebalancer's view."""
        allocation = self.pool_map.current
        capacity = self.fleet.capacity_gpus()
        peers = self.admitter.peers  # the other replicas' reservations; None: not shared
        pools = {}
        for pool in self.config.pools:
            ids = allocation.instances_for(pool.name)
            pools[pool.name] = {
                "classes": list(pool.classes),
                "share_frac": round(allocation.share_of(pool.name, capacity), 4),
                "floor_frac": pool.share.floor_frac,
                "ceiling_frac": pool.share.ceiling_frac,
                "instances": {i: round(allocation.frac(i, pool.name), 4) for i in ids},
                "healthy_instances": sum(
                    1 for i in ids if (s := self.fleet.get(i)) is not None and s.healthy
                ),
                "slo": {"ttft_p95_ms": pool.slo.ttft_p95_ms, "tpot_p95_ms": pool.slo.tpot_p95_ms},
                "queue": self._queue_view(pool.name),
            }
        instances = {}
        for state in self.fleet:
            r = state.reading
            instances[state.spec.instance_id] = {
                "url": state.spec.url,
                "gpus": state.spec.gpus,
                "healthy": state.healthy,
                "last_error": state.last_error,
                "inflight": state.inflight,
                "pools": dict(allocation.pools_of(state.spec.instance_id)),
                "telemetry_age_s": None if r is None else round(self.fleet.age_s(state) or 0, 3),
                "kv_usage_frac": None if r is None else r.kv_usage_frac,
                "running": None if r is None else r.running,
                "waiting": None if r is None else r.waiting,
                "num_gpu_blocks": None if r is None else r.num_gpu_blocks,
                "kv_capacity": state.kv_capacity,  # known | unknown | None (not reported)
                "block_size": None if r is None else r.block_size,
                "kv_reserved_blocks": state.reserved_blocks,
                "kv_reserved_blocks_by_pool": dict(state.reserved_by_pool),
                # what admission counts in use: the smaller of the reservations' bound and
                # the engine-tracked one (router/admission/engine_kv.py)
                "kv_used_blocks": round(self.admitter.engine_kv.used_blocks(state), 1),
                "kv_used_blocks_by_reservations": round(state.used_blocks(), 1),
                # held for runs paused between steps (admission.tool_pause_hold), counted in use
                # for every other sequence; None: off
                "kv_pause_held_blocks": None
                if self.admitter.pauses is None
                else self.admitter.pause_held_blocks(state, self.clock()),
                "running_by_pool": dict(state.running_by_pool),
                # owned vs borrowed KV and batch per pool, the forecast reserve (admission.reserve)
                "capacity_by_pool": self.admitter.capacity_by_pool(state, self.clock()),
                "operating_point": {
                    "limit": self.admitter.instance_limit(state),
                    "source": state.op.source,
                    "samples": state.op.samples,
                    "tpot_line_ms": None
                    if (line := state.op.line) is None
                    else {
                        "intercept": round(line.intercept_s * 1e3, 3),
                        "per_sequence": round(line.slope_s * 1e3, 4),
                    },
                },
                "prefill_tokens_per_s": None
                if state.prefill_tokens_per_s is None
                else round(state.prefill_tokens_per_s, 1),
                "preemptions_seen": state.preemptions_seen,
                # the other router replicas' reservations here, as admission counts them beside
                # this replica's own above (kv_reserved_blocks, running_by_pool); None: not
                # shared (router/admission/shared_reservations.py)
                "peer_reservations": None
                if peers is None
                else peers.instance_view(state.spec.instance_id),
                # the index of its prefix cache from its KV events (docs/prefix_cache.md):
                # usable, cached_blocks, index_age_s, exact; None: not followed
                "prefix_cache": None
                if self.prefix_cache is None
                else self.prefix_cache.view(state.spec.instance_id),
            }
        return {
            # which router replica answers, and what it counts of the others
            "replica": {"id": self.rebalancer.replica, "shared_admission": False}
            if peers is None
            else peers.view(),
            "allocation_version": allocation.version,
            "admission": self.config.router.admission,
            "admission_reserve": self.config.admission.reserve,
            "pools": pools,
            "instances": instances,
            "rebalancer": self.rebalancer.view(),
        }

    def _queue_view(self, pool: str) -> dict[str, Any]:
        queue = self.admitter.queues[pool]
        now = self.clock()
        p = self.config.pool(pool)
        return {
            "depth": len(queue),
            "max_depth": p.queue.max_depth,
            "max_wait_s": p.queue.max_wait_s,
            "order": p.queue.order,
            "drain_rate_per_s": round(queue.drain_rate_per_s(now), 3),
        }

    def refresh_gauges(self) -> None:
        """Set the gauges `GET /metrics` reads from the fleet, the pools and the queues."""
        m = self.metrics
        m.asyncio_tasks.set(len(asyncio.all_tasks()))
        allocation = self.pool_map.current
        capacity = self.fleet.capacity_gpus()
        for pool in self.config.pools:
            m.pool_share.labels(pool.name).set(allocation.share_of(pool.name, capacity))
            m.queue_depth(pool.name, len(self.admitter.queues[pool.name]))
        self.rebalancer.refresh_gauges()
        for state in self.fleet:
            iid = state.spec.instance_id
            m.healthy.labels(iid).set(1 if state.healthy else 0)
            m.set_inflight(iid, state.inflight)
            m.kv_reserved.labels(iid).set(state.reserved_blocks)
            if self.admitter.pauses is not None:
                m.kv_pause_held.labels(iid).set(
                    self.admitter.pause_held_blocks(state, self.clock())
                )
            m.op_limit.labels(iid).set(self.admitter.instance_limit(state))
            m.set_preemptions(iid, state.preemptions_seen)
            if state.reading is not None:
                if state.reading.num_gpu_blocks is not None:
                    blocks = state.reading.num_gpu_blocks
                    m.kv_capacity.labels(iid).set(blocks)
                    m.kv_measured.labels(iid).set(state.reading.kv_usage_frac * blocks)
                m.kv_usage.labels(iid).set(state.reading.kv_usage_frac)
                m.engine_running.labels(iid).set(state.reading.running)
                m.engine_waiting.labels(iid).set(state.reading.waiting)
                m.telemetry_age.labels(iid).set(self.fleet.age_s(state) or 0.0)
