"""Waiting for engines to answer `GET /health`, with a progress line every few seconds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp

from pools.launchers.base import ProgressFn

__all__ = ["probe_health", "wait_healthy"]


async def probe_health(session: aiohttp.ClientSession, url: str, timeout_s: float = 2.0) -> bool:
    """True if `url/health` answers 200 within `timeout_s`."""
    try:
        async with session.get(
            f"{url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False


async def wait_healthy(
    urls: dict[str, str],
    deadline_monotonic_s: float,
    progress: ProgressFn | None = None,
    *,
    alive: Callable[[str], str | None] | None = None,
    poll_s: float = 1.0,
    progress_every_s: float = 5.0,
) -> list[str]:
    """Poll every instance until all are healthy or the deadline passes.

    `alive(instance_id)` may return a reason string when an instance can never become healthy
    (its process exited); such instances are given up on at once. Returns the ids that did
    not become healthy.
    """
    pending = dict(urls)
    started = time.monotonic()
    last_progress = started
    ready_at: dict[str, float] = {}
    failed: dict[str, str] = {}
    async with aiohttp.ClientSession() as session:
        while pending and time.monotonic() < deadline_monotonic_s:
            results = await asyncio.gather(*(probe_health(session, u) for u in pending.values()))
            for instance_id, ok in zip(list(pending), results, strict=True):
                if ok:
                    ready_at[instance_id] = time.monotonic() - started
                    del pending[instance_id]
                    if progress:
                        progress(f"{instance_id} ready after {ready_at[instance_id]:.0f} s")
                elif alive is not None and (reason := alive(instance_id)) is not None:
                    failed[instance_id] = reason
                    del pending[instance_id]
                    if progress:
                        progress(f"{instance_id} failed: {reason}")
            if not pending:
                break
            now = time.monotonic()
            if progress and now - last_progress >= progress_every_s:
                last_progress = now
                progress(
                    f"waiting for {len(pending)} engine(s) ({', '.join(pending)}): "
                    f"{now - started:.0f} s elapsed, {len(ready_at)} ready"
                )
            await asyncio.sleep(poll_s)
    return list(pending) + list(failed)
