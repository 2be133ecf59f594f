"""`gpupool runs` (router/cli/commands/runs.py): reading the ledger file, and a router's API through
httpx's MockTransport (no patching, no network)."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.accounting.ledger import Ledger, RequestRecord
from router.cli.commands import runs

T0 = 1_750_000_000.0


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpupool")
    runs.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def invoke(argv: list[str], transport: httpx.BaseTransport | None = None) -> int:
    return runs.run_command(parse(argv), transport=transport)


def record(run_id: str | None, tenant: str, k: int, **changes: Any) -> RequestRecord:
    fields: dict[str, Any] = {
        "request_id": f"{tenant}-{run_id}-{k}",
        "run_id": run_id,
        "step_index": None,
        "tenant": tenant,
        "class_name": "agent" if run_id else "normal",
        "pool": "agent" if run_id else "normal",
        "instance": "i0",
        "model": "tiny",
        "started_at_s": T0 + 10 * k,
        "ended_at_s": T0 + 10 * k + 3,
        "queue_s": 0.25,
        "ttft_s": 0.2,
        "tpot_s": 0.015,
        "prompt_tokens": 1000 + k,
        "completion_tokens": 50,
        "gpu_seconds": 1.25 * (k + 1),
        "outcome": "ok",
        "status_code": 200,
    }
    fields.update(changes)
    return RequestRecord(**fields)


@pytest.fixture(scope="module")
def ledger_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ledger") / "ledger.sqlite"

    async def write() -> None:
        ledger = Ledger(path, clock=lambda: T0)
        await ledger.start()
        for k in range(3):
            ledger.submit(record("run-a", "team-a", k))
        ledger.submit(record("run-b", "team-b", 0, outcome="engine_error", status_code=502))
        ledger.submit(record(None, "team-b", 1))
        await ledger.aclose()

    asyncio.run(write())
    return path


def test_overview_from_the_file(ledger_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert invoke(["runs", "--ledger", str(ledger_file)]) == 0
    out = capsys.readouterr().out
    assert "requests 5 (engine_error 1, ok 4)" in out
    assert "top 2 runs by GPU-seconds" in out
    lines = out.splitlines()
    first_run = lines.index("top 2 runs by GPU-seconds") + 2
    assert lines[first_run].startswith("run-a") and "team-a" in lines[first_run]


def test_overview_json_tenant_and_top(
    ledger_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["runs", "--ledger", str(ledger_file), "--json", "--tenant", "team-b", "--top", "1"]
    assert invoke(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["object"] == "gpupool.accounting"
    assert [r["run_id"] for r in report["top_runs"]] == ["run-b"]
    assert report["ledger"]["by_tenant"]["team-a"]["gpu_seconds"] == pytest.approx(7.5)


def test_show_a_run(ledger_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert invoke(["runs", "show", "run-a", "--ledger", str(ledger_file)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("run run-a  tenant team-a")
    assert "GPU-seconds 7.500" in out
    assert sum(1 for line in out.splitlines() if "team-a-run-a-" in line) == 3

    # options before `show` are kept
    assert invoke(["runs", "--ledger", str(ledger_file), "--json", "show", "run-a"]) == 0
    run = json.loads(capsys.readouterr().out)
    assert [r["step_index"] for r in run["requests"]] == [0, 1, 2]


def test_unknown_run_and_other_tenants_run_exit_1(
    ledger_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert invoke(["runs", "show", "nope", "--ledger", str(ledger_file)]) == 1
    assert "run 'nope' not found" in capsys.readouterr().err
    assert (
        invoke(["runs", "show", "run-a", "--tenant", "team-b", "--ledger", str(ledger_file)]) == 1
    )


def test_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert invoke(["runs", "--ledger", str(tmp_path / "missing.sqlite")]) == 2
    assert "no ledger file" in capsys.readouterr().err
    assert invoke(["runs", "--ledger", str(tmp_path / "missing.sqlite"), "--top", "0"]) == 2
    with pytest.raises(SystemExit) as exc:
        parse(["runs", "--ledger", "x", "--url", "http://h"])
    assert exc.value.code == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools: {}\n")
    assert invoke(["runs", "--config", str(bad)]) == 2
    assert "invalid config" in capsys.readouterr().err


def test_ledger_path_from_config(
    ledger_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "gpupool.yaml"
    config.write_text(
        "pools:\n"
        "  agent: {classes: [agent], share: {initial_frac: 0.5}}\n"
        "  normal: {classes: [normal], share: {initial_frac: 0.5}}\n"
        f"router: {{ledger_path: {json.dumps(str(ledger_file))}}}\n"
    )
    assert invoke(["runs", "--config", str(config), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ledger"]["requests"] == 5


# --- through a router's API -------------------------------------------------------------------


class FakeRouter:
    """Answers like the router's admin and run endpoints, from canned bodies."""

    def __init__(self, report: dict[str, Any], run: dict[str, Any], status: int = 200) -> None:
        self.report, self.run, self.status = report, run, status
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.status != 200:
            return httpx.Response(self.status, json={"error": {"message": "no"}})
        if request.url.path == "/admin/accounting":
            return httpx.Response(200, json=self.report)
        if request.url.path == f"/v1/runs/{self.run['run_id']}":
            return httpx.Response(200, json=self.run)
        return httpx.Response(404, json={"error": {"message": "not found"}})


@pytest.fixture
def fake_router(ledger_file: Path, capsys: pytest.CaptureFixture[str]) -> FakeRouter:
    assert invoke(["runs", "--ledger", str(ledger_file), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    report["live"] = {
        "capacity_gpu_seconds": 10.0,
        "attributed_gpu_seconds": 4.0,
        "idle_gpu_seconds": 6.0,
        "rel_error": 0.0,
        "in_flight_sequences": 1,
    }
    assert invoke(["runs", "show", "run-a", "--ledger", str(ledger_file), "--json"]) == 0
    run = json.loads(capsys.readouterr().out)
    return FakeRouter(report, run)


def test_url_mode_uses_the_api_and_the_key(
    fake_router: FakeRouter, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    transport = httpx.MockTransport(fake_router)
    argv = ["runs", "--url", "http://router:8000/", "--api-key", "k1", "--top", "3"]
    assert invoke([*argv, "--tenant", "team-a"], transport) == 0
    out = capsys.readouterr().out
    assert "live (this router): capacity 10.00 GPU-s" in out
    sent = fake_router.requests[-1]
    assert sent.headers["authorization"] == "Bearer k1"
    assert dict(sent.url.params) == {"top": "3", "tenant": "team-a"}

    monkeypatch.setenv("GPUPOOL_API_KEY", "from-env")
    assert invoke(["runs", "show", "run-a", "--url", "http://router:8000"], transport) == 0
    assert "GPU-seconds 7.500" in capsys.readouterr().out
    assert fake_router.requests[-1].headers["authorization"] == "Bearer from-env"
    assert invoke(["runs", "show", "other", "--url", "http://router:8000"], transport) == 1


def test_url_mode_errors(fake_router: FakeRouter) -> None:
    fake_router.status = 401
    assert invoke(["runs", "--url", "http://r"], httpx.MockTransport(fake_router)) == 2
    fake_router.status = 500
    assert invoke(["runs", "--url", "http://r"], httpx.MockTransport(fake_router)) == 1

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    assert invoke(["runs", "--url", "http://r"], httpx.MockTransport(refuse)) == 1
