"""Tenant and run governance: token budgets reserved then settled, concurrency tiers, run
guards, cost caps (docs/governance.md).

Pure cores: `bucket` (token bucket, sliding window), `guards` (when a run must stop),
`loops` (a repeated tool call), `limits` (which limits apply), `headers` (OpenAI's
x-ratelimit-* headers). The shell: `governor.Governor`, on the request path. `routes`:
/v1/budget, /v1/runs/{id}/end, /admin/governance/reload.

Must not import `router.gateway`, `router.cli`, `router.core`, `router.simulate` nor
`benchmarks` (tests/unit/test_layering.py).
"""

from router.governance.governor import Governor, RunEnd, StepSignals
from router.governance.metrics import GovernanceMetrics

__all__ = ["GovernanceMetrics", "Governor", "RunEnd", "StepSignals"]
