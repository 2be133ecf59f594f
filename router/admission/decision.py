"""The admission decision, pure: may this sequence go to which instances of its pool now?

`decide(views, need, now_s)` returns a `Grant` (the instances it fits on, for the picker to
choose among), a `Wait` (nothing fits now but something can free up) or a `Reject` (it cannot
be served in time). No clock, no I/O, no state: the shell (`router.admission.admitter`) builds the
views from the fleet and holds the queue and the leases.

On instance `i`, a sequence of pool `p` fits when all of these hold (docs/admission.md,
sections 2 and 3):

- **fresh and healthy**: stale telemetry counts as full;
- (an engine that does not report its KV capacity, `kv_known` False, skips both KV checks:
  the operating point, which the shell caps at `router.unknown_kv_max_concurrency`, decides);
- **KV, the pool's part**: the blocks `p` has reserved on `i` plus the new ones stay within
  `a[i][p]` × the instance's blocks × (1 − margin);
- **KV, the instance**: blocks in use (the larger of the router's reservations and the measured
  use corrected since the scrape; see `pools.fleet`) plus the new ones stay within the blocks ×
  (1 − margin);
- **operating point**: all sequences on `i` stay under the limit for the strictest TPOT target
  among the pools on `i` (a batch that grows past it slows every sequence on the engine, not
  only `p`'s), and `p`'s under `a[i][p]` × the smaller of that and its own target's limit, so
  on a split instance each pool keeps its share of the batch;
- **TTFT**: the predicted prefill wait (the prompt tokens still in prefill there plus this
  prompt's uncached part, at the measured prefill rate) fits the pool's TTFT target.

KV blocks are counted for the whole sequence even where its prefix is cached: vLLM takes a
prefix-cache hit's blocks out of its free queue (`BlockPool.touch`), and its usage is
`1 - free / total`, so a cached prefix occupies blocks exactly like a computed one. What a
cache hit saves is prefill time, and that is where it counts here.

With `admission.reserve: forecast` (`reserve_forecast`), a pool past its share of the KV or
the batch may still go where the instance has room once what is kept for the other pools
there (`others_reserve_blocks`, `others_reserve_slots`: their forecast need, computed by the
shell from `router.admission.forecast`) is set aside: it borrows their idle share, and its new
admissions stop first when their forecast rises. Nothing running is ever preempted.

With `admission.prefill_hold_min_tokens` (`hold_prefill_min_tokens`, set by the shell while a
pool with a stricter TTFT target has a request in its prefill on the instance), a sequence
with that many tokens or more to prefill there waits ("prefill"), so the latency-sensitive
request's prefill does not share engine steps with a long one.

So that a large request never waits forever, a pool with nothing running on an instance may
always place one sequence there if the instance as a whole has the blocks (a request over the
pool's share but within the engine's `max_model_len` is served, alone).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from router.frozen import fast_init

__all__ = [
    "CachedPrefix",
    "Grant",
    "InstanceView",
    "Need",
    "Reject",
    "Wait",
    "decide",
    "fill_frac",
    "fit_reason",
    "predicted_ttft_s",
]


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """What the engines' prefix-cache indexes (router/prefix) hold of one prompt: its exact
    token count and, per instance whose index is usable, the leading prompt tokens cached
    there (whole blocks: blocks × block size). An instance not in `tokens` has no usable
    index: unknown, not "nothing cached"."""

    prompt_tokens: int
    tokens: Mapping[str, int]
    # the instances whose index is exact (no batch lost since it started over): there the
    # cached count is what the engine holds, not a lower bound
    exact: frozenset[str] = frozenset()


@fast_init
@dataclass(frozen=True, slots=True)
class Need:
    """What one sequence asks for."""

    prompt_tokens: int
    total_tokens: int  # prompt + expected output
    deadline_s: float  # absolute
    cached_on: str | None = None  # the instance holding the run's prefix, if any
    cached_tokens: int = 0  # prompt tokens expected to be found in its prefix cache there
    # the prompt's cached prefix per instance by the KV-event indexes (None: no lookup)
    prefix: CachedPrefix | None = None

    def prefill_tokens(self, instance_id: str) -> int:
        """Prompt tokens the instance must compute (a cached prefix is not recomputed; it
        still occupies KV blocks, so it is not subtracted from the blocks): by the instance's
        prefix-cache index where it is exact (the prompt's tokens less those cached there),
        else the run's home's expected hit (`cached_tokens`), else all of them."""
        prefix = self.prefix
        if prefix is not None and instance_id in prefix.exact:
            return max(0, prefix.prompt_tokens - prefix.tokens.get(instance_id, 0))
        if instance_id == self.cached_on:
            return max(0, self.prompt_tokens - self.cached_tokens)
        return self.prompt_tokens


@fast_init
@dataclass(frozen=True, slots=True)
class InstanceView:
    """One instance as admission sees it for one pool, at one moment."""

    instance_id: str
    frac: float  # the pool's allocation of the instance, (0, 1]
    healthy: bool
    fresh: bool  # telemetry younger than stale_after_s
    capacity_blocks: int  # the engine's num_gpu_blocks (0 when unknown or not reported yet)
    block_size: int  # tokens per block
    used_blocks: float  # instance-wide, see pools.fleet
    pool_reserved_blocks: int
    pool_running: int
    running: int  # the router's sequences on the instance, every pool
    pool_limit: int  # operating point for the pool's TPOT target
    instance_limit: int  # operating point for the strictest target among the instance's pools
    pending_prefill_tokens: int
    prefill_tokens_per_s: float | None  # None: not measured yet (no TTFT check)
    ttft_target_s: float
    margin_frac: float
    # one engine step at the instance's batch if the sequence joined it (the step that yields
    # the first token after prefill), from the measured TPOT line; 0 when unmeasured
    step_s: float = 0.0
    # False: the engine's readings lack its KV capacity (no vllm:cache_config_info); the KV
    # checks are skipped and the operating-point limits (capped by the shell) decide alone
    kv_known: bool = True
    # admission.reserve: forecast: past its own share the pool may use the instance's free
    # blocks and batch places less what is kept for the other pools there (their forecast
    # need over the horizon, or all of their unused share while they have requests waiting)
    reserve_forecast: bool = False
    others_reserve_blocks: float = 0.0
    others_reserve_slots: int = 0
    # a pool with a stricter TTFT target has a request in its prefill on the instance: a
    # sequence with at least this many tokens to prefill here waits (None: no hold)
    hold_prefill_min_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Grant:
    instance_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Wait:
    reason: str  # why the best instance refused: kv | operating_point | ttft | prefill | stale


@dataclass(frozen=True, slots=True)
class Reject:
    code: str  # no_instance | deadline_unmeetable
    message: str


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // max(1, block_size))


def fill_frac(view: InstanceView) -> float:
    """How full the instance is for the pool, in [0, 1]: the largest of its KV use (when
    known), its batch over the operating-point limit, and the pool's batch over its part of
    that limit; 1 when stale or unhealthy (stale telemetry counts as full)."""
    if not (view.healthy and view.fresh):
        return 1.0
    kv = view.used_blocks / view.capacity_blocks if view.kv_known and view.capacity_blocks else 0.0
    batch = view.running / view.instance_limit if view.instance_limit > 0 else 1.0
    pool_limit = view.frac * min(view.pool_limit, view.instance_limit)
    pool = view.pool_running / pool_limit if pool_limit > 0 else 1.0
    return min(1.0, max(0.0, kv, batch, pool))


def fit_reason(view: InstanceView, need: Need) -> str | None:
    """None when the sequence fits on the instance now, else why not."""
    if not view.healthy:
        return "unhealthy"
    if not view.fresh or (view.kv_known and view.capacity_blocks <= 0):
        return "stale"
    hold = view.hold_prefill_min_tokens
    if hold is not None and need.prefill_tokens(view.instance_id) >= hold:
        return "prefill"
    blocks = _blocks(need.total_tokens, view.block_size)
    usable = view.capacity_blocks * (1.0 - view.margin_frac)
    if view.kv_known and view.used_blocks + blocks > usable:
        return "kv"
    alone = view.pool_running == 0
    if not alone:
        if view.kv_known and view.pool_reserved_blocks + blocks > view.frac * usable:
            # past its share: only what the other pools are not forecast to need
            lent = usable - view.others_reserve_blocks
            if not view.reserve_forecast or view.used_blocks + blocks > lent:
                return "kv"
        limit = min(view.pool_limit, view.instance_limit)
        if view.pool_running >= max(1, int(view.frac * limit)):
            lent_slots = view.instance_limit - view.others_reserve_slots
            if not view.reserve_forecast or view.running + 1 > lent_slots:
                return "operating_point"
    if view.running >= view.instance_limit:
        return "operating_point"
    if not alone and predicted_ttft_s(view, need) > view.ttft_target_s:
        return "ttft"
    return None


def predicted_ttft_s(view: InstanceView, need: Need) -> float:
    """Time to first token on the instance if the sequence went there now: the prefill wait
    (pending and its own prompt, at the measured rate) plus one engine step. Each part is 0
    while unmeasured."""
    rate = view.prefill_tokens_per_s
    prefill_s = (
        (view.pending_prefill_tokens + need.prefill_tokens(view.instance_id)) / rate
        if rate
        else 0.0
    )
    return prefill_s + view.step_s


def decide(
    views: Sequence[InstanceView], need: Need, now_s: float, *, queue_wait_s: float = 0.0
) -> Grant | Wait | Reject:
    """Grant the instances the sequence fits on; else wait, unless no instance is usable or
    the deadline cannot be met even after the expected queue wait."""
    usable = [v for v in views if v.healthy]
    if not usable:
        return Reject("no_instance", "no healthy instance in the pool")
    fits: list[str] = []
    reasons: list[str] = []
    for view in usable:
        reason = fit_reason(view, need)
        if reason is None:
            fits.append(view.instance_id)
        else:
            reasons.append(reason)
    best_ttft_s = min(predicted_ttft_s(v, need) for v in usable)
    if fits:
        if now_s + best_ttft_s > need.deadline_s:
            return Reject(
                "deadline_unmeetable",
                f"predicted time to first token {best_ttft_s:.2f} s is past the deadline",
            )
        return Grant(tuple(fits))
    if now_s + queue_wait_s + best_ttft_s > need.deadline_s:
        return Reject(
            "deadline_unmeetable",
            f"expected queue wait {queue_wait_s:.2f} s + predicted time to first token "
            f"{best_ttft_s:.2f} s is past the deadline",
        )
    order = ("kv", "operating_point", "ttft", "prefill", "stale", "unhealthy")
    return Wait(min(reasons, key=order.index))
