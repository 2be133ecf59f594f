"""The router-overhead benchmark's `--check` (issue 28): gpupool's CPU per request at c=64
against the Rust router's in the same run; a failure exits 1, a run without either exits 2.
And the flame graphs it writes beside the report."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Any

from benchmarks.router_overhead import flame
from benchmarks.router_overhead.cli import _check
from benchmarks.router_overhead.report import _rust_table, against_rust


def _target(name: str, cpu_req_us: float, cpu_chunk_us: float, added_ms: float) -> dict[str, Any]:
    return {
        "name": name,
        "status": "ok",
        "c1": {"added_p50_ms": added_ms},
        "hi": {"cpu_us_per_unit": cpu_req_us},
        "stream": {"cpu_us_per_unit": cpu_chunk_us},
    }


def _result(gpupool_us: float) -> dict[str, Any]:
    targets = [_target("gpupool", gpupool_us, 20.0, 0.4), _target("vllm-router", 100.0, 15.0, 0.2)]
    return {"targets": targets, "against_rust": against_rust(targets)}


def test_within_the_ratio_passes_and_over_it_fails() -> None:
    assert _check(_result(249.0)) == 0
    assert _check(_result(251.0)) == 1
    rows = {r["bar"]: r for r in _result(251.0)["against_rust"]}
    assert rows["CPU per non-streaming request at c=64"]["ratio"] == 2.51
    assert rows["CPU per streamed chunk"]["met"]  # 20 / 15 = 1.33 <= 1.5
    assert rows["added p50 at c=1"]["met"]  # 0.4 ms <= 0.5 ms, an absolute bar


def test_without_the_rust_router_it_cannot_compare() -> None:
    targets = [
        _target("gpupool", 200.0, 20.0, 0.4),
        {"name": "vllm-router", "status": "unavailable", "reason": "not installed"},
    ]
    result = {"targets": targets, "against_rust": against_rust(targets)}
    assert result["against_rust"] == []
    assert _check(result) == 2


def test_the_report_shows_the_bars() -> None:
    rows = _result(300.0)["against_rust"]
    lines = [line for line in _rust_table(rows) if line.startswith("| CPU per non-streaming")]
    assert lines and "3.00 ×" in lines[0] and "**no**" in lines[0]


def test_the_flame_graph_keeps_what_is_large_and_says_what_it_left_out() -> None:
    raw = "\n".join(
        [
            "main (router/cli/stack.py:10);serve (router/gateway/proxy.py:20) 90",
            "main (router/cli/stack.py:10);serve (router/gateway/proxy.py:21) 9",
            "main (router/cli/stack.py:10);tiny (x.py:1) 1",
        ]
    )
    svg = flame.render_svg(raw, "t", min_frac=0.05)
    root = ET.fromstring(svg)
    titles = [el.text or "" for el in root.iter("{http://www.w3.org/2000/svg}title")]
    assert titles[0].startswith("main (cli/stack.py): 100 samples")
    assert any(t.startswith("serve (gateway/proxy.py): 99 samples") for t in titles)  # lines merged
    assert not any(t.startswith("tiny") for t in titles)  # 1 % < 5 %
