"""OpenAI's rate-limit response headers from a tenant's buckets (pure formatting).

`x-ratelimit-limit-requests`, `x-ratelimit-remaining-requests`, `x-ratelimit-reset-requests`
and the same three for tokens, as OpenAI sends them: limits per minute, whole remaining units,
resets as durations like `1s`, `6m0s`, `250ms` (the time until the bucket is full again).
A tenant without a requests (tokens) limit gets no requests (tokens) headers.
"""

from __future__ import annotations

import math

from router.governance.bucket import TokenBucket

__all__ = ["format_duration", "rate_limit_headers"]


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
    out: list[tuple[bytes, bytes]] = []
    for kind, bucket in (("requests", requests), ("tokens", tokens)):
        if bucket is None:
            continue
        limit = round(bucket.rate_per_s * 60)
        remaining = max(0, math.floor(bucket.level(now_s)))
        out.append((f"x-ratelimit-limit-{kind}".encode(), str(limit).encode()))
        out.append((f"x-ratelimit-remaining-{kind}".encode(), str(remaining).encode()))
        reset = format_duration(bucket.reset_s(now_s))
        out.append((f"x-ratelimit-reset-{kind}".encode(), reset.encode()))
    return out
