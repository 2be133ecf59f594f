"""`run_compare(..., together=True)`: every target is sent the plan at the same time (the
run_las benchmark's paired mode), against `together=False`: one target after the other."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.compare import run_compare
from benchmarks.runner import Target
from benchmarks.testing import serve_asgi
from pools.testing.fake_engine import FakeEngineState, make_fake_engine
from router.simulate.scenario import Scenario, parse_scenario


def _one_request_scenario() -> Scenario:
    return parse_scenario(
        {
            "name": "together",
            "seed": 1,
            "duration_s": 1.0,
            "drain_timeout_s": 10,
            "request_timeout_s": 5,
            "classes": {
                "normal": {
                    "kind": "chat",
                    "arrivals": {"process": "constant", "rate_per_s": 1.0},
                    "prompt_tokens": {"dist": "fixed", "value": 40},
                    "output_tokens": {"dist": "fixed", "value": 4},
                    "slo": {"ttft_ms": 10_000},
                }
            },
        }
    )


@pytest.mark.parametrize(("together", "peak"), [(True, 2), (False, 1)])
async def test_together_sends_to_every_target_at_once(
    tmp_path: Path, together: bool, peak: int
) -> None:
    # one fake engine behind two target names; each request holds it for 0.5 s, so the two
    # targets' one request each overlap only when they are sent together
    state = FakeEngineState(ttft_s=0.5)
    scenario = _one_request_scenario()
    async with serve_asgi(make_fake_engine(state)) as url:
        report = await run_compare(
            scenario,
            [Target("a", url), Target("b", url)],
            tmp_path,
            progress=False,
            together=together,
        )
    assert [t["name"] for t in report["targets"]] == ["a", "b"]
    assert [t["requests"] for t in report["targets"]] == [1, 1]
    assert state.peak_running == peak
    assert (tmp_path / "records-a.jsonl").exists() and (tmp_path / "records-b.jsonl").exists()
