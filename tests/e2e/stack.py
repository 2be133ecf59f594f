"""What the e2e tests share: where the `gpupool` console script is, and waiting for a stack
started with `gpupool up` (or a router, or an engine) to answer `/ready` (failing with its log
when it exits first)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
GPUPOOL = str(Path(sys.executable).parent / "gpupool")


def wait_ready(
    url: str,
    proc: subprocess.Popen[bytes] | None,
    log: Path | None,
    timeout_s: float,
    *,
    path: str = "/ready",
    interval_s: float = 0.5,
) -> None:
    """Poll `url + path` every `interval_s` until 200; raise with the log if `proc` (when
    given) exits first, or when `timeout_s` passes."""

    def tail() -> str:
        return "" if log is None else ":\n" + log.read_text(errors="replace")

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{proc.args!r} exited {proc.returncode}{tail()}")
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    raise AssertionError(f"{url}{path} not answering 200 after {timeout_s:g} s{tail()}")
