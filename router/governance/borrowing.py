"""Borrowing between tenants' token budgets (pure decision).

A tenant whose budget sits idle lends part of it. A borrower (a tenant with `borrow_max_frac`)
whose own bucket cannot hold a request may take the shortfall from one idle lender, as long as:

- the borrower's allowance holds it: an allowance bucket of `borrow_max_frac` x its own
  `tokens_per_minute` a minute, so it never borrows more than that fraction of its base quota;
- the lender is idle (no request in flight, none waiting for its bucket) and keeps at least
  `LENDER_RESERVE_FRAC` of its bucket after the loan: when the owner comes back its first
  requests find their tokens at once, and from then on it is not idle, so nobody borrows from
  it while it works (the owner reclaims first).

`pick_lender` chooses the idle lender with the most to lend (ties: the first given); the
shell moves the tokens.

With a shared store (router replicas, docs/replicas.md "Borrowing across replicas") the same
rules hold over the shared buckets, in one statement (router/governance/shared.py,
`gpupool_borrow`): `split` says what a request takes from the replica's lease, from its own
shared bucket and (the shortfall) from a lender, and a lender is idle when no replica has
reported it active for `idle_after_s` (`idle`): each replica marks a tenant active with its
lease top-ups and, while it has a request of it in flight or waiting, every governance sweep.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "IDLE_AFTER_SWEEPS",
    "LENDER_RESERVE_FRAC",
    "LenderView",
    "Split",
    "Terms",
    "idle",
    "lendable",
    "pick_lender",
    "split",
]

LENDER_RESERVE_FRAC = 0.5  # of its bucket a lender always keeps for itself
# with a shared store: a tenant no replica marked active for this many governance sweeps is
# idle (one sweep is the longest a replica's demand goes unmarked; the rest covers a sweep's
# statements and the replicas' clocks differing)
IDLE_AFTER_SWEEPS = 3


@dataclass(frozen=True, slots=True)
class LenderView:
    name: str
    level: float  # tokens in its bucket now
    capacity: float
    idle: bool  # no request in flight or waiting


def lendable(view: LenderView, reserve_frac: float = LENDER_RESERVE_FRAC) -> float:
    """Tokens `view` may lend now (0.0 unless idle)."""
    if not view.idle:
        return 0.0
    return max(0.0, view.level - reserve_frac * view.capacity)


def pick_lender(
    short_tokens: float, lenders: Iterable[LenderView], reserve_frac: float = LENDER_RESERVE_FRAC
) -> str | None:
    """The idle lender with the most to lend, if it can lend `short_tokens`; else None."""
    best: tuple[float, str] | None = None
    for view in lenders:
        amount = lendable(view, reserve_frac)
        if amount >= short_tokens and (best is None or amount > best[0]):
            best = (amount, view.name)
    return None if best is None else best[1]


def idle(active_at_s: float | None, now_s: float, idle_after_s: float) -> bool:
    """A tenant last marked active at `active_at_s` (None: never) is idle at `now_s` when
    that is more than `idle_after_s` ago (shared store: the replicas' marks)."""
    return active_at_s is None or active_at_s < now_s - idle_after_s


@dataclass(frozen=True, slots=True)
class Terms:
    """A borrow's terms with a shared store: the borrower's own bucket (`capacity`,
    `rate_per_s`) and its allowance's, the tenants that may lend (`lenders`: name, capacity,
    rate_per_s; the borrower itself is passed over), how long after its last mark a lender is
    idle (`idle_after_s`) and the share of its bucket it keeps (`reserve_frac`)."""

    capacity: float
    rate_per_s: float
    allowance_capacity: float
    allowance_rate_per_s: float
    lenders: tuple[tuple[str, float, float], ...]
    idle_after_s: float
    reserve_frac: float = LENDER_RESERVE_FRAC


@dataclass(frozen=True, slots=True)
class Split:
    """Where a borrowing request's `need` comes from: `from_lease` (the replica's lease on its
    own shared bucket), `own` (its own shared bucket, all it holds) and `short` (a lender's
    bucket and the borrower's allowance). The three sum to the need; a lease or bucket in debt
    gives a negative part (the loan pays the debt off)."""

    from_lease: float
    own: float
    short: float


def split(
    need: float, lease: float, own_level: float, allowance_level: float, allowance_capacity: float
) -> Split | None:
    """Take `need` from the lease first, then the own bucket, each down to 0, the rest
    borrowed: None when nothing is short (the own budget holds it: no loan) or the allowance
    cannot hold the shortfall now. A debt (a negative lease or level) is paid off by the loan,
    as one router's loan pays its bucket's (its level after a loan is 0): `from_lease` or
    `own` is then negative and `short` is `need` plus the debt."""
    from_lease = min(lease, need)
    own = min(own_level, need - from_lease)
    short = need - from_lease - own
    if short <= 0.0 or short > allowance_level or short > allowance_capacity:
        return None
    return Split(from_lease, own, short)
