"""`gpupool pools ...` against a router served over real HTTP (engines are not contacted)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pools.testing.serve import serve_asgi
from router.cli import main
from router.gateway.app import Gateway
from tests.unit import test_rebalance_shell as shell
from tests.unit.test_rebalance_shell import Clock, config

make_gateway = shell.make_gateway  # the fixture


async def run_cli(argv: list[str]) -> int:
    return await asyncio.to_thread(main, argv)


async def test_pools_cli_round_trip(
    tmp_path: Path, make_gateway: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    clock = Clock()
    gw: Gateway = await make_gateway(config(tmp_path), clock)
    async with serve_asgi(gw) as url:
        assert await run_cli(["pools", "set-bounds", "agent", "--floor", "0.25", "--url", url]) == 0
        assert await run_cli(["pools", "pin", "agent=0.5", "--url", url]) == 0
        out = capsys.readouterr().out
        assert "ratio pinned" in out
        assert await run_cli(["pools", "show", "--json", "--url", url]) == 0
        view = json.loads(capsys.readouterr().out)
        assert view["rebalancer"]["target_shares"] == {"agent": 0.5, "normal": 0.5}
        assert view["rebalancer"]["bounds"]["agent"] == [0.25, 0.7]
        assert await run_cli(["pools", "unpin", "--url", url]) == 0
        assert await run_cli(["pools", "freeze", "--url", url]) == 0
        assert "FROZEN" in capsys.readouterr().out
        # a share move beyond the ceiling: refused, the router's reason printed, exit 2
        code = await run_cli(
            ["pools", "move", "--from", "normal", "--to", "agent", "--share", "0.4", "--url", url]
        )
        assert code == 2
        assert "outside its bounds" in capsys.readouterr().err
        normal = gw.pool_map.current.instances_for("normal")[0]
        lease = gw.fleet.acquire(normal, "normal", blocks=1)  # a chat sequence still running
        argv = ["pools", "move", "--instance", normal, "--to", "agent", "--url", url]
        assert await run_cli(argv) == 0
        capsys.readouterr()
        assert await run_cli(["pools", "decisions", "--moves-only", "--json", "--url", url]) == 0
        rows = json.loads(capsys.readouterr().out)["data"]
        assert rows[0]["kind"] == "forced" and rows[0]["who"] == "local"
        assert rows[0]["move"]["to_pool"] == "agent"
        assert await run_cli(["pools", "show", "--url", url]) == 0
        assert f"draining {normal}: normal -> agent" in capsys.readouterr().out
    assert normal in gw.pool_map.current.draining
    lease.release()
    assert normal in gw.pool_map.current.instances_for("agent")


async def test_pools_cli_bad_input_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert await run_cli(["pools", "pin", "agent:0.5", "--url", "http://127.0.0.1:9"]) == 2
    assert "expected POOL=FRAC" in capsys.readouterr().err
    assert await run_cli(["pools", "show", "--url", "http://127.0.0.1:9"]) == 1
    assert "cannot reach the router" in capsys.readouterr().err
