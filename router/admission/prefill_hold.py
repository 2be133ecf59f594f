"""The prefill hold, pure (no clock, no I/O: every call takes `now_s`): on a split instance,
while a request of a latency-sensitive pool is in its prefill there, a new long prefill of
another pool is not dispatched there, so the two do not share engine steps
(docs/admission.md, section 8; `admission.prefill_hold_*`).

- **Who holds.** A lease of a pool with a stricter `slo.ttft_p95_ms` than the waiting
  request's, admitted on the instance and without a first token yet, holds from its admission
  until its first token or, failing that (a non-streaming request shows none), for its pool's
  TTFT target (past it, the target is missed anyway): `holding_target_s`.
- **Which prefills wait.** Those with at least `hold_min_tokens` tokens to prefill there (the
  uncached part of the prompt). Fixed (`admission.prefill_hold_min_tokens: N`) or derived
  (`auto`): the tokens the instance prefills, at its measured rate, in `budget_frac` of the
  strictest holder's TTFT target, i.e. the most one step-sharing prefill may add to that
  pool's time to first token. No hold while the rate is unmeasured.
- **Bounded wait.** A request is held for at most `max_wait_s` in all (from the first
  dispatch pass that held it); after that the hold does not apply to it (`hold_applies`).
  With chat arriving often, long agent prefills would otherwise wait for gaps that may not
  come.
- **One long prefill at a time** (`serial`, `admission.prefill_hold_serial`). The engine
  schedules running requests first and a slice (`admission.prefill_slice_tokens`) caps each
  request's prefill per step, not the step: k long prefills running together put k slices
  ahead of a chat prompt in every step. So on an instance where a pool with a stricter TTFT
  target is allocated, a request with at least the hold's threshold of tokens to prefill also
  waits while a lease of a pool that is not stricter than its own, with at least that many
  tokens to prefill, is in its prefill there: a streaming one until its first token (at most
  its pool's TTFT target from its admission, past which that target is missed anyway), one
  that will show none (not streamed) until its predicted prefill end (its tokens at the
  measured rate: `Lease.prefill_done_at_s`, the same bound the TTFT check counts pending
  prefill by): `serial_hold_ends`. The prediction is no bound for a streaming one: it counts
  the measured rate of prefill alone, while a sliced prefill beside decodes and chat prompts
  takes several of the engine's steps, each longer than its slice alone, so a second long
  prefill started at the predicted end would often run beside the first. The threshold is
  the hold's, for the strictest such pool's target.

Limits: a hold only stops new long prefills from starting; one already running when the
latency-sensitive request arrives goes on and shares its steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "PrefillHold",
    "hold_applies",
    "hold_min_tokens",
    "holding_target_s",
    "serial_bound_s",
    "serial_hold_ends",
]


@dataclass(frozen=True, slots=True)
class PrefillHold:
    """`admission.prefill_hold_*`: a fixed threshold (`min_tokens`) or, when it is None, the
    threshold derived from `budget_frac` of the holder's TTFT target at the measured prefill
    rate; a request is held at most `max_wait_s`; `serial`: also while another long prefill
    of a pool no stricter than its own is in its prefill (`serial_hold_ends`)."""

    min_tokens: int | None
    budget_frac: float
    max_wait_s: float
    serial: bool = False

    def __post_init__(self) -> None:
        if self.min_tokens is not None and self.min_tokens < 1:
            raise ValueError("min_tokens must be >= 1")
        if not 0 < self.budget_frac <= 1 or self.max_wait_s <= 0:
            raise ValueError("budget_frac must be in (0, 1] and max_wait_s > 0")


def holding_target_s(
    in_prefill: Iterable[tuple[float, float]], own_target_s: float, now_s: float
) -> tuple[float, float] | None:
    """`in_prefill`: (admitted at, TTFT target) of the instance's leases with no first token.
    Those with a stricter target than `own_target_s` and still within it hold; returns the
    strictest holder's target and when the last hold ends (None: nothing holds)."""
    strictest, ends = math.inf, -math.inf
    for acquired_at_s, target_s in in_prefill:
        if target_s < own_target_s and now_s < acquired_at_s + target_s:
            strictest = min(strictest, target_s)
            ends = max(ends, acquired_at_s + target_s)
    return None if strictest == math.inf else (strictest, ends)


def serial_hold_ends(
    in_prefill: Iterable[tuple[int, float, float, float, bool]],
    own_target_s: float,
    min_tokens: int,
    now_s: float,
) -> float | None:
    """`in_prefill`: (tokens to prefill, TTFT target, admitted at, predicted prefill end,
    streams) of the instance's leases with no first token. Those of a pool no stricter than
    `own_target_s` with at least `min_tokens` to prefill hold (`serial`) until their
    `serial_bound_s`; returns when the last of them ends (None: nothing holds; a first token
    ends a streaming lease's hold before its bound, by leaving `in_prefill`)."""
    ends = -math.inf
    for tokens, target_s, acquired_at_s, prefill_done_at_s, streams in in_prefill:
        bound_s = serial_bound_s(acquired_at_s, prefill_done_at_s, target_s, streams)
        if target_s >= own_target_s and tokens >= min_tokens and now_s < bound_s:
            ends = max(ends, bound_s)
    return None if ends == -math.inf else ends


def serial_bound_s(
    acquired_at_s: float, prefill_done_at_s: float, target_s: float, streams: bool
) -> float:
    """When a long prefill in flight stops holding others (`serial`) at the latest: a
    streaming lease at its pool's TTFT target from its admission (its first token comes
    first, unless the target is missed), never before its predicted prefill end; one that
    shows no first token at its predicted prefill end."""
    if not streams:
        return prefill_done_at_s
    return max(prefill_done_at_s, acquired_at_s + target_s)


def hold_min_tokens(
    hold: PrefillHold, holder_target_s: float, prefill_tokens_per_s: float | None
) -> int | None:
    """The fewest tokens to prefill that a hold keeps waiting: the fixed threshold, or the
    tokens prefilled in `budget_frac` of the holder's target at the measured rate (None while
    the rate is unmeasured: no hold)."""
    if hold.min_tokens is not None:
        return hold.min_tokens
    if not prefill_tokens_per_s or prefill_tokens_per_s <= 0:
        return None
    return max(1, math.ceil(hold.budget_frac * holder_target_s * prefill_tokens_per_s - 1e-9))


def hold_applies(hold: PrefillHold, held_since_s: float | None, now_s: float) -> bool:
    """Whether a hold may (still) keep a request waiting: not once it has been held for
    `max_wait_s` (`held_since_s`: the first pass that held it; None: never held)."""
    return held_since_s is None or now_s - held_since_s < hold.max_wait_s
