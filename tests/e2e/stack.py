"""What the e2e tests share: where the `gpupool` console script is, and waiting for a stack
started with `gpupool up` to answer `/ready` (failing with its log when it exits first)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
GPUPOOL = str(Path(sys.executable).parent / "gpupool")


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    """Poll `url`/ready every 0.5 s until 200; raise with the log if `proc` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"gpupool up exited {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"not ready after {timeout_s} s:\n{log.read_text()}")
