"""The benchmark harness end to end: smoke.yaml against a real CPU engine directly and through
the gpupool router, in compare mode, through the same CLI entry a user runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.cli import main
from pools.launchers import InstanceSpec

pytestmark = pytest.mark.integration

SMOKE = Path(__file__).resolve().parents[2] / "benchmarks" / "scenarios" / "smoke.yaml"


def test_smoke_scenario_writes_a_comparison_report(
    real_engines: list[InstanceSpec], router_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "smoke"
    code = main(
        [
            "--scenario",
            str(SMOKE),
            "--target",
            real_engines[0].url,
            "--target-name",
            "engine",
            "--target",
            router_url,
            "--target-name",
            "gpupool",
            "--out",
            str(out),
            "--no-progress",
            "--pause-s",
            "1",
            # arrivals for 4 s instead of the scenario's 8: the same seed's first 4 s hold 6
            # chat requests and 3 agent runs of 3 steps (15 requests, both classes, runs that
            # complete), and halve the time spent per target
            "--duration-s",
            "4",
            # the engine needs its key; the router (no tenant keys: open) ignores it
            "--api-key",
            str(real_engines[0].api_key),
        ]
    )
    assert code == 0
    for name in (
        "report.json",
        "report.md",
        "records-engine.jsonl",
        "records-gpupool.jsonl",
        "cdf-normal.png",
        "cdf-agent.png",
        "ttft-over-time.png",
    ):
        assert (out / name).stat().st_size > 0, name
    report = json.loads((out / "report.json").read_text())
    engine, router = report["targets"]
    assert engine["requests"] == router["requests"] > 10  # the same workload for both
    # At this load (sized for one engine; the router has three) every request succeeds, directly
    # and through the router: a router that fails or refuses requests fails here.
    for target in (engine, router):
        name = target.get("name", "?")
        assert target["goodput_rps"] > 0, name
        for cls in ("normal", "agent"):
            summary = target["classes"][cls]
            assert summary["requests"] > 0, (name, cls)
            assert summary["ok"] == summary["requests"], (name, cls, summary)
            assert summary["failed"] == 0 and summary["rejected_429"] == 0, (name, cls, summary)
            assert summary["output_tokens_mean"] == 24, (name, cls)  # exact output lengths
            for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
                assert {"p50", "p90", "p95", "p99"} <= set(summary[metric]), (name, metric)
                assert 0 <= summary[metric]["p50"] <= summary[metric]["p99"], (name, metric)
            # (an ITL can be 0: several tokens may arrive in one chunk)
            assert summary["ttft_ms"]["p50"] > 0 and summary["e2e_ms"]["p50"] > 0, name
        runs = target["runs"]["agent"]
        assert runs["runs"] > 0 and runs["completed"] == runs["runs"], (name, runs)
    assert engine["runs"]["agent"]["gpu_seconds"] is None  # a bare engine has no /v1/runs
    # the router accounts every agent run it served
    router_runs = router["runs"]["agent"]
    assert router_runs["gpu_seconds_reported"] == router_runs["runs"], router_runs
    assert router_runs["gpu_seconds_total"] > 0, router_runs
    md = (out / "report.md").read_text()
    assert "| class | metric | engine | gpupool |" in md
    assert "TTFT p99" in md and "goodput" in md
