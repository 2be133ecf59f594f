"""`gpupool serve` (or `up`) as a child process on a free port, the way a user runs it, for
tests and benchmarks that need the whole program:

    with start_router_process(config_data(tmp_path, urls=urls), tmp_path) as router:
        httpx.get(f"{router.url}/v1/models")

Start waits until `/ready` answers 200 and fails with the router's log if it exits first or
never does; leaving the block stops it (SIGTERM, then SIGKILL after `stop_grace_s`), so
nothing outlives the test. `async_router_process` is the same for code that serves fake
engines on its own event loop (a blocking wait there would starve them).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

__all__ = [
    "GPUPOOL",
    "RouterProcess",
    "async_router_process",
    "free_port",
    "start_router_process",
    "wait_ready",
]

GPUPOOL = str(Path(sys.executable).parent / "gpupool")  # the console script beside python


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_ready(
    url: str,
    proc: subprocess.Popen[bytes] | None,
    log: Path | None,
    timeout_s: float,
    *,
    path: str = "/ready",
    interval_s: float = 0.5,
) -> float:
    """Poll `url + path` every `interval_s` until 200 and return the seconds it took; raise
    AssertionError with the log if `proc` (when given) exits first, or when `timeout_s`
    passes."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{proc.args!r} exited {proc.returncode}{_tail(log)}")
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    raise AssertionError(f"{url}{path} not answering 200 after {timeout_s:g} s{_tail(log)}")


def _tail(log: Path | None, lines: int = 200) -> str:
    if log is None or not log.is_file():
        return ""
    return ":\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


class RouterProcess:
    """`gpupool [flags] <command> --config <config> --port <port> [args]` with its output in
    `log`, in `env` (the whole environment; this one's when None). Started by the constructor;
    `wait_ready` / `await wait_ready_async()`, then `stop`."""

    def __init__(
        self,
        config_path: Path,
        log_path: Path,
        *,
        command: str = "serve",
        port: int | None = None,
        args: Sequence[str] = (),
        flags: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.config_path = config_path
        self.command = command
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = log_path.open("ab")
        argv = [GPUPOOL, *flags, command, "--config", str(config_path), "--port", str(self.port)]
        self.proc = subprocess.Popen(
            [*argv, *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=None if env is None else dict(env),
        )

    def wait_ready(
        self, timeout_s: float = 60.0, *, path: str = "/ready", interval_s: float = 0.2
    ) -> float:
        """Seconds until `path` answered 200; AssertionError with the log otherwise."""
        self._log.flush()
        return wait_ready(
            self.url, self.proc, self.log_path, timeout_s, path=path, interval_s=interval_s
        )

    async def wait_ready_async(
        self, timeout_s: float = 60.0, *, path: str = "/ready", interval_s: float = 0.2
    ) -> float:
        """`wait_ready` without blocking the running event loop."""
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=2) as client:
            while time.monotonic() - started < timeout_s:
                if self.proc.poll() is not None:
                    raise AssertionError(
                        f"{self.proc.args!r} exited {self.proc.returncode}{self.tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}{path}")).status_code == 200:
                        return time.monotonic() - started
                await asyncio.sleep(interval_s)
        waited = f"{self.url}{path} not answering 200 after {timeout_s:g} s"
        raise AssertionError(waited + self.tail())

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, grace_s: float = 20.0) -> int:
        """SIGTERM, then SIGKILL if it has not exited after `grace_s`; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        return self.proc.returncode

    async def stop_async(self, grace_s: float = 20.0) -> int:
        return await asyncio.to_thread(self.stop, grace_s)

    def tail(self, lines: int = 200) -> str:
        """The last `lines` of the log, after a colon and a newline ("" when it is empty)."""
        if not self._log.closed:
            self._log.flush()
        return _tail(self.log_path, lines)


def _config_path(config: Path | Mapping[str, Any], folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if isinstance(config, Path):
        return config
    path = folder / "gpupool.yaml"
    path.write_text(yaml.safe_dump(dict(config)))
    return path


@contextlib.contextmanager
def start_router_process(
    config: Path | Mapping[str, Any],
    folder: Path,
    *,
    ready_timeout_s: float = 60.0,
    stop_grace_s: float = 20.0,
    **process: Any,
) -> Iterator[RouterProcess]:
    """A ready router for `config` (a file, or a YAML document written to
    `folder/gpupool.yaml`), its log `folder/router.log`; `process` goes to `RouterProcess`
    (`command`, `port`, `args`, `flags`, `env`, `cwd`). Stopped on exit, also when start fails."""
    router = RouterProcess(_config_path(config, folder), folder / "router.log", **process)
    try:
        router.wait_ready(ready_timeout_s)
        yield router
    finally:
        router.stop(stop_grace_s)


@contextlib.asynccontextmanager
async def async_router_process(
    config: Path | Mapping[str, Any],
    folder: Path,
    *,
    ready_timeout_s: float = 60.0,
    stop_grace_s: float = 20.0,
    **process: Any,
) -> AsyncIterator[RouterProcess]:
    """`start_router_process` for async code: waits and stops without blocking the loop."""
    router = RouterProcess(_config_path(config, folder), folder / "router.log", **process)
    try:
        await router.wait_ready_async(ready_timeout_s)
        yield router
    finally:
        await router.stop_async(stop_grace_s)
