"""The what-if simulator: a scenario replayed in simulated time through gpupool's own fleet,
admission, picking and rebalancer code, with engines modelled (`router.simulate.model`).

What is real, built by the router's own `router.core.build_core`: `pools.fleet.Fleet` (leases,
telemetry freshness, the operating point learned from the modelled engines' counters), the
admitter's synchronous core (`admit_now` on arrival, `enqueue`, `dispatch_once`: the admission
decision, the picker and the lease in one step, with the waiting bookkeeping, so placement
patience, the wait for a run's home and affinity-or-move act as in the router), the per-pool
`PoolQueue`s, `router.rebalancer.rebalancer.Rebalancer.tick` and `check_recall` (signals,
`pools.rebalance.decide`, `plan_moves`, drains). A request leaves its queue unserved after
`Admitter.max_wait_s`, checked at each dispatch pass (the router's timers).
What is modelled: the engines (processor-sharing batches, a linear TPOT in the batch size, a
prefill rate), the clients (the harness's workload plan, drawn from the scenario's seed, with
agent steps following each other after their tool waits), scrapes every
`router.scrape_interval_s`, and with `prefix_cache` each engine's prefix cache
(`router.simulate.prefix`: the router's lookup of it, then its own placement and admission).
Event-driven: time jumps from one event (an arrival, a prefill or a sequence ending, a scrape,
a rebalancer tick) to the next, so a day of traffic runs in seconds.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pools.allocation import Allocation
from pools.config import Config
from pools.fleet import Lease
from pools.launchers.base import InstanceSpec
from pools.telemetry import InstanceReading
from router.admission.decision import CachedPrefix, Need
from router.admission.estimate import Estimate
from router.admission.queueing import QueueEntry
from router.core import build_core
from router.errors import CapacityExceeded, NoHealthyInstance
from router.rebalancer.rebalancer import recall_check_offsets_s
from router.request import RequestContext, RequestOutcome
from router.simulate.model import EngineModel, LatencyModel, SimSequence
from router.simulate.prefix import EnginePrefixCache, PromptChain
from router.simulate.workload import AgentRunPlan, ChatRequestPlan, Plan

__all__ = ["SimResult", "simulate"]

_ARRIVALS = frozenset({"chat", "run", "step"})  # events that bring work


@dataclass(eq=False, slots=True)
class _Request:
    """A simulated request; while it waits in its pool's queue, the admitter's `Waiter`."""

    sim: _Sim
    ctx: RequestContext
    estimate: Estimate
    need: Need
    class_name: str
    run: _Run | None = None
    admitted_s: float | None = None
    first_token_s: float | None = None
    ended_s: float | None = None
    rejected: str | None = None
    lease: Lease | None = None
    exclude: frozenset[str] = frozenset()
    chain: PromptChain | None = None  # its prompt's blocks (prefix caches modelled)

    def gone(self) -> bool:
        return self.ended_s is not None

    def admitted(self, lease: Lease) -> None:
        self.sim._start(self, lease)

    def refused(self, err: CapacityExceeded) -> None:
        self.sim._reject(self, err.code)


@dataclass(eq=False, slots=True)
class _Run:
    plan: AgentRunPlan
    step: int = 0
    context_tokens: int = 0
    started_s: float = 0.0
    ended_s: float | None = None
    outcome: str = "running"


@dataclass(slots=True)
class SimResult:
    config_source: str
    simulated_s: float
    wall_s: float = 0.0
    requests: list[dict[str, Any]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    shares: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    gpu_seconds_by_pool: dict[str, float] = field(default_factory=dict)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    # with prefix caches modelled: prompt tokens started, those found cached, the router's
    # lookups (None: not modelled)
    prefix: dict[str, Any] | None = None


class _Sim:
    def __init__(
        self,
        config: Config,
        plan: Plan,
        latency: LatencyModel,
        capacity_blocks: int,
        block_size_tokens: int,
        seed: int,
        prefix_cache: bool = False,
    ) -> None:
        self.config = config
        self.plan = plan
        self.now = 0.0
        clock: Callable[[], float] = lambda: self.now  # noqa: E731
        n = config.engines.instance_count
        gpus = config.engines.gpus_per_instance
        specs = [InstanceSpec(f"engine-{i}", f"sim://engine-{i}", gpus) for i in range(n)]
        core = build_core(config, specs, clock, random.Random(seed), wall_clock=clock)
        self.fleet, self.pool_map, self.affinity = core.fleet, core.pool_map, core.affinity
        self.admitter, self.rebalancer = core.admitter, core.rebalancer
        self.engines = {s.instance_id: EngineModel(latency, capacity_blocks) for s in specs}
        self.latency = latency
        self._rng = random.Random(seed)
        self.capacity_blocks = capacity_blocks
        self.block_size_tokens = block_size_tokens
        self._events: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        self.requests: list[_Request] = []
        self.runs: list[_Run] = []
        self.result = SimResult(config.source, plan.scenario.duration_s)
        self._by_seq: dict[int, tuple[_Request, SimSequence]] = {}
        self._arrivals_pending = 0
        self._shares_for: Allocation | None = None
        self._held_since_s = 0.0
        self._running = 0  # sequences on the engines
        # queued entries by when they time out: (at_s, sequence number, entry)
        self._timeouts: list[tuple[float, int, QueueEntry]] = []
        self._gpus_by_pool: dict[str, float] = {}
        # each engine's prefix cache (None: not modelled; every prompt token is prefilled, as
        # admission predicts); the router looks it up when its config follows KV events
        self.prefix_caches = (
            {iid: EnginePrefixCache(capacity_blocks) for iid in self.engines}
            if prefix_cache
            else None
        )
        self._lookup = prefix_cache and config.engines.kv_events_on
        self._exact = frozenset(self.engines)
        if prefix_cache:
            self.result.prefix = {"prompt_tokens": 0, "cached_tokens": 0, "lookups": 0}

    # ------------------------------------------------------------------ events

    def at(self, t_s: float, kind: str, data: Any = None) -> None:
        heapq.heappush(self._events, (t_s, next(self._seq), kind, data))
        if kind in _ARRIVALS:
            self._arrivals_pending += 1

    def run(self) -> SimResult:
        # The plan's arrivals, already in time order, are read from one sorted list; only the
        # events made as it runs (steps, scrapes, ticks, samples) go through the heap, which so
        # stays small. Ties keep the order of one heap: (time, sequence number).
        arrivals: list[tuple[float, int, str, Any]] = [
            (chat.t_s, next(self._seq), "chat", chat) for chat in self.plan.chat
        ]
        arrivals += [(run.t_s, next(self._seq), "run", run) for run in self.plan.runs]
        arrivals.sort(key=lambda e: (e[0], e[1]))
        self._arrivals_pending += len(arrivals)
        self.at(0.0, "scrape")
        if self.config.rebalancer.enabled:
            self._plan_decisions()
        self.at(0.0, "sample")
        horizon = self.plan.scenario.duration_s + self.plan.scenario.drain_timeout_s
        engines = list(self.engines.values())
        queues = list(self.admitter.queues.values())
        heap = self._events
        next_arrival, n_arrivals = 0, len(arrivals)
        while True:
            quiet = not self._arrivals_pending and not self._running
            if quiet and not any(len(q) for q in queues):
                break
            t = min(e.next_event_at_s for e in engines)
            if next_arrival < n_arrivals and arrivals[next_arrival][0] < t:
                t = arrivals[next_arrival][0]
            if heap and heap[0][0] < t:
                t = heap[0][0]
            if t == math.inf or t > horizon:
                break
            self._advance(t)
            due = self.now + 1e-12
            while True:
                a = arrivals[next_arrival] if next_arrival < n_arrivals else None
                h = heap[0] if heap else None
                if a is not None and a[0] <= due and (h is None or h[0] > due or a < h):
                    next_arrival += 1
                    event = a
                elif h is not None and h[0] <= due:
                    event = heapq.heappop(heap)
                else:
                    break
                if event[2] in _ARRIVALS:
                    self._arrivals_pending -= 1
                self._handle(event[2], event[3])
            self._pump()
        self._hold_gpus()
        self._finish()
        return self.result

    def _plan_decisions(self) -> None:
        """The rebalancer loop's next interval, as `Rebalancer._run` spends it: the recall checks
        (`recall_check_offsets_s`), then the decision."""
        interval_s = self.config.rebalancer.interval_s
        for at_s in recall_check_offsets_s(interval_s):
            self.at(self.now + at_s, "recall_check")
        self.at(self.now + interval_s, "tick")

    def _hold_gpus(self) -> None:
        """GPU-seconds held by each pool up to now, at the allocation held since the last call
        (the shares change only with the allocation, so this runs when it changes)."""
        dt = self.now - self._held_since_s
        held = self.result.gpu_seconds_by_pool
        for pool, gpus in self._gpus_by_pool.items():
            held[pool] = held.get(pool, 0.0) + gpus * dt
        self._held_since_s = self.now
        allocation = self.pool_map.current
        capacity = self.fleet.capacity_gpus()
        total = sum(capacity.values())
        self._gpus_by_pool = {
            pool: allocation.share_of(pool, capacity) * total for pool in self.rebalancer.pools
        }
        self._shares_for = allocation

    def _advance(self, t_s: float) -> None:
        if self.pool_map.current is not self._shares_for:
            self._hold_gpus()
        self.now = t_s
        for engine in self.engines.values():
            if engine.next_event_at_s <= t_s:
                self._engine_changed(*engine.sync(t_s))

    def _engine_changed(self, first: list[SimSequence], ended: list[SimSequence]) -> None:
        for s in first:
            req, _ = self._by_seq[id(s)]
            req.first_token_s = s.first_token_at_s
            if req.lease is not None:
                req.lease.first_token(self.now)
        for s in ended:
            self._done(s)

    def _handle(self, kind: str, data: Any) -> None:
        if kind == "chat":
            plan: ChatRequestPlan = data
            chain = self._chain(plan.class_name, plan.tenant, plan.prefix_tokens, plan.index)
            self._arrive(plan.class_name, plan.prompt_tokens, plan.output_tokens, None, chain)
        elif kind == "run":
            run = _Run(data, context_tokens=data.prompt_tokens, started_s=self.now)
            self.runs.append(run)
            self._step(run)
        elif kind == "step":
            self._step(data)
        elif kind == "scrape":
            self._scrape()
            self.at(self.now + self.config.router.scrape_interval_s, "scrape")
        elif kind in ("tick", "recall_check"):
            decision = self.rebalancer.tick() if kind == "tick" else self.rebalancer.check_recall()
            if decision is not None and decision.move is not None and decision.changed:
                self.result.decisions.append(
                    {
                        "t_s": round(self.now, 2),
                        "reason": decision.reason,
                        "from": decision.move.from_pool,
                        "to": decision.move.to_pool,
                        "share_frac": round(decision.move.share_frac, 4),
                    }
                )
            if kind == "tick":
                self._plan_decisions()
        elif kind == "sample":
            self.result.shares.append((round(self.now, 2), self.rebalancer.placed_shares()))
            self.at(self.now + 5.0, "sample")

    def _step(self, run: _Run) -> None:
        plan = run.plan
        step = plan.steps[run.step]
        if run.context_tokens + step.output_tokens > plan.max_context_tokens:
            run.outcome = "context_limit"
            run.ended_s = self.now
            return
        chain = self._chain(plan.class_name, plan.tenant, plan.prefix_tokens, ("run", plan.index))
        self._arrive(plan.class_name, run.context_tokens, step.output_tokens, run, chain)

    def _chain(
        self, class_name: str, tenant: int | None, prefix_tokens: int, own: Any
    ) -> PromptChain | None:
        if self.prefix_caches is None:
            return None
        bs = self.block_size_tokens
        shared = None if tenant is None else (class_name, tenant)
        return PromptChain(shared, prefix_tokens // bs, (class_name, own), bs)

    def _arrive(
        self,
        class_name: str,
        prompt: int,
        output: int,
        run: _Run | None,
        chain: PromptChain | None = None,
    ) -> None:
        pool = self.config.pool_for_class(class_name)
        if pool is None:
            return
        cls = self.config.class_config(class_name)
        ctx = RequestContext(
            request_id=f"r{next(self._ids)}",
            tenant="sim",
            class_name=class_name,
            pool=pool.name,
            priority=cls.default_priority,
            deadline_s=self.now + cls.timeout_s,
            run_id=None if run is None else f"run-{run.plan.index}",
            model="sim",
            stream=True,
            client_wants_usage=False,
            received_at_s=self.now,
        )
        estimate = Estimate(prompt, output, "heuristic")
        if chain is not None and self._lookup and self.prefix_caches is not None:
            # the router's lookup on arrival (router/prefix/lookup.py), of an exact index
            keys = chain.keys(prompt)
            bs = self.block_size_tokens
            cached = {iid: c.held(keys) * bs for iid, c in self.prefix_caches.items()}
            estimate = replace(estimate, prefix=CachedPrefix(prompt, cached, self._exact))
        req = _Request(self, ctx, estimate, self.admitter.need(ctx, estimate), class_name, run)
        req.chain = chain
        self.requests.append(req)
        # as `Admitter.admit`: a lease at once, a refusal, or a place in the pool's queue
        try:
            lease = self.admitter.admit_now(ctx, req.need, self.now)
            if lease is None:
                entry = self.admitter.enqueue(req, self.now)
                timeout_s = self.admitter.max_wait_s(ctx, self.now)
                heapq.heappush(self._timeouts, (self.now + timeout_s, next(self._seq), entry))
        except (CapacityExceeded, NoHealthyInstance) as err:
            self._reject(req, err.code)
            return
        if lease is not None:
            self._start(req, lease)

    # ------------------------------------------------------------------ admission

    def _pump(self) -> None:
        """The router's dispatch: its queue timeouts (the waiters' timers), then
        `dispatch_once` until a pass leaves nothing more to lend (its `schedule_pump`)."""
        timeouts = self._timeouts
        while timeouts and timeouts[0][0] < self.now:
            entry = heapq.heappop(timeouts)[2]
            req: _Request = entry.payload
            if not entry.removed and not req.gone():
                self.admitter.withdraw(entry)
                self._reject(req, "queue_timeout")
        while self.admitter.dispatch_once(self.now):
            pass

    def _start(self, req: _Request, lease: Lease) -> None:
        prefill_tokens = req.need.prefill_tokens(lease.instance_id)
        if req.chain is not None and self.prefix_caches is not None:
            # what the engine holds now (evicted or stored since the lookup), not what was
            # predicted: its prompt's blocks are then touched, or stored as it prefills
            prompt = req.estimate.prompt_tokens
            keys = req.chain.keys(prompt)
            cache = self.prefix_caches[lease.instance_id]
            cached = cache.held(keys) * self.block_size_tokens
            cache.store(keys)
            prefill_tokens = prompt - cached
            stats = self.result.prefix
            assert stats is not None
            stats["prompt_tokens"] += prompt
            stats["cached_tokens"] += cached
            stats["lookups"] += req.estimate.prefix is not None
        self._running += 1
        req.admitted_s = self.now
        req.lease = lease
        samples = self.latency.overhead_samples(req.class_name)
        engine = self.engines[lease.instance_id]
        seq = SimSequence(
            prefill_left_tokens=float(max(1, prefill_tokens)),
            output_tokens=max(1, req.estimate.output_tokens),
            blocks=lease.blocks,
            prompt_tokens=req.estimate.prompt_tokens,
            overhead_s=self._rng.choice(samples) if samples else self.latency.overhead_s,
        )
        self._by_seq[id(seq)] = (req, seq)
        self._engine_changed(*engine.add(seq, self.now))

    def _reject(self, req: _Request, code: str) -> None:
        req.rejected = code
        req.ended_s = self.now
        self._observe(req, 429)
        if req.run is not None:
            req.run.outcome = "failed"
            req.run.ended_s = self.now

    def _done(self, seq: SimSequence) -> None:
        self._running -= 1
        req, _ = self._by_seq.pop(id(seq))
        req.ended_s = self.now
        lease = req.lease
        assert lease is not None
        lease.release()
        if req.chain is not None and self.prefix_caches is not None:  # output blocks cached too
            tokens = req.estimate.prompt_tokens + req.estimate.output_tokens
            self.prefix_caches[lease.instance_id].store(req.chain.keys(tokens))
        self._observe(req, 200)
        run = req.run
        if run is None:
            return
        step = run.plan.steps[run.step]
        self.affinity.record(
            req.ctx.run_key, lease.instance_id, req.estimate.prompt_tokens + step.output_tokens
        )
        run.step += 1
        run.context_tokens += step.output_tokens + step.tool_result_tokens
        if run.step >= len(run.plan.steps):
            run.outcome = "completed"
            run.ended_s = self.now
            return
        self.at(self.now + step.tool_wait_s, "step", run)

    def _observe(self, req: _Request, status: int) -> None:
        if not self.config.rebalancer.enabled:
            return  # the signals feed only the rebalancer's ticks
        outcome = RequestOutcome(
            ctx=req.ctx,
            status=status,
            outcome="ok" if status == 200 else "rejected",
            error_type=None if status == 200 else "capacity_exceeded",  # admission's refusals
            admission_started_at_s=req.ctx.received_at_s,  # no governance in the simulator
            admitted_at_s=req.admitted_s,
            first_token_at_s=req.first_token_s,
            ended_at_s=self.now,
            completion_tokens=req.estimate.output_tokens if status == 200 else 0,
        )
        self.rebalancer.signals.finished(outcome)

    def _scrape(self) -> None:
        for iid, engine in self.engines.items():
            self._engine_changed(*engine.sync(self.now))  # its counters, as of now
            used = engine.used_blocks
            self.fleet.record_reading(
                iid,
                InstanceReading(
                    taken_at_s=self.now,
                    # asked and answered at once: admission's engine-tracked KV bound applies
                    # (the model allocates a sequence's blocks whole at its start, so the
                    # reservations' bound is never above it here)
                    requested_at_s=self.now,
                    kv_usage_frac=min(1.0, used / max(1, self.capacity_blocks)),
                    running=engine.running,
                    waiting=0,
                    num_gpu_blocks=self.capacity_blocks + 1,
                    block_size=self.block_size_tokens,
                    preemptions_total=0,
                    prefix_cache_hits_total=0,
                    prefix_cache_queries_total=0,
                    ttft_sum_s=0,
                    ttft_count=0,
                    itl_sum_s=engine.itl_sum_s,
                    itl_count=engine.itl_count,
                    prompt_tokens_sum=engine.prompt_tokens_sum,
                    prefill_time_sum_s=engine.prefill_time_sum_s,
                ),
            )

    def _finish(self) -> None:
        self.result.simulated_s = self.now
        for req in self.requests:
            ttft = None if req.first_token_s is None else req.first_token_s - req.ctx.received_at_s
            tpot = None
            if req.first_token_s is not None and req.ended_s is not None:
                tokens = req.estimate.output_tokens
                if tokens > 1:
                    tpot = (req.ended_s - req.first_token_s) / (tokens - 1)
            self.result.requests.append(
                {
                    "class": req.class_name,
                    "pool": req.ctx.pool,
                    "arrived_s": round(req.ctx.received_at_s, 4),
                    "queue_s": None
                    if req.admitted_s is None
                    else round(req.admitted_s - req.ctx.received_at_s, 4),
                    "ttft_s": None if ttft is None else round(ttft, 4),
                    "tpot_s": None if tpot is None else round(tpot, 5),
                    "rejected": req.rejected,
                    "done": req.ended_s is not None and req.rejected is None,
                }
            )
        for run in self.runs:
            self.result.runs.append(
                {
                    "class": run.plan.class_name,
                    "started_s": round(run.started_s, 3),
                    "completion_s": None
                    if run.ended_s is None or run.outcome != "completed"
                    else round(run.ended_s - run.started_s, 3),
                    "outcome": run.outcome,
                }
            )


def simulate(
    config: Config,
    plan: Plan,
    latency: LatencyModel,
    *,
    capacity_blocks: int,
    block_size_tokens: int = 16,
    seed: int = 0,
    prefix_cache: bool = False,
) -> SimResult:
    """Replay `plan` against a router built from `config` over modelled engines, each with
    `capacity_blocks` KV blocks of `block_size_tokens` (vLLM's default is 16 on GPUs and 128
    on CPUs). `prefix_cache`: model each engine's prefix cache (router/simulate/prefix.py):
    an engine prefills only the prompt tokens it does not hold, and a router whose config
    follows KV events (`engines.kv_events`) looks each prompt up and places and admits by it
    with its own code (`router.prefix.score`); off, every prompt token is prefilled.

    Python's cyclic garbage collector is paused while it runs (and restored after): a day of
    traffic allocates millions of short-lived objects and almost no cycles, and the
    collector's passes over the live heap took a fifth of the time."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _Sim(
            config, plan, latency, capacity_blocks, block_size_tokens, seed, prefix_cache
        ).run()
    finally:
        if collecting:
            gc.enable()


def summarize(result: SimResult, config: Config) -> dict[str, Any]:
    """Per pool: requests, SLO attainment (TTFT and TPOT within the pool's targets), TTFT and
    queue-wait p95, rejections, GPU-seconds held; agent runs; the ratio over time."""
    pools: dict[str, Any] = {}
    for pool in config.pools:
        rs = [r for r in result.requests if r["pool"] == pool.name]
        ttft_t, tpot_t = pool.slo.ttft_p95_ms / 1e3, pool.slo.tpot_p95_ms / 1e3
        good = [
            r
            for r in rs
            if r["done"]
            and r["ttft_s"] is not None
            and r["ttft_s"] <= ttft_t
            and (r["tpot_s"] or 0.0) <= tpot_t
        ]
        ttfts = [r["ttft_s"] for r in rs if r["ttft_s"] is not None]
        waits = [r["queue_s"] for r in rs if r["queue_s"] is not None]
        pools[pool.name] = {
            "requests": len(rs),
            "slo_attainment": len(good) / len(rs) if rs else None,
            "ttft_p95_s": float(np.percentile(ttfts, 95)) if ttfts else None,
            "queue_wait_p95_s": float(np.percentile(waits, 95)) if waits else None,
            "rejected": sum(1 for r in rs if r["rejected"]),
            "gpu_seconds": round(result.gpu_seconds_by_pool.get(pool.name, 0.0), 1),
        }
    done = [r["completion_s"] for r in result.runs if r["completion_s"] is not None]
    return {
        "config": result.config_source,
        "simulated_s": result.simulated_s,
        "wall_s": round(result.wall_s, 3),
        "speed_x": round(result.simulated_s / result.wall_s, 1) if result.wall_s else None,
        "pools": pools,
        "agent_runs": {
            "runs": len(result.runs),
            "completed": len(done),
            "completion_p50_s": float(np.percentile(done, 50)) if done else None,
        },
        "moves": result.decisions,
        "shares": result.shares,
        "prefix_cache": None
        if result.prefix is None
        else {
            **result.prefix,
            "hit_frac": round(result.prefix["cached_tokens"] / result.prefix["prompt_tokens"], 4)
            if result.prefix["prompt_tokens"]
            else None,
        },
    }
