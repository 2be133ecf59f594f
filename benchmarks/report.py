"""Writing a comparison report: `report.json` (everything, machine-readable), `report.md`
(side-by-side tables, one column per target) and the raw records as JSONL per target (in
`benchmarks.outputs.bulk_dir(out_dir)`: not committed under `benchmarks/results/`).

`build_report` is pure (summaries in, a dict out); `write_report` does the file I/O;
`render_markdown` turns the dict into tables. The machine description comes from
`describe_machine` (CPU model, cores, memory, OS, Python; GPUs via `nvidia-smi` when present).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.outputs import bulk_path
from benchmarks.records import TargetResult
from router.simulate.scenario import Scenario

__all__ = [
    "build_report",
    "describe_machine",
    "render_markdown",
    "safe_name",
    "write_records",
    "write_report",
]


def safe_name(name: str) -> str:
    """A file-name-safe form of a target name."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "target"


def describe_machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "cpu_cores": os.cpu_count(),
        "cpu_model": platform.processor() or None,
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            ).stdout
            info["gpus"] = [line.strip() for line in out.splitlines() if line.strip()]
        except (OSError, subprocess.TimeoutExpired):
            pass
    info.setdefault("gpus", [])
    return info


def build_report(
    scenario: Scenario,
    summaries: Sequence[dict[str, Any]],
    *,
    seed: int,
    machine: dict[str, Any],
    created_at: str,
    notes: str = "",
) -> dict[str, Any]:
    return {
        "scenario": {
            "name": scenario.name,
            "source": scenario.source,
            "description": scenario.description,
            "seed": seed,
            "duration_s": scenario.duration_s,
            "drain_timeout_s": scenario.drain_timeout_s,
            "classes": {c.name: {"kind": c.kind, "slo": c.slo.as_dict()} for c in scenario.classes},
            "definition": scenario.raw,
        },
        "created_at": created_at,
        "machine": machine,
        "notes": notes,
        "targets": list(summaries),
    }


def _rounded(value: Any) -> Any:
    """Floats to 3 decimals (µs for ms values, ms for s offsets): a third of the file size."""
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def write_records(out_dir: Path, result: TargetResult) -> Path:
    """One JSON line per request (`"type": "request"`) and per agent run (`"type": "run"`), in
    `bulk_dir(out_dir)`."""
    path = bulk_path(out_dir, f"records-{safe_name(result.name)}.jsonl")
    with path.open("w") as f:
        for r in result.requests:
            f.write(json.dumps({"type": "request", **_rounded(r.to_json())}) + "\n")
        for run in result.runs:
            f.write(json.dumps({"type": "run", **_rounded(run.to_json())}) + "\n")
    return path


def write_report(out_dir: Path, report: dict[str, Any]) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "report.json"
    json_path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    md_path = out_dir / "report.md"
    md_path.write_text(render_markdown(report))
    return json_path, md_path


# --- markdown -------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}"
    return str(value)


def _get(data: dict[str, Any], *path: str) -> Any:
    cur: Any = data
    for key in path:
        if not isinstance(cur, dict) or key not in cur:
            return None
        cur = cur[key]
    return cur


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return [*lines, ""]


def render_markdown(report: dict[str, Any]) -> str:
    sc = report["scenario"]
    targets: list[dict[str, Any]] = report["targets"]
    names = [t["name"] for t in targets]
    m = report["machine"]
    lines = [
        f"# Benchmark: {sc['name']}",
        "",
        f"{sc['description']}".strip(),
        "",
        f"- scenario `{sc['source']}`, seed {sc['seed']}, arrivals for {sc['duration_s']:g} s, "
        f"drain timeout {sc['drain_timeout_s']:g} s; run {report['created_at']}",
        f"- machine: {m.get('cpu_model')}, {m.get('cpu_cores')} cores, "
        f"{m.get('memory_gib')} GiB, GPUs: {', '.join(m.get('gpus') or []) or 'none'}; "
        f"{m.get('os')}, Python {m.get('python')}",
        "- targets: " + "; ".join(f"**{t['name']}** {t['url']}" for t in targets),
    ]
    if report.get("notes"):
        lines += ["", report["notes"].strip()]
    lines += ["", "## Overall", ""]
    overall_rows = [
        ["requests sent", *[_fmt(t["requests"]) for t in targets]],
        ["wall time (s)", *[_fmt(t["wall_s"]) for t in targets]],
        ["goodput (req/s, all SLOs met)", *[_fmt(t["goodput_rps"], 2) for t in targets]],
        ["SLO attainment", *[_pct(t["slo_attainment_frac"]) for t in targets]],
        ["cancelled at drain", *[_fmt(t["cancelled_at_drain"]) for t in targets]],
        [
            "machine load avg (1 min) before / after",
            *[
                " / ".join(_fmt(_get(t, "load_avg_1m", k), 2) for k in ("before", "after"))
                for t in targets
            ],
        ],
        [
            "harness send lag p50 / p99 / max (ms)",
            *[
                " / ".join(_fmt(_get(t, "send_lag_ms", k)) for k in ("p50", "p99", "max"))
                for t in targets
            ],
        ],
    ]
    lines += _table(["", *names], overall_rows)

    classes = sc["classes"]
    lines += ["## Goodput and SLO attainment per class", ""]
    rows = []
    for cls, meta in classes.items():
        slo = ", ".join(f"{k.removesuffix('_ms')} ≤ {v:g} ms" for k, v in meta["slo"].items())
        for label, key, digits in (
            ("requests", "requests", 0),
            ("ok", "ok", 0),
            ("rejected (429)", "rejected_429", 0),
            ("goodput (req/s)", "goodput_rps", 2),
            ("output tokens/s", "output_tokens_per_s", 0),
        ):
            rows.append(
                [cls, label, *[_fmt(_get(t, "classes", cls, key), digits) for t in targets]]
            )
        rows.append(
            [
                cls,
                f"SLO attainment ({slo or 'no SLO'})",
                *[_pct(_get(t, "classes", cls, "slo_attainment_frac")) for t in targets],
            ]
        )
        for metric in meta["slo"]:
            rows.append(
                [
                    cls,
                    f"  meets {metric.removesuffix('_ms')}",
                    *[
                        _pct(_get(t, "classes", cls, "slo_attainment_by_metric", metric))
                        for t in targets
                    ],
                ]
            )
    lines += _table(["class", "", *names], rows)

    lines += ["## Latency per class (ms, completed requests)", ""]
    rows = []
    for cls in classes:
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            for p in ("p50", "p90", "p95", "p99"):
                rows.append(
                    [
                        cls,
                        f"{metric.removesuffix('_ms').upper()} {p}",
                        *[_fmt(_get(t, "classes", cls, metric, p)) for t in targets],
                    ]
                )
    lines += _table(["class", "metric", *names], rows)

    run_classes = [c for c, meta in classes.items() if meta["kind"] == "agent"]
    if run_classes:
        lines += ["## Agent runs", ""]
        rows = []
        for cls in run_classes:

            def run_val(t: dict[str, Any], *path: str, c: str = cls) -> Any:
                return _get(t, "runs", c, *path)

            spec: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
                ("runs started", lambda t: _fmt(run_val(t, "runs"))),
                ("completed", lambda t: _fmt(run_val(t, "completed"))),
                (
                    "outcomes",
                    lambda t: (
                        ", ".join(f"{k} {v}" for k, v in (run_val(t, "outcomes") or {}).items())
                        or "–"
                    ),
                ),
                ("steps ok (mean)", lambda t: _fmt(run_val(t, "steps_ok_mean"), 2)),
                ("completion time p50 (s)", lambda t: _fmt(run_val(t, "completion_s", "p50"), 2)),
                ("completion time p95 (s)", lambda t: _fmt(run_val(t, "completion_s", "p95"), 2)),
                ("GPU-seconds per run p50", lambda t: _fmt(run_val(t, "gpu_seconds", "p50"), 3)),
                ("GPU-seconds per run mean", lambda t: _fmt(run_val(t, "gpu_seconds", "mean"), 3)),
                ("runs with GPU-seconds", lambda t: _fmt(run_val(t, "gpu_seconds_reported"))),
            ]
            rows += [[cls, label, *[fn(t) for t in targets]] for label, fn in spec]
        lines += _table(["class", "", *names], rows)

    lines += ["## Failures and rejections (HTTP status, error code)", ""]
    reasons = sorted({k for t in targets for k in t["rejections"]})
    if reasons:
        lines += _table(
            ["reason", *names],
            [[f"`{r}`", *[_fmt(t["rejections"].get(r, 0)) for t in targets]] for r in reasons],
        )
    else:
        lines += ["none", ""]
    plots = report.get("plots") or []
    if plots:
        where = report.get("plots_dir") or "the report's folder"
        lines += [
            "## Plots",
            "",
            f"Written to `{where}` with the raw records, not committed: rerun the command that"
            " wrote this report to regenerate them.",
            "",
            *[f"- `{p}`" for p in plots],
            "",
        ]
    return "\n".join(lines)


def _pct(value: Any) -> str:
    return "–" if value is None else f"{100 * float(value):.1f} %"
