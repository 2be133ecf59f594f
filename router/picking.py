"""Picking an instance inside a pool: filter -> score -> pick.

Each step is a small function with one contract, in the manner of llm-d's endpoint picker:
- a `Filter` keeps the candidates that may take the request;
- a `Scorer` gives every candidate a score in [0, 1] (the picker clamps and weights);
- the `Picker` sums weighted scores and takes the best, ties broken at random (injected rng).
New policies are new functions, not new branches.

A run's steps stay where its prefix is cached unless that costs more than recomputing it
(`filter_affinity_or_move`): while the run's last instance ("home") has headroom, run
affinity scores it first; when admission finds no room there but room elsewhere, the step
waits for home only if the expected wait there is shorter than prefilling the run's context
elsewhere at the measured prefill rate, and never longer than that prefill time in total.
A moved run's affinity follows it (the proxy records where each step ran).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

from pools.allocation import Allocation
from pools.fleet import Fleet, InstanceState

__all__ = [
    "PLACEMENTS",
    "Candidate",
    "PickRequest",
    "Picker",
    "RunAffinity",
    "default_picker",
    "filter_affinity_or_move",
    "move_is_faster",
    "score_kv_headroom",
    "score_load",
    "score_run_affinity",
]


@dataclass(frozen=True, slots=True)
class PickRequest:
    pool: str
    run_key: Hashable | None  # the run, (tenant, run id) on the request path; None: no run
    exclude: frozenset[str] = frozenset()  # instances already tried for this request
    allowed: frozenset[str] | None = None  # admission's grant: where the sequence fits (None: any)
    waited_s: float = 0.0  # how long the request has waited in the queue so far
    home_wait_s: float | None = None  # expected wait for a slot on the run's home (None: unknown)


@dataclass(frozen=True, slots=True)
class Candidate:
    state: InstanceState
    frac: float  # the pool's allocation of this instance, (0, 1]

    @property
    def instance_id(self) -> str:
        return self.state.spec.instance_id


Filter = Callable[[PickRequest, list[Candidate]], list[Candidate]]
Scorer = Callable[[PickRequest, Sequence[Candidate]], list[float]]


class RunAffinity:
    """Where each run's last step went and how long its context was then (bounded LRU), so
    later steps find their prefix cache and admission knows how much of it may be cached.
    Keyed by the run's key: on the request path (tenant, run id), so two tenants that use the
    same run id have separate homes."""

    def __init__(self, max_runs: int = 100_000) -> None:
        self._last: OrderedDict[Hashable, tuple[str, int]] = OrderedDict()
        self._max_runs = max_runs

    def get(self, run_key: Hashable | None) -> str | None:
        entry = self._last.get(run_key) if run_key is not None else None
        return entry[0] if entry else None

    def context_tokens(self, run_key: Hashable | None) -> int:
        """Prompt + completion tokens of the run's last finished step (0 when unknown)."""
        entry = self._last.get(run_key) if run_key is not None else None
        return entry[1] if entry else 0

    def record(self, run_key: Hashable | None, instance_id: str, context_tokens: int = 0) -> None:
        if run_key is None:
            return
        self._last[run_key] = (instance_id, context_tokens)
        self._last.move_to_end(run_key)
        if len(self._last) > self._max_runs:
            self._last.popitem(last=False)


def filter_healthy(req: PickRequest, cands: list[Candidate]) -> list[Candidate]:
    return [c for c in cands if c.state.healthy]


def filter_granted(req: PickRequest, cands: list[Candidate]) -> list[Candidate]:
    """Keep the instances admission found the sequence fits on."""
    if req.allowed is None:
        return cands
    return [c for c in cands if c.instance_id in req.allowed]


def filter_not_tried(req: PickRequest, cands: list[Candidate]) -> list[Candidate]:
    if not req.exclude:
        return cands
    return [c for c in cands if c.instance_id not in req.exclude]


def move_is_faster(
    *,
    context_tokens: int,
    prefill_tokens_per_s: float | None,
    home_wait_s: float | None,
    waited_s: float,
) -> bool:
    """Whether a run's step should leave its home instance (full now) for another one.

    Moving costs recomputing the run's context there: `context_tokens / prefill_tokens_per_s`.
    Staying costs the expected wait for a slot at home. Move when moving is faster, when either
    cost is unknown (no prefill rate measured, no wait estimate: nothing to weigh, so behave as
    without affinity), or when the step has already waited as long as the prefill would take.
    """
    if context_tokens <= 0 or not prefill_tokens_per_s or home_wait_s is None:
        return True
    prefill_s = context_tokens / prefill_tokens_per_s
    return waited_s >= prefill_s or prefill_s < home_wait_s


def filter_affinity_or_move(affinity: RunAffinity) -> Filter:
    """Before `filter_granted`: keep the candidates, unless the run's home instance is among
    them (healthy, in the pool) but admission granted it no room now, and waiting for it is
    faster than moving (`move_is_faster`, at the fastest measured prefill rate among the
    granted others): then none, so the step waits."""

    def keep(req: PickRequest, cands: list[Candidate]) -> list[Candidate]:
        home = affinity.get(req.run_key)
        if (
            home is None
            or home in req.exclude
            or req.allowed is None
            or home in req.allowed
            or all(c.instance_id != home for c in cands)
        ):
            return cands
        others = [c for c in cands if c.instance_id in req.allowed]
        rates = [r for c in others if (r := c.state.prefill_tokens_per_s)]
        if move_is_faster(
            context_tokens=affinity.context_tokens(req.run_key),
            prefill_tokens_per_s=max(rates) if rates else None,
            home_wait_s=req.home_wait_s,
            waited_s=req.waited_s,
        ):
            return cands
        return []

    return keep


def score_kv_headroom(fleet: Fleet) -> Scorer:
    """1 - KV use (the larger of measured and reserved, see pools.fleet); stale telemetry
    counts as full (score 0)."""

    def score(req: PickRequest, cands: Sequence[Candidate]) -> list[float]:
        out = []
        for c in cands:
            cap = c.state.capacity_blocks
            if not cap or not fleet.is_fresh(c.state):
                out.append(0.0)
            else:
                out.append(1.0 - c.state.used_blocks() / cap)
        return out

    return score


def score_load(req: PickRequest, cands: Sequence[Candidate]) -> list[float]:
    """1 / (1 + in flight here, scaled by the pool's share of the instance); 1 when idle."""
    out = []
    for c in cands:
        waiting = c.state.reading.waiting if c.state.reading is not None else 0
        out.append(1.0 / (1.0 + (c.state.inflight + waiting) / max(c.frac, 1e-3)))
    return out


def score_run_affinity(affinity: RunAffinity) -> Scorer:
    """1 for the instance that served the run's previous step, 0 elsewhere."""

    def score(req: PickRequest, cands: Sequence[Candidate]) -> list[float]:
        last = affinity.get(req.run_key)
        return [1.0 if last is not None and c.instance_id == last else 0.0 for c in cands]

    return score


class Picker:
    def __init__(
        self,
        fleet: Fleet,
        filters: Sequence[Filter],
        scorers: Sequence[tuple[float, Scorer]],
        rng: random.Random,
    ) -> None:
        self._fleet = fleet
        self._filters = list(filters)
        self._scorers = list(scorers)
        self._rng = rng

    def candidates(self, allocation: Allocation, pool: str) -> list[Candidate]:
        out = []
        for instance_id in allocation.instances_for(pool):
            state = self._fleet.get(instance_id)
            if state is not None:
                out.append(Candidate(state, allocation.frac(instance_id, pool)))
        return out

    def pick(self, req: PickRequest, cands: list[Candidate]) -> Candidate | None:
        for f in self._filters:
            cands = f(req, cands)
            if not cands:
                return None
        if len(cands) == 1:
            return cands[0]
        totals = [0.0] * len(cands)
        for weight, scorer in self._scorers:
            for i, s in enumerate(scorer(req, cands)):
                totals[i] += weight * min(1.0, max(0.0, s))
        best = max(totals)
        tied = [c for c, t in zip(cands, totals, strict=True) if best - t <= 1e-9]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)


PLACEMENTS = ("affinity_or_move", "always_affinity", "least_loaded")


def default_picker(
    fleet: Fleet,
    affinity: RunAffinity,
    rng: random.Random,
    placement: str | Mapping[str, str] = "affinity_or_move",
) -> Picker:
    """Healthy, granted and untried instances of the pool; scored by run affinity (weight 2), KV
    headroom (1) and load (1).

    `placement`, one rule for every pool or one per pool (`pools.<pool>.placement`; a pool not
    named gets `affinity_or_move`): `affinity_or_move` waits for a full home instance when that
    is faster than recomputing the context elsewhere; `always_affinity` waits for it whatever
    the cost (while it is healthy); `least_loaded` ignores affinity (no filter, no affinity
    score).
    """
    default = placement if isinstance(placement, str) else "affinity_or_move"
    by_pool = {} if isinstance(placement, str) else dict(placement)
    for rule in (default, *by_pool.values()):
        if rule not in PLACEMENTS:
            raise ValueError(f"unknown placement {rule!r}")
    filters: dict[str, Filter] = {
        "affinity_or_move": filter_affinity_or_move(affinity),
        "always_affinity": filter_always_affinity(affinity),
    }
    run_affinity = score_run_affinity(affinity)

    def placed(req: PickRequest, cands: list[Candidate]) -> list[Candidate]:
        rule = filters.get(by_pool.get(req.pool, default))
        return cands if rule is None else rule(req, cands)

    def affinity_score(req: PickRequest, cands: Sequence[Candidate]) -> list[float]:
        if by_pool.get(req.pool, default) == "least_loaded":
            return [0.0] * len(cands)
        return run_affinity(req, cands)

    return Picker(
        fleet,
        filters=[filter_healthy, placed, filter_granted, filter_not_tried],
        scorers=[(2.0, affinity_score), (1.0, score_kv_headroom(fleet)), (1.0, score_load)],
        rng=rng,
    )


def filter_always_affinity(affinity: RunAffinity) -> Filter:
    """Before `filter_granted`: only the run's home instance while it is healthy, in the pool
    and untried (for comparison: a step waits for its home however long that takes)."""

    def keep(req: PickRequest, cands: list[Candidate]) -> list[Candidate]:
        home = affinity.get(req.run_key)
        if home is None or home in req.exclude:
            return cands
        return [c for c in cands if c.instance_id == home] or cands

    return keep
