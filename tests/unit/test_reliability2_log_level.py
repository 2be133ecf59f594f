"""`router.log_level` takes effect (issue 23): it was validated and never read (logging
followed `-v`, uvicorn was fixed at warning), so a router configured at debug logged at info.
Now it sets the level of the router's loggers and uvicorn's; `gpupool -v` wins over it (debug).
`gpupool serve` runs as a process against a fake engine (also a process) and serves one
request; its output is read after Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from pools.testing.config import REMOVE, config_data, one_pool
from pools.testing.router_process import RouterProcess, free_port, wait_ready

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pools.testing.fake_engine", "--port", str(port)],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, log, 30, path="/health", interval_s=0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


RUNS = {"debug": ("debug",), "warning": ("warning",), "verbose": ("error", "-v")}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory, engine_url: str) -> dict[str, str]:
    """Each run of `RUNS` (its `router.log_level`, then its flags): `gpupool [flags] serve`,
    one request, Ctrl-C; its output (stdout and stderr). The three run side by side."""
    tmp_path = tmp_path_factory.mktemp("serve")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    routers: dict[str, RouterProcess] = {}
    try:
        for name, (log_level, *flags) in RUNS.items():
            config = config_data(
                model={"path": str(REPO / ".gpupool/models/tiny"), "max_model_len_tokens": REMOVE},
                urls=[engine_url],
                pools=one_pool(),
                router={
                    "log_level": log_level,
                    "ledger_path": str(tmp_path / f"{name}.sqlite"),
                    "state_path": str(tmp_path / f"{name}.json"),
                },
            )
            path = tmp_path / f"{name}.yaml"
            path.write_text(yaml.safe_dump(config))
            log = tmp_path / f"{name}.log"
            routers[name] = RouterProcess(path, log, flags=flags, env=env, cwd=REPO)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for router in routers.values():
            router.wait_ready(90, interval_s=0.1)
            resp = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=10)
            assert resp.status_code == 200
    finally:
        for router in routers.values():
            router.signal(signal.SIGINT)
        for router in routers.values():
            router.proc.wait(30)
            router.stop()  # closes its log (it has exited)
    return {name: router.log_path.read_text() for name, router in routers.items()}


def test_debug_reaches_the_routers_loggers_and_uvicorns(outputs: dict[str, str]) -> None:
    assert "DEBUG router.admission.admitter" in outputs["debug"]  # one line per admitted request
    assert "Application startup complete" in outputs["debug"]  # uvicorn's, at info


def test_warning_silences_info(outputs: dict[str, str]) -> None:
    out = outputs["warning"]
    assert "is healthy" not in out  # pools.fleet at info
    assert "Application startup complete" not in out  # uvicorn's info
    assert "DEBUG" not in out


def test_verbose_wins_over_the_config(outputs: dict[str, str]) -> None:
    out = outputs["verbose"]  # router.log_level: error, gpupool -v
    assert "DEBUG router.admission.admitter" in out and "is healthy" in out
