"""Metric definitions against hand-computed examples (vLLM bench serve's definitions)."""

from __future__ import annotations

import pytest

from benchmarks.metrics import (
    class_summary,
    distribution,
    meets_slo,
    rejection_reasons,
    run_summary,
    summarize_target,
    tpot_ms,
)
from benchmarks.records import RequestRecord, RunRecord, TargetResult
from router.simulate.scenario import Slo, parse_scenario


def ok(
    ttft: float, e2e: float, out: int, itl: list[float] | None = None, cls: str = "normal"
) -> RequestRecord:
    return RequestRecord(
        cls,
        "chat",
        0.0,
        status=200,
        ttft_ms=ttft,
        e2e_ms=e2e,
        output_tokens=out,
        prompt_tokens=100,
        itl_ms=itl or [],
    )


def rejected(code: str = "queue_full", cls: str = "normal") -> RequestRecord:
    return RequestRecord(cls, "chat", 0.0, status=429, error_code=code, retry_after_s=2.0)


def test_tpot_is_decode_time_over_tokens_after_the_first() -> None:
    # 100 ms to the first token, 1000 ms in all, 10 tokens: 900 ms over 9 gaps = 100 ms.
    assert tpot_ms(ok(100, 1000, 10)) == pytest.approx(100.0)
    assert tpot_ms(ok(100, 100, 1)) is None  # undefined for one token
    assert tpot_ms(rejected()) is None
    # no usage chunk: count the token chunks (itl gaps + 1), as vLLM does
    rec = ok(100, 400, 0, itl=[100, 100, 100])
    rec.output_tokens = None
    assert tpot_ms(rec) == pytest.approx(100.0)


def test_percentiles_use_linear_interpolation() -> None:
    d = distribution([10, 20, 30, 40, 50])
    assert d is not None
    assert d["p50"] == 30 and d["mean"] == 30
    assert d["p90"] == pytest.approx(46.0)  # 40 + 0.6 * 10
    assert d["p99"] == pytest.approx(49.6)
    assert d["n"] == 5 and d["max"] == 50
    assert distribution([]) is None


def test_meets_slo_checks_every_target() -> None:
    slo = Slo(ttft_ms=200, tpot_ms=50, e2e_ms=1000)
    assert meets_slo(ok(150, 600, 10), slo)  # tpot 50 exactly: meets
    assert not meets_slo(ok(250, 600, 10), slo)  # ttft
    assert not meets_slo(ok(150, 700, 10), slo)  # tpot 61
    assert not meets_slo(ok(150, 1100, 100), slo)  # e2e
    assert meets_slo(ok(150, 150, 1), slo)  # 1 token: tpot counts as 0
    assert not meets_slo(rejected(), slo)
    assert meets_slo(ok(5000, 9000, 2), Slo())  # no targets: completing is enough


def test_goodput_counts_rejections_and_failures_as_misses() -> None:
    slo = Slo(ttft_ms=200, tpot_ms=50)
    records = [
        ok(100, 550, 10),  # good (tpot 50)
        ok(100, 300, 5),  # good (tpot 50)
        ok(300, 700, 9),  # misses ttft
        rejected(),
        RequestRecord("normal", "chat", 0.0, status=None, error_code="connect_error"),
    ]
    s = class_summary(records, slo, wall_s=10.0)
    assert s["requests"] == 5 and s["ok"] == 3 and s["failed"] == 2
    assert s["good"] == 2
    assert s["goodput_rps"] == pytest.approx(0.2)
    assert s["slo_attainment_frac"] == pytest.approx(0.4)
    assert s["slo_attainment_by_metric"] == {
        "ttft_ms": pytest.approx(0.4),
        "tpot_ms": pytest.approx(0.6),
    }
    assert s["rejected_429"] == 1
    assert s["throughput_rps"] == pytest.approx(0.3)
    assert s["output_tokens_per_s"] == pytest.approx(2.4)
    assert s["ttft_ms"]["p50"] == 100
    assert s["tpot_ms"]["p50"] == pytest.approx(50.0)
    assert s["rejections"] == {"429 queue_full": 1, "none connect_error": 1}


def test_itl_is_pooled_over_requests() -> None:
    s = class_summary([ok(10, 40, 3, itl=[10, 20]), ok(10, 100, 2, itl=[90])], Slo(), 1.0)
    assert s["itl_ms"]["n"] == 3
    assert s["itl_ms"]["p50"] == 20


def test_rejection_reasons_sorted_by_count() -> None:
    recs = [rejected("queue_full"), rejected("deadline"), rejected("queue_full"), ok(1, 2, 2)]
    assert list(rejection_reasons(recs).items()) == [("429 queue_full", 2), ("429 deadline", 1)]


def test_run_summary() -> None:
    runs = [
        RunRecord(
            "agent",
            "r1",
            0.0,
            3,
            start_s=0.0,
            end_s=6.0,
            steps_ok=3,
            steps_sent=3,
            outcome="completed",
            gpu_seconds=1.5,
        ),
        RunRecord(
            "agent",
            "r2",
            1.0,
            4,
            start_s=1.0,
            end_s=5.0,
            steps_ok=2,
            steps_sent=2,
            outcome="context_limit",
            gpu_seconds=0.5,
        ),
        RunRecord(
            "agent",
            "r3",
            2.0,
            3,
            start_s=2.0,
            end_s=None,
            steps_ok=0,
            steps_sent=1,
            outcome="failed",
        ),
    ]
    s = run_summary(runs)
    assert s["runs"] == 3 and s["completed"] == 2
    assert s["outcomes"] == {"completed": 1, "context_limit": 1, "failed": 1}
    assert s["completion_s"]["p50"] == pytest.approx(5.0)  # of 6 and 4
    assert s["steps_ok_mean"] == pytest.approx(5 / 3)
    assert s["gpu_seconds"]["mean"] == pytest.approx(1.0)
    assert s["gpu_seconds_total"] == pytest.approx(2.0)
    assert s["gpu_seconds_reported"] == 2
    assert run_summary([RunRecord("agent", "x", 0, 1)])["gpu_seconds"] is None


def test_summarize_target_splits_classes() -> None:
    scenario = parse_scenario(
        {
            "name": "s",
            "duration_s": 10,
            "classes": {
                "normal": {
                    "kind": "chat",
                    "arrivals": {"process": "poisson", "rate_per_s": 1},
                    "prompt_tokens": {"dist": "fixed", "value": 10},
                    "output_tokens": {"dist": "fixed", "value": 10},
                    "slo": {"ttft_ms": 200},
                },
                "agent": {
                    "kind": "agent",
                    "arrivals": {"process": "poisson", "rate_per_s": 1},
                    "prompt_tokens": {"dist": "fixed", "value": 10},
                    "output_tokens": {"dist": "fixed", "value": 10},
                    "steps": {"dist": "fixed", "value": 2},
                    "tool_result_tokens": {"dist": "fixed", "value": 10},
                    "tool_wait_ms": {"dist": "fixed", "value": 10},
                    "slo": {"ttft_ms": 500},
                },
            },
        }
    )
    a1 = ok(400, 500, 2, cls="agent")
    a1.kind, a1.run_id, a1.step, a1.pool = "agent", "r", 1, "agent"
    result = TargetResult(
        "t",
        "http://x",
        4.0,
        [ok(100, 200, 2), ok(300, 400, 2), a1],
        [RunRecord("agent", "r", 0, 2, outcome="failed")],
    )
    s = summarize_target(result, scenario)
    assert s["classes"]["normal"]["good"] == 1 and s["classes"]["agent"]["good"] == 1
    assert s["goodput_rps"] == pytest.approx(0.5)
    assert s["slo_attainment_frac"] == pytest.approx(2 / 3)
    assert s["runs"]["agent"]["runs"] == 1 and "normal" not in s["runs"]
    assert s["pools_seen"] == {"agent": 1}
