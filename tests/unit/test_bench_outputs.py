"""Where benchmarks write: bulky files of a run under benchmarks/results/ go to the ignored
benchmarks/out/ (same relative path); a folder elsewhere keeps everything."""

from __future__ import annotations

import subprocess
from pathlib import Path

from benchmarks.outputs import BULK, REPO, RESULTS, bulk_dir, bulk_path, display_path
from benchmarks.report import build_report, render_markdown
from router.simulate.scenario import parse_scenario


def test_a_results_folder_maps_to_the_same_path_under_out() -> None:
    assert bulk_dir(RESULTS / "kv-pressure-2026-11-30" / "harness") == (
        BULK / "kv-pressure-2026-11-30" / "harness"
    )
    assert bulk_dir(RESULTS) == BULK
    assert display_path(bulk_dir(RESULTS / "x")) == "benchmarks/out/x"


def test_a_folder_outside_results_keeps_its_bulky_files(tmp_path: Path) -> None:
    assert bulk_dir(tmp_path / "run") == tmp_path / "run"
    path = bulk_path(tmp_path / "run" / "logs", "router.log")
    assert path == tmp_path / "run" / "logs" / "router.log"
    assert path.parent.is_dir()


def test_git_ignores_the_bulky_folder() -> None:
    probe = BULK / "some-run" / "records-a.jsonl"
    done = subprocess.run(
        ["git", "check-ignore", "-q", str(probe.relative_to(REPO))], cwd=REPO, check=False
    )
    assert done.returncode == 0


def test_the_report_lists_plots_instead_of_embedding_them() -> None:
    scenario = parse_scenario(
        {
            "name": "s",
            "duration_s": 1,
            "classes": {
                "normal": {
                    "kind": "chat",
                    "arrivals": {"process": "poisson", "rate_per_s": 1},
                    "prompt_tokens": {"dist": "fixed", "value": 3},
                    "output_tokens": {"dist": "fixed", "value": 2},
                }
            },
        }
    )
    report = build_report(scenario, [], seed=1, machine={}, created_at="now")
    md = render_markdown({**report, "plots": ["cdf-normal.png"], "plots_dir": "benchmarks/out/x"})
    assert "![" not in md
    assert "- `cdf-normal.png`" in md
    assert "`benchmarks/out/x`" in md
    assert "rerun the command" in md
