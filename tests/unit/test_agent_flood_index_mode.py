"""benchmarks.agent_flood_admission: the routers' configs per mode and the run order."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from benchmarks.agent_flood_admission import (
    COMPARES,
    PIN_CPUS,
    ROUTER_PORTS,
    _cpu_cell,
    _markdown,
    _quantiles,
    check_pinned,
    main,
    process_cpu_s,
    router_config,
    run_order,
    tree_cpu_s,
)
from pools.config import parse_config
from pools.launchers import InstanceSpec
from pools.launchers.base import KvEventsSpec

BASE: dict[str, Any] = {
    "model": {"name": "tiny", "path": "/m", "max_model_len_tokens": 4096},
    "pools": {"normal": {"classes": ["normal", "agent"], "share": {"initial_frac": 1}}},
}


def _specs(events: bool = True) -> list[InstanceSpec]:
    return [
        InstanceSpec(
            instance_id=f"engine-{i}",
            url=f"http://127.0.0.1:{8401 + i}",
            gpus=1,
            kv_events=KvEventsSpec(
                endpoint=f"ipc:///run/engine-{i}.kv-pub",
                replay_endpoint=f"ipc:///run/engine-{i}.kv-replay",
                hash_seed="7",
            )
            if events
            else None,
        )
        for i in range(3)
    ]


def _parsed(mode: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("GPUPOOL_BENCH_ENGINE_KEY", "k")
    return parse_config(router_config(mode, _specs(), Path("/s"), BASE))


def test_index_on_follows_every_engines_kv_events(monkeypatch: pytest.MonkeyPatch) -> None:
    config = _parsed("index-on", monkeypatch)
    assert config.engines.kv_events_on
    assert config.router.admission == "on"
    assert [
        (e.url, e.endpoint, e.replay_endpoint, e.hash_seed) for e in config.engines.static.kv_events
    ] == [
        (
            f"http://127.0.0.1:{8401 + i}",
            f"ipc:///run/engine-{i}.kv-pub",
            f"ipc:///run/engine-{i}.kv-replay",
            "7",
        )
        for i in range(3)
    ]


@pytest.mark.parametrize(
    ("mode", "admission"),
    [("index-off", "on"), ("admission-on", "on"), ("admission-off", "off")],
)
def test_other_modes_follow_no_kv_events(
    mode: str, admission: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _parsed(mode, monkeypatch)
    assert not config.engines.kv_events_on
    assert config.engines.static.kv_events == ()
    assert config.router.admission == admission
    assert config.router.ledger_path.name == f"ledger-{mode}.sqlite"


def test_index_hold_is_index_on_with_the_tool_pause_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    config = _parsed("index-hold", monkeypatch)
    assert config.engines.kv_events_on and config.router.admission == "on"
    assert config.admission.tool_pause_hold
    assert not _parsed("index-on", monkeypatch).admission.tool_pause_hold
    assert not _parsed("index-off", monkeypatch).admission.tool_pause_hold


def test_index_gate_holds_the_paused_runs_against_new_runs_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    adm = _parsed("index-gate", monkeypatch).admission
    assert adm.tool_pause_hold and adm.tool_pause_hold_against == "new_runs"
    assert adm.tool_pause_max_frac == 0.5
    assert _parsed("index-hold", monkeypatch).admission.tool_pause_hold_against == "all"


def test_run_order_of_three_modes_puts_first_first_and_reverses_each_other_round() -> None:
    assert run_order("hold", None, 2) == [
        "index-off",
        "index-on",
        "index-hold",
        "index-hold",
        "index-on",
        "index-off",
    ]
    assert run_order("hold", "index-hold", 1) == ["index-hold", "index-off", "index-on"]


def test_index_on_refuses_an_engine_that_publishes_nothing() -> None:
    with pytest.raises(ValueError, match="publishes no KV events"):
        router_config("index-on", _specs(events=False), Path("/s"), BASE)


def test_every_mode_has_its_own_router_port() -> None:
    modes = {m for pair in COMPARES.values() for m in pair}
    assert sorted(modes) == sorted(ROUTER_PORTS)
    assert len(set(ROUTER_PORTS.values())) == len(ROUTER_PORTS)


def test_run_order_alternates_within_the_compared_pair() -> None:
    assert run_order("index", None, 3) == [
        "index-on",
        "index-off",
        "index-off",
        "index-on",
        "index-on",
        "index-off",
    ]
    assert run_order("admission", "admission-off", 2) == [
        "admission-off",
        "admission-on",
        "admission-on",
        "admission-off",
    ]
    with pytest.raises(ValueError, match="--first"):
        run_order("index", "admission-on", 2)


def test_a_first_mode_outside_the_comparison_fails_before_engines_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--first"):
        main(["--out", str(tmp_path), "--compare", "index", "--first", "admission-off"])


def test_a_run_without_agent_runs_reports_dashes_not_a_crash() -> None:
    """A short run (--duration-s 15) has no agent runs: the report's distributions are None."""
    no_values = _quantiles(None, ("p50", "p90", "p95"))
    assert no_values == {"p50": None, "p90": None, "p95": None}
    result = {
        "mode": "index-on",
        "chat": {
            "slo_attainment": 1.0,
            "ttft_ms": {"p50": 10.0, "p95": 20.0, "p99": 30.0},
            "rejected_429": 0,
        },
        "agent_steps": {
            "ok": 0,
            "requests": 0,
            "rejected_429": 0,
            "ttft_ms": _quantiles(None, ("p50", "p95", "p99")),
            "output_tokens_per_s": 0.0,
        },
        "agent_runs": {"completion_s": no_values},
        "engines": {"e0": {"role": "agent", "preemptions": 0.0}},
        "prefix_hit_frac": 0.25,
        "rejections_by_reason": {},
    }
    args = argparse.Namespace(compare="index", rate_scale=1.0, fresh_engines=False)
    row = _markdown([result], args).splitlines()[-1]
    assert row.startswith("| 1 | index-on | 100.0% | 10 / 20 / 30 | 0 | 0/0 | 0 | - | 0 | - / - |")
    assert "| 25.0% |" in row


def test_the_cpu_cell_splits_engines_by_role_and_routers_by_who_served() -> None:
    result = {
        "mode": "index-on",
        "engines": {
            "a": {"role": "agent", "cpu_s": 100.4},
            "n0": {"role": "normal", "cpu_s": 30.0},
            "n1": {"role": "normal", "cpu_s": 12.0},
        },
        "router_cpu_s": {"index-off": 1.0, "index-on": 25.2, "index-hold": 4.0},
    }
    assert _cpu_cell(result) == "100 / 42 / 25 / 5"
    del result["router_cpu_s"]
    assert _cpu_cell(result) == "-"  # a result recorded before routers' CPU was


def test_process_cpu_counts_this_process_and_zero_for_one_gone() -> None:
    import os
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    cpu = process_cpu_s({"me": os.getpid(), "gone": gone.pid})
    assert cpu["me"] > 0.0 and cpu["gone"] == 0.0


def test_prefix_caches_are_emptied_before_a_run_with_retries_while_vllm_refuses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each engine gets `POST /reset_prefix_cache` with the engines' key; vLLM's `success:
    false` (blocks still in use) is retried; an engine that never empties its cache is an
    error, not a run that starts warm."""
    import httpx

    from benchmarks import agent_flood_admission as afa

    answers = {"http://e0": [False, True], "http://e1": [True], "http://e2": [False] * 3}
    calls: list[tuple[str, str]] = []

    def post(url: str, headers: dict[str, str], timeout: float) -> httpx.Response:
        engine = url.removesuffix("/reset_prefix_cache")
        calls.append((engine, headers["authorization"]))
        return httpx.Response(200, json={"success": answers[engine].pop(0)})

    monkeypatch.setattr(httpx, "post", post)  # what the benchmark calls
    afa.reset_prefix_caches(["http://e0", "http://e1"], "k", wait_s=0)
    assert calls == [("http://e0", "Bearer k")] * 2 + [("http://e1", "Bearer k")]
    with pytest.raises(RuntimeError, match="http://e2 did not empty its prefix cache in 3 tries"):
        afa.reset_prefix_caches(["http://e2"], "k", tries=3, wait_s=0)


def test_a_runs_router_starts_on_empty_state_and_leaves_other_modes_alone(tmp_path: Path) -> None:
    from benchmarks.agent_flood_admission import fresh_router_state

    names = ["ledger-index-on.sqlite", "ledger-index-on.sqlite-wal", "state-index-on.json"]
    names += ["ledger-index-off.sqlite", "state-index-off.json"]
    for name in names:
        (tmp_path / name).write_text("x")
    fresh_router_state(tmp_path, "index-on")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ledger-index-off.sqlite",
        "state-index-off.json",
    ]


def test_pin_check_accepts_the_agent_engine_alone_on_its_cpu() -> None:
    urls = [f"http://127.0.0.1:{8401 + i}" for i in range(3)]
    # PIN_CPUS puts engines 0 and 1 on CPU 0 and engine 2 alone on CPU 1
    assert PIN_CPUS == ((0,), (0,), (1,))
    check_pinned(urls[2], urls)
    for shared in urls[:2]:  # a plan that gave the agent pool a shared engine is refused
        with pytest.raises(RuntimeError, match="--pin: the agent pool's engine is"):
            check_pinned(shared, urls)


# a parent that sleeps while its child burns 0.5 s of CPU, then both sleep; the child says when
BURNING_CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time\\n"
    "while time.process_time() < 0.5: pass\\nprint('done', flush=True)\\ntime.sleep(60)"],
    stdout=sys.stdout)
time.sleep(60)
"""


def test_engine_cpu_counts_the_engine_core_child() -> None:
    """vLLM's EngineCore runs the model's steps in a child of the API server: an engine's CPU
    is the whole tree's, not the API server's alone."""
    parent = subprocess.Popen(
        [sys.executable, "-c", BURNING_CHILD], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        assert parent.stdout.readline().strip() == "done"
        own = psutil.Process(parent.pid).cpu_times()
        assert own.user + own.system < 0.4  # the parent itself only slept
        # the child's 0.5 s on top: /proc counts user and system time in 10 ms ticks, each
        # rounded down, so up to 20 ms of it may not show
        assert tree_cpu_s(parent.pid) >= own.user + own.system + 0.45
    finally:
        for proc in psutil.Process(parent.pid).children(recursive=True):
            proc.kill()
        parent.kill()
        parent.wait()
    assert tree_cpu_s(parent.pid) == 0.0  # gone
