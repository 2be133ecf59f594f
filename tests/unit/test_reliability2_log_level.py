"""`router.log_level` takes effect (issue 23): it was validated and never read (logging
followed `-v`, uvicorn was fixed at warning), so a router configured at debug logged at info.
Now it sets the level of the router's loggers and uvicorn's; `gpupool -v` wins over it (debug).
`gpupool serve` runs as a process against a fake engine (also a process) and serves one
request; its output is read after Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.stack import GPUPOOL, REPO, wait_ready


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
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
    procs: dict[str, tuple[subprocess.Popen[bytes], Path, str]] = {}
    try:
        for name, (log_level, *flags) in RUNS.items():
            port = _free_port()
            config = {
                "model": {"name": "tiny", "path": str(REPO / ".gpupool/models/tiny")},
                "engines": {"launcher": "static", "static": {"urls": [engine_url]}},
                "pools": {
                    "normal": {"classes": ["normal", "agent"], "share": {"initial_frac": 1.0}}
                },
                "router": {
                    "port": port,
                    "log_level": log_level,
                    "ledger_path": str(tmp_path / f"{name}.sqlite"),
                    "state_path": str(tmp_path / f"{name}.json"),
                },
            }
            path = tmp_path / f"{name}.yaml"
            path.write_text(yaml.safe_dump(config))
            log = tmp_path / f"{name}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    [GPUPOOL, *flags, "serve", "--config", str(path)],
                    cwd=REPO,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            procs[name] = (proc, log, f"http://127.0.0.1:{port}")
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for proc, log, url in procs.values():
            wait_ready(url, proc, log, 90, interval_s=0.1)
            resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10)
            assert resp.status_code == 200
    finally:
        for proc, _, _ in procs.values():
            proc.send_signal(signal.SIGINT)
        for proc, _, _ in procs.values():
            proc.wait(30)
    return {name: log.read_text() for name, (_, log, _) in procs.items()}


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
