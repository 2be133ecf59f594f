"""`gpupool serve` whose app cannot start (here: its PostgreSQL store refuses connections)
exits 1 with the app's reason and no traceback; uvicorn's own `sys.exit(3)` inside its serving
task once unwound the event loop with 'Task exception was never retrieved'."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_serve_with_an_unreachable_store_exits_1_saying_why(tmp_path: Path) -> None:
    store_port, router_port = _closed_port(), _closed_port()
    config = tmp_path / "gpupool.yaml"
    config.write_text(
        "engines: {launcher: static, static: {urls: ['http://127.0.0.1:1']}}\n"
        "pools:\n"
        "  agent: {classes: [agent], share: {initial_frac: 0.5}}\n"
        "  normal: {classes: [normal], share: {initial_frac: 0.5}}\n"
        f"router: {{port: {router_port}}}\n"
        f"store: {{url: 'postgresql://gpupool@127.0.0.1:{store_port}/db'}}\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert (
        f"cannot connect to the PostgreSQL store postgresql://gpupool@127.0.0.1:{store_port}/db"
        in out
    )
    assert "the router failed to start" in out
    assert "Traceback" not in out and "never retrieved" not in out, out
