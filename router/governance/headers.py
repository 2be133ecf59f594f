"""OpenAI's rate-limit response headers from a tenant's buckets (pure formatting).

`x-ratelimit-limit-requests`, `x-ratelimit-remaining-requests`, `x-ratelimit-reset-requests`
and the same three for tokens, as OpenAI sends them: limits per minute, whole remaining units,
resets as durations like `1s`, `6m0s`, `250ms` (the time until the bucket is full again).
A tenant without a requests (tokens) limit gets no requests (tokens) headers.

With router replicas on a shared store (`store.url`) a bucket's view is `shared_view`: the
least of the replica's own bucket and what the shared bucket holds for it (its level, as the
replica last learned it, plus the replica's lease); docs/replicas.md says what it counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from router.governance.bucket import TokenBucket

__all__ = [
    "BucketView",
    "format_duration",
    "local_view",
    "rate_limit_headers",
    "shared_view",
    "view_headers",
]


@dataclass(frozen=True, slots=True)
class BucketView:
    """One budget as a client sees it: its limit per minute, the whole units it may spend
    now, the seconds until it is full again."""

    limit_per_minute: int
    remaining: int
    reset_s: float


def local_view(bucket: TokenBucket, now_s: float) -> BucketView:
    return BucketView(
        round(bucket.rate_per_s * 60),
        max(0, math.floor(bucket.level(now_s))),
        bucket.reset_s(now_s),
    )


def shared_view(bucket: TokenBucket, now_s: float, shared: float) -> BucketView:
    """`bucket`: the replica's own (at `now_s`, its clock); `shared`: what the shared bucket
    holds for this replica (its level plus the replica's lease, negative when in debt). A
    request here takes from both, so the least of them is what it may spend; the view is
    full again when both are."""
    own = local_view(bucket, now_s)
    return BucketView(
        own.limit_per_minute,
        max(0, min(own.remaining, math.floor(shared))),
        max(own.reset_s, (bucket.capacity - shared) / bucket.rate_per_s),
    )


def view_headers(
    requests: BucketView | None, tokens: BucketView | None
) -> list[tuple[bytes, bytes]]:
    out: list[tuple[bytes, bytes]] = []
    for kind, view in (("requests", requests), ("tokens", tokens)):
        if view is None:
            continue
        out.append((f"x-ratelimit-limit-{kind}".encode(), str(view.limit_per_minute).encode()))
        out.append((f"x-ratelimit-remaining-{kind}".encode(), str(view.remaining).encode()))
        reset = format_duration(view.reset_s)
        out.append((f"x-ratelimit-reset-{kind}".encode(), reset.encode()))
    return out


def format_duration(seconds: float) -> str:
    """`250ms`, `1.5s`, `6m0s`, `1h2m3s` (OpenAI's reset format; never negative)."""
    seconds = max(0.0, seconds)
    if seconds < 1.0:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60.0:
        text = f"{math.ceil(seconds * 1000) / 1000:.3f}".rstrip("0").rstrip(".")
        return f"{text}s"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{hours}h" if hours else "") + f"{minutes}m{secs}s"


def rate_limit_headers(
    requests: TokenBucket | None, tokens: TokenBucket | None, now_s: float
) -> list[tuple[bytes, bytes]]:
    """The headers of the replica's own buckets (one router, or a store outage)."""
    return view_headers(
        None if requests is None else local_view(requests, now_s),
        None if tokens is None else local_view(tokens, now_s),
    )
