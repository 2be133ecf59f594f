"""Picking an instance inside a pool: filter -> score -> pick.

Each step is a small function with one contract, in the manner of llm-d's endpoint picker:
- a `Filter` keeps the candidates that may take the request;
- a `Scorer` gives every candidate a score in [0, 1] (the picker clamps and weights);
- the `Picker` sums weighted scores and takes the best, ties broken at random (injected rng).
New policies are new functions, not new branches.

A run's steps stay where its prefix is cached unless moving costs less than waiting
(`filter_affinity_or_move`): while the run's last instance ("home") has headroom, run
affinity scores it first. When admission finds no room there but room elsewhere, the step
moves to another instance only if that instance has spare room (a free slot beyond this step
and the steps already waiting for it as their own home: otherwise the move only hands the
wait to another run, and moves cascade), and the expected wait at home, or the time the step
has already waited, exceeds the whole cost of the move (`move_cost_s`): the destination's
pending prefill, plus recomputing the run's context there at the uncached prefill rate, paid
once by the step and once by every sequence decoding there meanwhile. A moved run's affinity
follows it (the proxy records where each step ran). See docs/run_scheduling.md. With a
prefix-cache lookup (router/prefix), a step whose home is full may also go at once to an
instance whose index holds much more of its prompt (`richer_than_home`), and a request
without a home is scored by its cached prefix (`score_cached_prefix`).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

from pools.allocation import Allocation
from pools.config import Config
from pools.fleet import Fleet, InstanceState
from router.admission.decision import CachedPrefix
from router.frozen import fast_init
from router.prefix.score import cached_prefix_scores
from router.runtable import RunTable

__all__ = [
    "ALWAYS_AFFINITY_PATIENCE_FRAC",
    "CACHED_PREFIX_WEIGHT",
    "MUCH_MORE_CACHED_FRAC",
    "PLACEMENTS",
    "Candidate",
    "PickRequest",
    "Picker",
    "RunAffinity",
    "default_picker",
    "expected_home_wait_s",
    "filter_affinity_or_move",
    "move_cost_s",
    "move_is_faster",
    "placement_patience_s",
    "richer_than_home",
    "score_cached_prefix",
    "score_kv_headroom",
    "score_load",
    "score_run_affinity",
    "uncached_prefill_tokens_per_s",
]

log = logging.getLogger(__name__)

# a measured prefix-cache hit rate above this still leaves the uncached rate finite
_MAX_HIT_FRAC = 0.9


@fast_init
@dataclass(frozen=True, slots=True)
class PickRequest:
    pool: str
    run_key: Hashable | None  # the run, (tenant, run id) on the request path; None: no run
    exclude: frozenset[str] = frozenset()  # instances already tried for this request
    allowed: frozenset[str] | None = None  # admission's grant: where the sequence fits (None: any)
    waited_s: float = 0.0  # how long the request has waited in the queue so far
    home_wait_s: float | None = None  # expected wait for a slot on the run's home (None: unknown)
    now_s: float | None = None  # for the destinations' pending prefill (None: count none)
    # slots free now for the pool on each instance (None: unknown, no spare-room check)
    free_slots: Mapping[str, int] | None = None
    # queued steps waiting for each instance as their run's home (this request not counted;
    # None: none)
    awaited: Mapping[str, int] | None = None
    # the prompt's cached prefix per instance (router/prefix; None: no lookup) and each
    # candidate's fill in [0, 1] (`decision.fill_frac`), for `score_cached_prefix`
    prefix: CachedPrefix | None = None
    fill_frac: Mapping[str, float] | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class Candidate:
    state: InstanceState
    frac: float  # the pool's allocation of this instance, (0, 1]

    @property
    def instance_id(self) -> str:
        return self.state.spec.instance_id


Filter = Callable[[PickRequest, list[Candidate]], list[Candidate]]
# one score per candidate, in order; None: no opinion on this request (skipped, costs nothing)
Scorer = Callable[[PickRequest, Sequence[Candidate]], Sequence[float] | None]


class RunAffinity:
    """Where each run's last step went and how long its context was then, so later steps find
    their prefix cache and admission knows how much of it may be cached. Kept in the run's
    record of the router's one `RunTable` (router.runtable: one cap and eviction for everything
    kept per run), or in its own of `max_runs` without one. Keyed by the run's key: on the
    request path (tenant, run id), so two tenants that use the same run id have separate
    homes."""

    def __init__(self, max_runs: int = 100_000, runs: RunTable | None = None) -> None:
        self.runs = runs if runs is not None else RunTable(max_runs)

    def get(self, run_key: Hashable | None) -> str | None:
        record = self.runs.get(run_key) if run_key is not None else None
        return record.home if record is not None else None

    def context_tokens(self, run_key: Hashable | None) -> int:
        """Prompt + completion tokens of the run's last finished step (0 when unknown)."""
        record = self.runs.get(run_key) if run_key is not None else None
        return record.context_tokens if record is not None and record.home is not None else 0

    def record(
        self,
        run_key: Hashable | None,
        instance_id: str,
        context_tokens: int = 0,
        step: int | None = None,
    ) -> None:
        """The run's step (number `step` from a shared store; None: not numbered there) was
        answered by `instance_id`."""
        if run_key is None:
            return
        record = self.runs.touch(run_key)
        record.home, record.context_tokens = instance_id, context_tokens
        record.home_step = step

    def adopt(self, run_key: Hashable, home: str, step: int, context_tokens: int) -> None:
        """A shared store's home for the run (router.governance.shared: `home` answered its
        step number `step`, the latest answered on any replica): kept when that step is later
        than the one that set this replica's home (or this replica's has no number), so a
        run's steps follow it from replica to replica."""
        record = self.runs.touch(run_key)
        if record.home is None or record.home_step is None or record.home_step < step:
            record.home, record.context_tokens, record.home_step = home, context_tokens, step


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


def uncached_prefill_tokens_per_s(
    measured_tokens_per_s: float | None, prefix_hit_frac: float | None
) -> float | None:
    """How fast an instance computes prompt tokens it has not cached, in tokens/s (None: not
    measured). vLLM's prefill time covers every prompt token, cached or not, so the measured
    rate (prompt tokens / prefill time) overstates it by 1 / (1 - hit rate): at a 75 % hit
    rate, 4x. The hit rate is capped at 0.9."""
    if not measured_tokens_per_s:
        return None
    hit = min(max(prefix_hit_frac or 0.0, 0.0), _MAX_HIT_FRAC)
    return measured_tokens_per_s * (1.0 - hit)


def expected_home_wait_s(*, running: int, waiting_ahead: int, step_s: float) -> float:
    """Expected wait for a slot on a full instance, in seconds. `running` sequences there each
    take `step_s` in all; with their ends spread evenly (memoryless), one ends every
    `step_s / running`, and a step with `waiting_ahead` others waiting for the same instance
    gets the (waiting_ahead + 1)-th: `(waiting_ahead + 1) * step_s / running`."""
    return (max(0, waiting_ahead) + 1) * step_s / max(1, running)


def move_cost_s(
    *,
    context_tokens: int,
    prefill_tokens_per_s: float,
    dest_running: int,
    dest_pending_prefill_tokens: int = 0,
) -> float:
    """What moving a run's step to another instance costs, in seconds of waiting summed over
    everyone it delays: the destination's prefill already pending (the step waits for it),
    then recomputing the run's context there (`context_tokens / prefill_tokens_per_s`, at the
    uncached rate), which the step pays and so does each of the `dest_running` sequences
    decoding there, whose steps stall behind it."""
    prefill_s = context_tokens / prefill_tokens_per_s
    return dest_pending_prefill_tokens / prefill_tokens_per_s + prefill_s * (1 + dest_running)


def move_is_faster(
    *,
    context_tokens: int,
    prefill_tokens_per_s: float | None,
    home_wait_s: float | None,
    waited_s: float,
    dest_running: int = 0,
    dest_pending_prefill_tokens: int = 0,
    dest_free_slots: int | None = None,
    dest_awaited: int = 0,
) -> bool:
    """Whether a run's step should leave its home instance (full now) for one destination.

    - Nothing cached at home (`context_tokens` 0): a move costs nothing, so move.
    - No uncached prefill rate measured at the destination: nothing to weigh; keep the cache
      (wait for home).
    - The destination must have spare room: more free slots (`dest_free_slots`) than this
      step plus the steps already waiting for it as their home (`dest_awaited`). Otherwise
      the move takes the slot another run's next step needs there, and that run waits or
      moves in turn.
    - Then move when the expected wait at home exceeds `move_cost_s`, or when the step has
      already waited that long (ski rental: waiting then never costs more than twice the
      better choice, whatever the estimate's error).
    """
    if context_tokens <= 0:
        return True
    if not prefill_tokens_per_s:
        return False
    if dest_free_slots is not None and dest_free_slots <= 1 + dest_awaited:
        return False
    cost_s = move_cost_s(
        context_tokens=context_tokens,
        prefill_tokens_per_s=prefill_tokens_per_s,
        dest_running=dest_running,
        dest_pending_prefill_tokens=dest_pending_prefill_tokens,
    )
    return waited_s >= cost_s or (home_wait_s is not None and home_wait_s > cost_s)


def richer_than_home(req: PickRequest, home: str, cands: Sequence[Candidate]) -> list[Candidate]:
    """For a run's step whose home is full (not in admission's grant): the granted candidates
    whose prefix-cache index holds much more of its prompt than home's does (at least
    `MUCH_MORE_CACHED_FRAC` of the prompt's tokens more) and that have spare room (a free slot
    beyond this step and the steps queued for them as their home, as `move_is_faster`
    asks). Empty without a lookup, without a usable index at home (unknown is not "less"), or
    while home has room."""
    prefix = req.prefix
    if prefix is None or req.allowed is None or home in req.allowed or home not in prefix.tokens:
        return []
    more = max(1.0, MUCH_MORE_CACHED_FRAC * prefix.prompt_tokens)
    at_home = prefix.tokens[home]
    out = []
    for c in cands:
        iid = c.instance_id
        if iid not in req.allowed or prefix.tokens.get(iid, 0) - at_home < more:
            continue
        free = None if req.free_slots is None else req.free_slots.get(iid)
        if free is not None and free <= 1 + (req.awaited or {}).get(iid, 0):
            continue
        out.append(c)
    return out


def filter_affinity_or_move(affinity: RunAffinity) -> Filter:
    """Before `filter_granted`: keep the candidates, unless the run's home instance is among
    them (healthy, in the pool) but admission granted it no room now: then only the granted
    others a move to is worth it (`move_is_faster`, with each one's uncached prefill rate,
    running sequences, pending prefill and free slots), and those whose prefix-cache index
    holds much more of its prompt with spare room (`richer_than_home`); none, so the step
    waits, when no move is."""

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
        context_tokens = affinity.context_tokens(req.run_key)
        moves = []
        for c in cands:
            if c.instance_id not in req.allowed:
                continue
            state = c.state
            pending = 0 if req.now_s is None else state.pending_prefill_tokens(req.now_s)
            free = None if req.free_slots is None else req.free_slots.get(c.instance_id)
            if move_is_faster(
                context_tokens=context_tokens,
                prefill_tokens_per_s=uncached_prefill_tokens_per_s(
                    state.prefill_tokens_per_s, state.prefix_hit_frac
                ),
                home_wait_s=req.home_wait_s,
                waited_s=req.waited_s,
                dest_running=state.inflight,
                dest_pending_prefill_tokens=pending,
                dest_free_slots=free,
                dest_awaited=(req.awaited or {}).get(c.instance_id, 0),
            ):
                moves.append(c)
        moved = {c.instance_id for c in moves}
        moves += [c for c in richer_than_home(req, home, cands) if c.instance_id not in moved]
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "home %s full: %s (home wait %s s, waited %.2f s, context %d tokens)",
                home,
                "moves to one of " + ",".join(c.instance_id for c in moves) if moves else "waits",
                "unknown" if req.home_wait_s is None else f"{req.home_wait_s:.2f}",
                req.waited_s,
                context_tokens,
                extra={
                    "placement_decision": {
                        "run": req.run_key,
                        "moves": bool(moves),
                        "home_wait_s": req.home_wait_s,
                        "waited_s": req.waited_s,
                        "context_tokens": context_tokens,
                    }
                },
            )
        return moves

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


def score_cached_prefix(affinity: RunAffinity) -> Scorer:
    """For a request without a home (no run, or its first step): the share of the prompt
    cached on each candidate, cooled as it fills (`router.prefix.score`: 1 up to 80 % fill,
    0 when full), in [0, 1]. No opinion (None) without a lookup (no instance publishes KV
    events, or the prompt cannot be hashed) and for a run's later steps, which run affinity
    keeps on their home as before."""

    def score(req: PickRequest, cands: Sequence[Candidate]) -> list[float] | None:
        prefix = req.prefix
        if prefix is None or affinity.get(req.run_key) is not None:
            return None
        return cached_prefix_scores(
            [c.instance_id for c in cands],
            prefix.tokens,
            prefix.prompt_tokens,
            req.fill_frac or {},
        )

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

    def candidates(
        self, allocation: Allocation, pool: str, instance_ids: Sequence[str] | None = None
    ) -> list[Candidate]:
        """The pool's instances in the fleet with their fracs; `instance_ids`: the
        allocation's `instances_for(pool)` when the caller has it already."""
        out = []
        if instance_ids is None:
            instance_ids = allocation.instances_for(pool)
        for instance_id in instance_ids:
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
            scores = scorer(req, cands)
            if scores is None:
                continue
            for i, s in enumerate(scores):
                totals[i] += weight * min(1.0, max(0.0, s))
        best = max(totals)
        tied = [c for c, t in zip(cands, totals, strict=True) if best - t <= 1e-9]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)


PLACEMENTS = ("affinity_or_move", "always_affinity", "least_loaded")
# the cached-prefix score's weight: a request whose whole prompt is cached on a busy instance
# (load and headroom scores near 0) still goes there over an idle one (headroom + load = 2),
# until that instance passes 80 % fill and the cooling takes the pull away
CACHED_PREFIX_WEIGHT = 2.0
# a run's step leaves its full home for an instance whose index holds at least this share of
# its prompt more than home's (`richer_than_home`)
MUCH_MORE_CACHED_FRAC = 0.5
# `always_affinity` waits for a full home this fraction of the queue's `max_wait_s`, then
# takes any instance with room (`filter_always_affinity`)
ALWAYS_AFFINITY_PATIENCE_FRAC = 0.5


def placement_patience_s(config: Config) -> dict[str, float]:
    """Each pool's `always_affinity` patience: `ALWAYS_AFFINITY_PATIENCE_FRAC` of its queue's
    `max_wait_s`."""
    return {p.name: ALWAYS_AFFINITY_PATIENCE_FRAC * p.queue.max_wait_s for p in config.pools}


def default_picker(
    fleet: Fleet,
    affinity: RunAffinity,
    rng: random.Random,
    placement: str | Mapping[str, str] = "always_affinity",
    patience_s: Mapping[str, float] | None = None,
) -> Picker:
    """Healthy, granted and untried instances of the pool; scored by run affinity (weight 2), the
    cached prefix of a request without a home (2: `score_cached_prefix`), KV headroom (1) and
    load (1).

    `placement`, one rule for every pool or one per pool (`pools.<pool>.placement`; a pool not
    named gets `always_affinity`, the config's default): `always_affinity` waits for a full
    home instance (while it is healthy) until the step has waited the pool's `patience_s`
    (none given: for ever), then takes any instance with room; `affinity_or_move` leaves it
    only for an instance with spare room and when the wait costs more than the move
    (`move_is_faster`); `least_loaded` ignores affinity (no filter, no affinity score, no
    cached-prefix score).
    """
    default = placement if isinstance(placement, str) else "always_affinity"
    by_pool = {} if isinstance(placement, str) else dict(placement)
    for rule in (default, *by_pool.values()):
        if rule not in PLACEMENTS:
            raise ValueError(f"unknown placement {rule!r}")
    filters: dict[str, Filter] = {
        "affinity_or_move": filter_affinity_or_move(affinity),
        "always_affinity": filter_always_affinity(affinity, patience_s or {}),
    }
    run_affinity = score_run_affinity(affinity)
    cached_prefix = score_cached_prefix(affinity)

    def placed(req: PickRequest, cands: list[Candidate]) -> list[Candidate]:
        rule = filters.get(by_pool.get(req.pool, default))
        return cands if rule is None else rule(req, cands)

    def affinity_score(req: PickRequest, cands: Sequence[Candidate]) -> Sequence[float] | None:
        if by_pool.get(req.pool, default) == "least_loaded":
            return [0.0] * len(cands)
        return run_affinity(req, cands)

    def prefix_score(req: PickRequest, cands: Sequence[Candidate]) -> Sequence[float] | None:
        if by_pool.get(req.pool, default) == "least_loaded":
            return None
        return cached_prefix(req, cands)

    return Picker(
        fleet,
        filters=[filter_healthy, placed, filter_granted, filter_not_tried],
        scorers=[
            (2.0, affinity_score),
            (CACHED_PREFIX_WEIGHT, prefix_score),
            (1.0, score_kv_headroom(fleet)),
            (1.0, score_load),
        ],
        rng=rng,
    )


def filter_always_affinity(affinity: RunAffinity, patience_s: Mapping[str, float]) -> Filter:
    """Before `filter_granted`: only the run's home instance while it is healthy, in the pool
    and untried, until the step has waited its pool's `patience_s` (a pool not named: for
    ever); after that any candidate, so a step whose home stays full is served elsewhere
    rather than refused at its queue's `max_wait_s` while other instances idle. A step whose
    home is full goes at once to the instances whose prefix-cache index holds much more of its
    prompt (`richer_than_home`), when there are any."""

    def keep(req: PickRequest, cands: list[Candidate]) -> list[Candidate]:
        home = affinity.get(req.run_key)
        if home is None or home in req.exclude:
            return cands
        if req.waited_s >= patience_s.get(req.pool, math.inf):
            return cands
        richer = richer_than_home(req, home, cands)
        if richer:  # home is full and they hold much more of the prompt: go now
            return richer
        return [c for c in cands if c.instance_id == home] or cands

    return keep
