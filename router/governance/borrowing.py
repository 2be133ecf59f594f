"""Borrowing between tenants' token budgets (pure decision).

A tenant whose budget sits idle lends part of it. A borrower (a tenant with `borrow_max_frac`)
whose own bucket cannot hold a request may take the shortfall from one idle lender, as long as:

- the borrower's allowance holds it: an allowance bucket of `borrow_max_frac` x its own
  `tokens_per_minute` a minute, so it never borrows more than that fraction of its base quota;
- the lender is idle (no request in flight, none waiting for its bucket) and keeps at least
  `LENDER_RESERVE_FRAC` of its bucket after the loan: when the owner comes back its first
  requests find their tokens at once, and from then on it is not idle, so nobody borrows from
  it while it works (the owner reclaims first).

`pick_lender` chooses the idle lender with the most to lend; the shell moves the tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["LENDER_RESERVE_FRAC", "LenderView", "lendable", "pick_lender"]

LENDER_RESERVE_FRAC = 0.5  # of its bucket a lender always keeps for itself


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
