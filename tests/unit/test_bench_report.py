"""Report writing (JSON, Markdown tables, PNG plots, records) and the CLI end to end against a
fake engine subprocess."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.cli import main
from benchmarks.metrics import summarize_target
from benchmarks.plots import write_plots
from benchmarks.records import RequestRecord, RunRecord, TargetResult
from benchmarks.report import build_report, render_markdown, write_records, write_report
from router.simulate.scenario import parse_scenario

ROOT = Path(__file__).resolve().parents[2]

SCENARIO = {
    "name": "rep",
    "seed": 3,
    "duration_s": 1.5,
    "drain_timeout_s": 10,
    "classes": {
        "normal": {
            "kind": "chat",
            "arrivals": {"process": "poisson", "rate_per_s": 8},
            "prompt_tokens": {"dist": "fixed", "value": 30},
            "output_tokens": {"dist": "fixed", "value": 4},
            "slo": {"ttft_ms": 500, "tpot_ms": 100},
        },
        "agent": {
            "kind": "agent",
            "arrivals": {"process": "poisson", "rate_per_s": 3},
            "prompt_tokens": {"dist": "fixed", "value": 60},
            "output_tokens": {"dist": "fixed", "value": 4},
            "steps": {"dist": "fixed", "value": 2},
            "tool_result_tokens": {"dist": "fixed", "value": 10},
            "tool_wait_ms": {"dist": "fixed", "value": 10},
            "slo": {"ttft_ms": 800},
        },
    },
}


def result(name: str, ttft: float, rejected: int) -> TargetResult:
    reqs = [
        RequestRecord(
            "normal",
            "chat",
            i * 0.1,
            send_s=i * 0.1,
            status=200,
            ttft_ms=ttft + i,
            e2e_ms=ttft + 50 + i,
            itl_ms=[10.0] * 5,
            output_tokens=6,
            prompt_tokens=30,
        )
        for i in range(20)
    ]
    reqs += [
        RequestRecord(
            "agent",
            "agent",
            0.5,
            send_s=0.5,
            run_id="r1",
            step=1,
            status=200,
            ttft_ms=2 * ttft,
            e2e_ms=2 * ttft + 30,
            output_tokens=4,
            prompt_tokens=80,
        )
    ]
    reqs += [
        RequestRecord(
            "normal",
            "chat",
            1.0,
            send_s=1.0,
            status=429,
            error_code="queue_full",
            retry_after_s=1.0,
        )
    ] * rejected
    runs = [
        RunRecord(
            "agent",
            "r1",
            0.5,
            2,
            start_s=0.5,
            end_s=2.0,
            steps_ok=1,
            steps_sent=1,
            outcome="context_limit",
            gpu_seconds=0.42,
        )
    ]
    return TargetResult(name, f"http://{name}", 3.0, reqs, runs)


def test_report_files_and_tables(tmp_path: Path) -> None:
    scenario = parse_scenario(SCENARIO)
    results = [result("pools", 100.0, 0), result("shared", 700.0, 3)]
    summaries = [summarize_target(r, scenario) for r in results]
    report = build_report(
        scenario,
        summaries,
        seed=3,
        machine={"cpu_model": "test cpu", "cpu_cores": 2, "gpus": []},
        created_at="2026-01-01 00:00:00 UTC",
        notes="hello notes",
    )
    report["plots"] = write_plots(tmp_path, scenario, results)
    for r in results:
        write_records(tmp_path, r)
    json_path, md_path = write_report(tmp_path, report)
    data = json.loads(json_path.read_text())
    assert [t["name"] for t in data["targets"]] == ["pools", "shared"]
    normal = data["targets"][0]["classes"]["normal"]
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(normal[metric]) >= {"p50", "p90", "p95", "p99", "mean"}
    assert data["targets"][1]["rejections"] == {"429 queue_full": 3}
    assert data["targets"][0]["runs"]["agent"]["gpu_seconds"]["p50"] == pytest.approx(0.42)
    md = md_path.read_text()
    assert "| class | metric | pools | shared |" in md
    assert "| normal | TTFT p50 | 109.5 | 709.5 |" in md
    assert "GPU-seconds per run p50 | 0.420 | 0.420 |" in md
    assert "`429 queue_full` | 0 | 3 |" in md
    assert "hello notes" in md
    assert set(report["plots"]) == {"cdf-normal.png", "cdf-agent.png", "ttft-over-time.png"}
    for name in report["plots"]:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = (tmp_path / "records-shared.jsonl").read_text().splitlines()
    assert len(lines) == 20 + 1 + 3 + 1
    assert json.loads(lines[-1])["type"] == "run"


def test_markdown_handles_missing_values() -> None:
    scenario = parse_scenario(SCENARIO)
    empty = TargetResult("t", "http://t", 0.0, [], [])
    md = render_markdown(
        build_report(
            scenario, [summarize_target(empty, scenario)], seed=1, machine={}, created_at="now"
        )
    )
    assert "| normal | TTFT p50 | – |" in md
    assert "## Failures and rejections" in md


@pytest.fixture
def fake_engine_url() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pools.testing.fake_engine",
            "--port",
            str(port),
            "--ttft-ms",
            "2",
            "--itl-ms",
            "1",
        ],
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_cli_compares_two_targets(
    fake_engine_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    scenario_path = tmp_path / "s.yaml"
    scenario_path.write_text(yaml.safe_dump(SCENARIO))
    out = tmp_path / "out"
    code = main(
        [
            "--scenario",
            str(scenario_path),
            "--target",
            fake_engine_url,
            "--target",
            fake_engine_url + "/v1",
            "--target-name",
            "a",
            "--target-name",
            "b",
            "--out",
            str(out),
            "--no-progress",
            "--pause-s",
            "0",
        ]
    )
    assert code == 0
    for name in (
        "report.json",
        "report.md",
        "records-a.jsonl",
        "records-b.jsonl",
        "cdf-normal.png",
        "cdf-agent.png",
        "ttft-over-time.png",
    ):
        assert (out / name).is_file(), name
    data = json.loads((out / "report.json").read_text())
    a, b = data["targets"]
    assert a["requests"] == b["requests"] > 0  # same seed, same workload
    assert a["classes"]["normal"]["requests"] == b["classes"]["normal"]["requests"]
    assert a["classes"]["normal"]["ttft_ms"]["p50"] > 0
    assert "goodput" in capsys.readouterr().out


def test_cli_reports_a_bad_scenario(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nduration_s: -1\nclasses: {}\n")
    code = main(
        ["--scenario", str(bad), "--target", "http://127.0.0.1:9", "--out", str(tmp_path / "o")]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "duration_s:" in err and "classes:" in err


def test_cli_reports_an_unreachable_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "--scenario",
            str(ROOT / "benchmarks" / "scenarios" / "smoke.yaml"),
            "--target",
            "http://127.0.0.1:9",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert code == 1
    assert "GET /v1/models failed" in capsys.readouterr().err
