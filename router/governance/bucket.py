"""Pure budget arithmetic: a token bucket reserved then settled, and a sliding-window sum.

Both know time only through `now_s` arguments (any monotonic clock), so they are tested in
simulated time. Neither does I/O.

`TokenBucket`: holds at most `capacity` units and refills at `rate_per_s` (a per-minute budget
of N is `TokenBucket(N, N / 60)`: a burst of one minute's worth, then N a minute). A request
`reserve`s its estimate when the bucket holds it (`wait_s` says when it will), then `settle`s
to what it really used: the difference goes back (or is taken, when it used more). A
reservation larger than the whole bucket is allowed once the bucket is full (it would never
fit otherwise); the level then goes below 0 and refills from there, so the long-run rate
still holds.

`WindowSum`: the sum of amounts added over the last `window_s`, kept in `buckets` equal
slices (O(buckets) memory, O(1) amortised per add), for per-hour and per-day cost windows.
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["TokenBucket", "WindowSum"]


class TokenBucket:
    """`capacity` units, refilled at `rate_per_s`; starts full. `level` may go below 0 (an
    oversized reservation or a settle above the estimate), never above `capacity`."""

    __slots__ = ("_at_s", "_level", "capacity", "rate_per_s")

    def __init__(self, capacity: float, rate_per_s: float, now_s: float) -> None:
        if capacity <= 0 or rate_per_s <= 0:
            raise ValueError("capacity and rate_per_s must be > 0")
        self.capacity = float(capacity)
        self.rate_per_s = float(rate_per_s)
        self._level = float(capacity)
        self._at_s = now_s

    def level(self, now_s: float) -> float:
        """Units in the bucket at `now_s` (refilled up to `capacity`; may be negative)."""
        if now_s > self._at_s:
            self._level = min(self.capacity, self._level + (now_s - self._at_s) * self.rate_per_s)
            self._at_s = now_s
        return self._level

    def wait_s(self, amount: float, now_s: float) -> float:
        """Seconds until the bucket holds `amount` (an amount over `capacity`: until full);
        0.0 when it does now."""
        need = min(float(amount), self.capacity)
        short = need - self.level(now_s)
        return 0.0 if short <= 1e-9 else short / self.rate_per_s

    def try_reserve(self, amount: float, now_s: float) -> bool:
        """Take `amount` if the bucket holds it now (see `wait_s`). Returns whether it did."""
        if self.wait_s(amount, now_s) > 0.0:
            return False
        self._level -= float(amount)
        return True

    def settle(self, reserved: float, used: float, now_s: float) -> None:
        """A reservation of `reserved` turned out to use `used`: give back (or take) the
        difference."""
        self.level(now_s)
        self._level = min(self.capacity, self._level + float(reserved) - float(used))

    def reset_s(self, now_s: float) -> float:
        """Seconds until the bucket is full again (0.0 when it is)."""
        return max(0.0, (self.capacity - self.level(now_s)) / self.rate_per_s)

    def set_level(self, level: float, now_s: float) -> None:
        """Put the bucket at `level` as of `now_s` (a restart restoring its saved state)."""
        self._level = min(self.capacity, float(level))
        self._at_s = now_s

    def set_rate(self, capacity: float, rate_per_s: float, now_s: float) -> None:
        """Change the limits (a reload, a daily budget tightening), keeping the level."""
        if capacity <= 0 or rate_per_s <= 0:
            raise ValueError("capacity and rate_per_s must be > 0")
        self.level(now_s)
        self.capacity = float(capacity)
        self.rate_per_s = float(rate_per_s)
        self._level = min(self._level, self.capacity)


class WindowSum:
    """Sum of the amounts added in the last `window_s` seconds, at a resolution of
    `window_s / buckets` (an amount leaves the window up to one slice late, never early)."""

    __slots__ = ("_slices", "_span", "_total", "slice_s", "window_s")

    def __init__(self, window_s: float, buckets: int = 60) -> None:
        if window_s <= 0 or buckets < 1:
            raise ValueError("window_s must be > 0 and buckets >= 1")
        self.window_s = float(window_s)
        self.slice_s = self.window_s / buckets
        self._span = round(self.window_s / self.slice_s)  # slices in a window
        self._slices: deque[tuple[int, float]] = deque()  # (slice index, amount), oldest first
        self._total = 0.0

    def _expire(self, now_s: float) -> None:
        oldest_live = math.floor(now_s / self.slice_s) - self._span + 1
        while self._slices and self._slices[0][0] < oldest_live:
            self._total -= self._slices.popleft()[1]
        if not self._slices:
            self._total = 0.0  # no float drift survives an empty window

    def add(self, amount: float, now_s: float) -> None:
        if amount <= 0:
            return
        index = math.floor(now_s / self.slice_s)
        slices = self._slices
        if slices and slices[-1][0] == index:
            # Into the current slice, with no expiry step: the oldest live index depends only
            # on `index`, and the expiry run when this slice was opened left the oldest slice
            # at or past it (later expiries only move it on; an append would have made another
            # slice the last). So the step would remove nothing, and the sums stay the same.
            slices[-1] = (index, slices[-1][1] + amount)
        else:
            self._expire(now_s)
            slices.append((index, amount))
        self._total += amount

    def slices(self, now_s: float) -> list[tuple[float, float]]:
        """The live slices as (start time, amount), oldest first (to save them)."""
        self._expire(now_s)
        return [(index * self.slice_s, amount) for index, amount in self._slices]

    def total(self, now_s: float) -> float:
        self._expire(now_s)
        return max(0.0, self._total)

    def wait_below_s(self, limit: float, now_s: float) -> float:
        """Seconds until the sum drops below `limit` as old slices leave (0.0 if it is
        already below; the whole window when nothing could bring it there)."""
        total = self.total(now_s)
        if total < limit:
            return 0.0
        for index, amount in self._slices:
            total -= amount
            if total < limit:
                leaves_at_s = (index + self._span) * self.slice_s
                return max(0.0, leaves_at_s - now_s)
        return self.window_s
