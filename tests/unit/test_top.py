"""`gpupool top --once` against a live router (fake engines behind real HTTP, after traffic):
it shows every pool and instance with the numbers `/admin/pools` gives, the costliest runs,
latency by class; a refused key, an unreachable router and bad options get their exit codes.
The drawing is also checked alone on a hand-made snapshot with a rebalancer."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from rich.console import Console

from router.cli import main
from router.cli.commands.top import Snapshot, render, sparkline
from router.ops.history import History
from tests.unit.test_hostile_rig import (
    ADMIN_KEY,
    TENANT_KEY,
    LiveRouter,
    hostile_config,
    live_router,
)


@pytest.fixture(scope="module")
def busy_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRouter]:
    with live_router(hostile_config(tmp_path_factory.mktemp("top")), itl_s=0.002) as router:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        for i in range(6):
            headers = {
                "authorization": f"Bearer {TENANT_KEY}",
                "x-gpupool-class": "agent" if i % 2 else "normal",
                "x-gpupool-run-id": f"top-run-{i % 3}",
            }
            resp = httpx.post(
                f"{router.url}/v1/chat/completions",
                json={**body, "max_tokens": 4 + 4 * i},
                headers=headers,
                timeout=30,
            )
            assert resp.status_code == 200
        router.run(_sample(router.gateway.history))  # an interval with latency in it
        yield router


async def _sample(history: History) -> None:
    history.sample_once()


def _top(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["top", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _section(out: str, title: str) -> str:
    """The lines of the table titled `title` (titles start at column 0, rows are indented)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == title)
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i][:1] not in ("", " ", "─")),
        len(lines),
    )
    return "\n".join(lines[start + 1 : end])


def _row(out: str, first: str) -> str:
    rows = [line for line in out.splitlines() if line.split()[:1] == [first]]
    assert len(rows) == 1, (first, out)
    return rows[0]


def test_once_shows_the_pools_and_instances_as_admin_pools_has_them(
    busy_router: LiveRouter, capsys: pytest.CaptureFixture[str]
) -> None:
    url = busy_router.url
    code, out, err = _top(capsys, "--url", url, "--api-key", ADMIN_KEY, "--once", "--width", "220")
    assert code == 0, err
    view = httpx.get(f"{url}/admin/pools", headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()
    assert set(view["pools"]) == {"agent", "normal"}
    for name, pool in view["pools"].items():
        row = _row(_section(out, "pools"), name)
        assert f"{pool['share_frac'] * 100:.1f} %" in row  # 50.0 % each (hostile_config)
        assert f"{pool['healthy_instances']} / {len(pool['instances'])}" in row
        assert f"{pool['queue']['depth']} / {pool['queue']['max_depth']}" in row
        slo = pool["slo"]
        assert f"{slo['ttft_p95_ms']:.0f} / {slo['tpot_p95_ms']:.0f} ms" in row
    for iid, inst in view["instances"].items():
        row = _row(out, iid)
        assert ("unhealthy" not in row) == inst["healthy"]
        assert f"{inst['kv_reserved_blocks']} blk" in row
        assert f"{inst['operating_point']['limit']} {inst['operating_point']['source']}" in row
        for pool, frac in inst["pools"].items():
            if frac:
                assert f"{pool} {frac * 100:.0f} %" in row
    # the header carries the ratio
    assert "agent 50.0 % · normal 50.0 %" in out.splitlines()[0]


def test_once_lists_the_costliest_runs_and_the_latency_by_class(
    busy_router: LiveRouter, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _top(
        capsys, "--url", busy_router.url, "--api-key", ADMIN_KEY, "--once", "--top", "2"
    )
    assert code == 0
    acc = httpx.get(
        f"{busy_router.url}/admin/accounting",
        params={"top": 2},
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
    ).json()
    shown = [line.split()[0] for line in out.splitlines() if line.strip().startswith("top-run-")]
    assert shown == [r["run_id"] for r in acc["top_runs"]] and len(shown) == 2
    for run in acc["top_runs"]:
        assert f"{run['gpu_seconds']:.2f}" in _row(out, run["run_id"])
    tenant = _row(out, "team-a")
    assert f"{acc['ledger']['by_tenant']['team-a']['gpu_seconds']:.2f}" in tenant
    assert "100.0 %" in tenant  # the only tenant
    # both classes streamed in the sampled interval: each has a TTFT figure in ms
    for cls in ("agent", "normal"):
        figures = _row(_section(out, "latency by class (latest interval)"), cls)
        assert re.search(r"\d+ ms", figures), figures


def test_a_refused_key_an_unreachable_router_and_bad_options(
    busy_router: LiveRouter, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _top(capsys, "--url", busy_router.url, "--api-key", TENANT_KEY, "--once")
    assert code == 2 and out == ""
    assert "refused the API key (403)" in err
    code, _, err = _top(capsys, "--url", busy_router.url, "--once")  # no key at all
    assert code == 2 and "(401)" in err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens once the socket is closed
    code, _, err = _top(capsys, "--url", f"http://127.0.0.1:{closed}", "--once")
    assert code == 1 and "cannot reach" in err
    code, _, err = _top(capsys, "--url", busy_router.url, "--once", "--top", "0")
    assert code == 2 and "--top" in err


def test_sparkline_maps_values_onto_eight_levels() -> None:
    assert sparkline([0.0, 0.5, 1.0, None, 2.0, -1.0]) == "▁▅█ █▁"
    assert sparkline([0.25] * 40) == "▃" * 24  # the last 24 only


def test_render_shows_the_rebalancer_and_its_decisions() -> None:
    pools: dict[str, Any] = {
        "allocation_version": 7,
        "admission": "on",
        "pools": {
            "agent": {
                "share_frac": 0.25,
                "floor_frac": 0.15,
                "ceiling_frac": 0.4,
                "healthy_instances": 1,
                "instances": {"e0": 1.0},
                "queue": {"depth": 3, "max_depth": 64, "drain_rate_per_s": 1.5},
                "slo": {"ttft_p95_ms": 3000, "tpot_p95_ms": 150},
            }
        },
        "instances": {
            "e0": {
                "healthy": False,
                "pools": {"agent": 1.0},
                "kv_usage_frac": 0.5,
                "num_gpu_blocks": 200,
                "kv_reserved_blocks": 30,
                "running": 4,
                "waiting": 2,
                "inflight": 6,
                "operating_point": {"limit": 12, "source": "measured"},
                "telemetry_age_s": 0.4,
                "preemptions_seen": 1,
            }
        },
        "rebalancer": {
            "enabled": True,
            "frozen": False,
            "moves": 2,
            "smoothed_pressure": {"agent": 1.25},
            "draining": {"e1": {"from_pool": "normal", "to_pool": "agent"}},
        },
    }
    decisions = {
        "data": [
            {"at_unix_s": 100.0, "kind": "within_hysteresis", "reason": "within_hysteresis"},
            {
                "at_unix_s": 200.0,
                "kind": "auto",
                "who": "loop",
                "reason": "moved",
                "move": {"from_pool": "normal", "to_pool": "agent", "share_frac": 0.05},
                "smoothed_pressure": {"agent": 1.25, "normal": 0.1},
            },
        ]
    }
    snap = Snapshot("http://r", 0.0, 5, pools, None, None, decisions)
    console = Console(record=True, width=200)
    console.print(render(snap))
    text = console.export_text()
    assert "rebalancer on, 2 moves, draining e1 normal→agent" in text
    agent = _row(_section(text, "pools"), "agent")
    assert "25.0 %" in agent and "15.0 % – 40.0 %" in agent and "1.25" in agent
    assert "3 / 64" in agent and "1.50" in agent
    e0 = _row(text, "e0")
    assert "unhealthy" in e0 and "30 blk (15.0 %)" in e0 and "12 measured" in e0
    moves = [line for line in text.splitlines() if "→" in line and "draining" not in line]
    assert len(moves) == 1 and "normal → agent 5.0 %" in moves[0]
    assert "agent 1.25, normal 0.10" in moves[0] and "auto: moved (loop)" in moves[0]
    assert text.index("normal → agent") < text.index("no move")  # newest first
    held = next(line for line in text.splitlines() if "no move" in line)
    assert "within_hysteresis" in held and "within_hysteresis:" not in held
    assert "top runs" not in text  # no accounting in this snapshot


def test_the_command_is_listed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert re.search(r"\btop\b.*live pools", capsys.readouterr().out)
