"""What a benchmark records: one `RequestRecord` per request sent and one `RunRecord` per agent
run, plus `TargetResult` (everything from one target). Plain dataclasses, written as JSONL
next to the report so every number in it can be recomputed.

Times are milliseconds except offsets from the benchmark start (`send_s`, `end_s`, seconds).
`ttft_ms` is the first chunk carrying `choices` (vLLM's definition: the role chunk arrives with
the first token), `e2e_ms` the last such chunk, `itl_ms` the gaps between consecutive ones.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["RequestRecord", "RunRecord", "TargetResult"]


@dataclass
class RequestRecord:
    class_name: str
    kind: Literal["chat", "agent"]
    scheduled_s: float  # planned offset from the start
    send_s: float = 0.0  # actual offset when the request left
    run_id: str | None = None
    step: int | None = None  # 1-based step of an agent run
    status: int | None = None  # HTTP status; None: no response (connect error, timeout)
    error_code: str | None = None  # error.code (or error.type) of an error body or stream event
    error: str | None = None  # short message, never the prompt
    retry_after_s: float | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None  # from the usage chunk
    output_tokens: int | None = None
    planned_prompt_tokens: int = 0
    planned_output_tokens: int = 0
    pool: str | None = None  # x-gpupool-pool response header, when the target sets it
    instance: str | None = None  # x-gpupool-instance

    @property
    def ok(self) -> bool:
        """A complete 200 response with at least one token chunk."""
        return self.status == 200 and self.error_code is None and self.ttft_ms is not None

    @property
    def end_s(self) -> float | None:
        return None if self.e2e_ms is None else self.send_s + self.e2e_ms / 1e3

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> RequestRecord:
        return RequestRecord(**data)


@dataclass
class RunRecord:
    class_name: str
    run_id: str
    scheduled_s: float
    planned_steps: int
    start_s: float = 0.0
    end_s: float | None = None  # offset when the last step ended
    steps_ok: int = 0
    steps_sent: int = 0
    outcome: str = "running"  # completed | context_limit | failed | cancelled
    gpu_seconds: float | None = None  # from the target's GET /v1/runs/{run_id}

    @property
    def completion_s(self) -> float | None:
        """First send to last token of the last step, tool waits included."""
        return None if self.end_s is None else self.end_s - self.start_s

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> RunRecord:
        return RunRecord(**data)


@dataclass
class TargetResult:
    name: str
    url: str
    wall_s: float  # benchmark start to the last completion (vLLM's benchmark duration)
    requests: list[RequestRecord]
    runs: list[RunRecord]
    cancelled_at_drain: int = 0
    max_send_lag_ms: float = 0.0  # how late the harness sent against the schedule (its own health)
