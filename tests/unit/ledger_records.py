"""One `RequestRecord` factory for the ledger tests: a finished, successful agent step of
team-a on instance i0, with a fresh request id each call; a test names what it changes."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from router.accounting.ledger import RequestRecord

T0 = 1_750_000_000.0  # a fixed unix time
_ids = itertools.count()


def record(**changes: Any) -> RequestRecord:
    base = RequestRecord(
        request_id=f"req-{next(_ids)}",
        run_id="run-1",
        step_index=None,
        tenant="team-a",
        class_name="agent",
        pool="agent",
        instance="i0",
        model="tiny",
        started_at_s=T0,
        ended_at_s=T0 + 2.0,
        queue_s=0.1,
        ttft_s=0.2,
        tpot_s=0.01,
        prompt_tokens=100,
        completion_tokens=20,
        gpu_seconds=1.5,
        outcome="ok",
        status_code=200,
    )
    return dataclasses.replace(base, **changes)
