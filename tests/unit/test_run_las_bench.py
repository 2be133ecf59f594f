"""The run_las benchmark's comparison (benchmarks/run_las/analysis.py): runs matched across
modes by class and index, the issue's three targets judged from hand-made records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.records import RunRecord
from benchmarks.run_las.analysis import ModeResult, compare_modes, load_runs, run_key


def _run(
    mode: str, cls: str, index: int, completion_s: float, outcome: str = "completed"
) -> RunRecord:
    steps = 2 if cls == "short" else 20
    return RunRecord(
        class_name=cls,
        run_id=f"bench-run-las-mixed-13-{mode}-1750000000-{cls}-{index:05d}",
        scheduled_s=float(index),
        planned_steps=steps,
        start_s=float(index),
        end_s=float(index) + completion_s if outcome == "completed" else None,
        steps_ok=steps,
        steps_sent=steps,
        outcome=outcome,
    )


def _mode(name: str, completions: dict[tuple[str, int], float], tok_s: float) -> ModeResult:
    runs = [_run(name, cls, i, c) for (cls, i), c in completions.items()]
    queue = {r.run_id: 0.5 * (r.completion_s or 0.0) for r in runs}
    return ModeResult(name, runs, tok_s, queue)


FIFO = {
    ("short", 0): 10.0,
    ("short", 1): 20.0,
    ("short", 2): 30.0,
    ("long", 0): 100.0,
    ("long", 1): 200.0,
}


def test_run_key_reads_class_and_index() -> None:
    assert run_key(_run("fifo", "long", 42, 1.0)) == ("long", 42)


def test_all_three_targets_hold() -> None:
    las = {
        ("short", 0): 4.0,
        ("short", 1): 5.0,
        ("short", 2): 9.0,
        ("long", 0): 140.0,
        ("long", 1): 210.0,
    }
    result = compare_modes(_mode("fifo", FIFO, 100.0), _mode("run_las", las, 97.0))
    assert result["fifo"]["classes"]["short"]["completion_s_p50"] == 20.0
    assert result["run_las"]["classes"]["short"]["completion_s_p50"] == 5.0
    assert result["run_las"]["classes"]["long"]["completion_s_max"] == 210.0
    assert result["fifo"]["longest_run_queue_s"] == 100.0  # half of 200 s (see _mode)
    t = result["targets"]
    assert t["short_p50_gain"]["value"] == pytest.approx(4.0) and t["short_p50_gain"]["held"]
    assert t["throughput_change_frac"]["value"] == pytest.approx(-0.03)
    assert t["throughput_change_frac"]["held"]
    assert t["worst_run_ratio"]["value"] == pytest.approx(1.4)  # long 0: 140 / 100
    assert t["worst_run_ratio"]["held"] and t["worst_run_ratio"]["runs_compared"] == 5
    assert result["worst_run"]["run"] == "long-0"
    assert result["per_run_ratio"]["long"]["max"] == pytest.approx(1.4)


def test_each_target_can_be_missed() -> None:
    las = {
        ("short", 0): 6.0,
        ("short", 1): 12.0,
        ("short", 2): 14.0,
        ("long", 0): 160.0,
        ("long", 1): 200.0,
    }
    result = compare_modes(_mode("fifo", FIFO, 100.0), _mode("run_las", las, 94.0))
    t = result["targets"]
    assert t["short_p50_gain"]["value"] == pytest.approx(20 / 12)
    assert not t["short_p50_gain"]["held"]
    assert not t["throughput_change_frac"]["held"]  # -6 %
    assert t["worst_run_ratio"]["value"] == pytest.approx(1.6)
    assert not t["worst_run_ratio"]["held"]
    assert result["per_run_ratio"]["long"]["above_limit"] == 1


def test_a_run_that_did_not_complete_fails_the_per_run_target(tmp_path: Path) -> None:
    las_runs = [_run("run_las", cls, i, c) for (cls, i), c in FIFO.items()]
    las_runs[-1] = _run("run_las", "long", 1, 0.0, outcome="cancelled")
    las = ModeResult("run_las", las_runs, 100.0, {})
    result = compare_modes(_mode("fifo", FIFO, 100.0), las)
    worst = result["targets"]["worst_run_ratio"]
    assert worst["value"] == pytest.approx(1.0) and worst["runs_not_completed"] == 1
    assert not worst["held"]
    assert result["run_las"]["outcomes"] == {"cancelled": 1, "completed": 4}


def test_load_runs_reads_only_run_lines(tmp_path: Path) -> None:
    path = tmp_path / "records-fifo.jsonl"
    run = _run("fifo", "short", 3, 7.5)
    lines = [{"type": "request", "class_name": "short"}, {"type": "run", **run.to_json()}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    (loaded,) = load_runs(path)
    assert loaded == run and loaded.completion_s == 7.5
