"""In-process A/B of `WindowSum.add` skipping its expiry step in the current slice (issue 28,
s48): two versions of router/governance/bucket.py loaded side by side in one process,
alternated, the minimum per request over many rounds, two ways:

- `adds`: a tenant's two cost windows (hour: 60 slices, day: 96) fed as `Governor.finished`
  feeds them, one request's GPU-seconds each, the clock 1 ms on per request;
- `governance`: s47's governance_ab.py driver (loaded from its results folder: prepare,
  enter_now, dispatched, deferred_step, finished for a tenant without limits), the same
  governor.py loaded twice, each bound to one of the two bucket modules.

    cd <worktree> && PYTHONPATH=. .venv/bin/python window_ab.py BUCKET_BEFORE.py BUCKET_AFTER.py
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import ModuleType
from typing import Any

import router.governance.governor as governor_module

ROUNDS, N = 150, 400
S47_AB = Path(__file__).parent.parent / "hot-path-2026-12-04-s47" / "governance_ab.py"


def _s47() -> ModuleType:
    """s47's governance_ab.py (its `load`, `driver` and `base` are used here)."""
    spec = importlib.util.spec_from_file_location("governance_ab_s47", S47_AB)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


S47 = _s47()
load = S47.load


def governor_with(bucket: ModuleType, name: str) -> ModuleType:
    """governor.py executed again while `router.governance.bucket` is `bucket`."""
    real = sys.modules["router.governance.bucket"]
    sys.modules["router.governance.bucket"] = bucket
    try:
        module: ModuleType = load(str(Path(governor_module.__file__ or "")), name)
        return module
    finally:
        sys.modules["router.governance.bucket"] = real


Run = Callable[[int], Coroutine[Any, Any, None]]


def adds_driver(bucket: ModuleType) -> Run:
    hour, day = bucket.WindowSum(3600.0, 60), bucket.WindowSum(86400.0, 96)
    clock = [1000.0]

    async def run(n: int) -> None:
        now = clock[0]
        for _ in range(n):
            now += 0.001
            hour.add(1e-4, now)
            day.add(1e-4, now)
        clock[0] = now

    return run


async def adds_base(n: int) -> None:  # the loop and clock alone
    now = 1000.0
    for _ in range(n):
        now += 0.001


def us_per_request(loop: asyncio.AbstractEventLoop, run: Run) -> float:
    t0 = time.perf_counter()
    loop.run_until_complete(run(N))
    return (time.perf_counter() - t0) / N * 1e6


def best_of(runs: dict[str, Run], loop: asyncio.AbstractEventLoop) -> dict[str, float]:
    """The minimum per request of each, over ROUNDS rounds that visit them in turn."""
    best = dict.fromkeys(runs, 1e9)
    for _, (tag, run) in itertools.product(range(ROUNDS), runs.items()):
        best[tag] = min(best[tag], us_per_request(loop, run))
    return best


def main() -> None:
    before = load(sys.argv[1], "bucket_before")
    after = load(sys.argv[2], "bucket_after")
    loop = asyncio.new_event_loop()
    adds = best_of(
        {"before": adds_driver(before), "after": adds_driver(after), "base": adds_base}, loop
    )
    gov = best_of(
        {
            "before": S47.driver(governor_with(before, "gov_before")),
            "after": S47.driver(governor_with(after, "gov_after")),
            "base": S47.base,
        },
        loop,
    )
    for label, best in (("two window adds", adds), ("governance", gov)):
        b = best["base"]
        print(
            f"{label} per request, min of {ROUNDS} x {N} (interleaved), {b:.2f} us of base"
            f" taken off: before {best['before'] - b:.2f} us, after {best['after'] - b:.2f} us,"
            f" cut {best['before'] - best['after']:.2f} us"
        )


if __name__ == "__main__":
    main()
