"""The router-overhead benchmark's statistics: percentiles, added latency against the direct
engine, per-round differences, per-unit CPU, the phase summary and the profile folding."""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks.router_overhead.meter import Meter, summarize_phase
from benchmarks.router_overhead.perf_native import dso_label, fold_report
from benchmarks.router_overhead.profile import fold, parse_raw
from benchmarks.router_overhead.report import check_gpupool
from benchmarks.router_overhead.stats import (
    added_latency_ms,
    cpu_us_per_unit,
    median,
    per_round_added_ms,
    percentile,
    rate_per_s,
    summarize,
)


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q: float) -> None:
    samples = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0]
    assert percentile(samples, q) == pytest.approx(float(np.percentile(samples, q)))


def test_percentile_edges() -> None:
    assert math.isnan(percentile([], 50))
    assert percentile([4.0], 99) == 4.0
    assert median([1.0, 2.0, 3.0, 4.0]) == 2.5
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_converts_seconds_to_ms() -> None:
    s = summarize([0.001, 0.002, 0.003])
    assert s.count == 3
    assert s.p50_ms == pytest.approx(2.0)
    assert s.mean_ms == pytest.approx(2.0)
    assert s.p99_ms == pytest.approx(2.98)


def test_added_latency_is_difference_of_percentiles_in_ms() -> None:
    direct = [0.0004, 0.0005, 0.0006]
    target = [0.0009, 0.0010, 0.0011, 0.0050]
    assert added_latency_ms(target, direct, 50) == pytest.approx(1.05 - 0.5)
    # p99 of the target is dominated by its outlier; the direct engine's by its max
    expected = float(np.percentile(target, 99) - np.percentile(direct, 99)) * 1e3
    assert added_latency_ms(target, direct, 99) == pytest.approx(expected)
    assert math.isnan(added_latency_ms([], direct, 50))


def test_per_round_added_pairs_rounds_by_index() -> None:
    direct = [[0.001, 0.001], [0.002, 0.002]]
    target = [[0.0015, 0.0015], [0.0021, 0.0021]]
    assert per_round_added_ms(target, direct, 50) == pytest.approx([0.5, 0.1])
    with pytest.raises(ValueError):
        per_round_added_ms(target[:1], direct, 50)


def test_rates_and_cpu_per_unit() -> None:
    assert rate_per_s(500, 2.0) == 250.0
    assert math.isnan(rate_per_s(5, 0.0))
    assert cpu_us_per_unit(0.5, 1000) == pytest.approx(500.0)
    assert math.isnan(cpu_us_per_unit(0.1, 0))


def test_summarize_phase_against_direct() -> None:
    direct = Meter(rounds=[[0.001] * 10, [0.001] * 10], units=20, window_s=1.0)
    proxy = Meter(
        rounds=[[0.0015] * 10, [0.0017] * 10],
        rates=[12.0, 4.0, 9.0],
        units=20,
        window_s=2.0,
        cpu_s=0.01,
        engine_cpu_s=0.002,
    )
    out = summarize_phase(proxy, direct, proxy=True, idle_s_per_s=0.001)
    assert out["rate_per_s"] == pytest.approx(9.0)  # the median round
    assert out["rate_per_s_pooled"] == pytest.approx(10.0)
    assert out["cpu_us_per_unit_net_of_idle"] == pytest.approx(400.0)
    assert out["cpu_us_per_unit"] == pytest.approx(500.0)
    assert out["engine_cpu_us_per_unit"] == pytest.approx(100.0)
    assert out["added_p50_ms"] == pytest.approx(0.6)
    assert out["added_p50_ms_rounds"] == pytest.approx([0.5, 0.7])
    assert "cpu_us_per_unit" not in summarize_phase(direct, None, proxy=False)


def test_check_gpupool_flags_missed_targets() -> None:
    targets = [
        {
            "name": "gpupool",
            "status": "ok",
            "c1": {"added_p50_ms": 1.5, "cpu_us_per_unit": 800.0},
            "hi": {"cpu_us_per_unit": 400.0},
            "stream": {"cpu_us_per_unit": 20.0},
        }
    ]
    rows = {r["target"]: r for r in check_gpupool(targets)}
    assert not rows["added p50 latency at c=1"]["met"]
    assert rows["added p50 latency at c=1"]["headroom_frac"] == pytest.approx(-0.5)
    assert rows["CPU per forwarded chunk (c=16)"]["met"]
    assert rows["CPU per non-streaming request (c=64)"]["met"]


def test_profile_fold_drops_idle_and_groups_components() -> None:
    raw = "\n".join(
        [
            "main (router/cli.py:1);_run_once (asyncio/base_events.py:1);epoll_wait (libc.so.6) 50",
            "main (router/cli.py:1);handle (router/gateway/proxy.py:10);0x1 (orjson/orjson.so) 3",
            "main (router/cli.py:1);data_received (uvicorn/protocols/http/httptools_impl.py:5);"
            "0x2 (httptools/parser/parser.so) 2",
            "main (router/cli.py:1);post (aiohttp/client.py:9) 4",
            "main (router/cli.py:1);post (aiohttp/client.py:9);send (libc.so.6) 1",
        ]
    )
    out = fold(parse_raw(raw))
    assert out["idle_samples"] == 50
    assert out["busy_samples"] == 10
    comps = {name: n for name, n, _ in out["components"]}
    assert comps == {
        "upstream client (aiohttp, multidict, yarl)": 4,
        "socket syscalls (read/write/send/recv, in the kernel)": 1,
        "JSON (orjson)": 3,
        "HTTP parsing, server side (httptools)": 2,
    }
    assert out["top_self"][0][0] == "post (aiohttp/client.py:9)"
    assert ("(unnamed) (orjson/orjson.so)", 3, 0.3) in out["top_self"]
    assert out["top_python"][0] == ("post (aiohttp/client.py:9)", 5, 0.5)


def test_profile_fold_splits_gpupool_by_its_innermost_part() -> None:
    raw = "\n".join(
        [
            # the innermost gpupool frame decides: estimate.py under the proxy is estimation
            "run_router (router/cli/stack.py:1);__call__ (router/gateway/proxy.py:10);"
            "count (router/admission/estimate.py:3) 4",
            # router/admission but estimate.py, and pools/, are admission
            "run_router (router/cli/stack.py:1);admit (router/admission/admitter.py:5);"
            "acquire (pools/fleet.py:7) 3",
            # a C call made by the request path counts for the request path
            "run_router (router/cli/stack.py:1);__call__ (router/gateway/proxy.py:10);"
            "0x1 (orjson/orjson.so) 2",
            # nothing of gpupool's but the loop's own run: the event loop
            "run_router (router/cli/stack.py:1);0x2 (uvloop/loop.so) 1",
            "_bootstrap (threading.py:1);run (threading.py:2) 1",
            "run_router (router/cli/stack.py:1);epoll_wait (libc.so.6) 9",
        ]
    )
    parts = {name: n for name, n, _ in fold(parse_raw(raw))["parts"]}
    assert parts == {
        "estimation": 4,
        "admission (router/admission, pools/)": 3,
        "request path (router/gateway)": 2,
        "event loop (uvloop's C loop under the CLI's run)": 1,
        "outside gpupool": 1,
    }


def test_perf_report_folds_by_shared_object() -> None:
    by_dso = "\n".join(
        [
            "# Samples: 2K of event 'cpu-clock'",
            "    70.00%  libpython3.11.so.1.0",
            "    12.00%  [kernel.kallsyms]",
            "     5.00%  loop.cpython-311-x86_64-linux-gnu.so",
            "     2.00%  orjson.cpython-311-x86_64-linux-gnu.so",
            "     1.00%  _multidict.cpython-311-x86_64-linux-gnu.so",
            "     1.00%  _http_writer.cpython-311-x86_64-linux-gnu.so",
        ]
    )
    by_sym = "    29.74%  libpython3.11.so.1.0   [.] _PyEval_EvalFrameDefault\n"
    out = fold_report(by_dso, by_sym)
    comps = dict(out["components"])
    assert comps["CPython interpreter (bytecode, objects, GC)"] == pytest.approx(0.70)
    assert comps["kernel (system calls, TCP/IP, scheduling)"] == pytest.approx(0.12)
    assert comps["aiohttp C helpers (multidict, writer, yarl)"] == pytest.approx(0.02)
    assert out["components"][0][0].startswith("CPython")
    assert out["top_symbols"] == [("_PyEval_EvalFrameDefault (libpython3.11.so.1.0)", 0.2974)]
    assert dso_label("mystery.so") == "other (mystery.so)"
