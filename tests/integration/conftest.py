"""Real CPU vLLM engines for the integration tests, started once for the package
(`tests/integration`) and stopped when its last test is done, so that the e2e tests after it,
which start engines of their own, do not share the two cores with three idle engines and their
router (~6 % of a core each, scraped).

`real_engines` yields the `InstanceSpec`s (`.url`, `.instance_id`, `.gpus`) of three engines
serving the tiny dev model, started by gpupool's own `LocalLauncher` (so the launcher is under
test too) with a 64 MiB KV cache each and `max_model_len` 4096. `engine_fleet` gives the
handle that can kill an engine and wait for the launcher to restart it. The launcher runs on
an event loop in a background thread, so its supervisor keeps working between tests.

`router_url` runs `gpupool serve` as a subprocess in front of those engines (agent pool: one
engine, normal pool: two), the same way a user runs it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from pools.config import parse_config
from pools.devmodel import is_dev_model, make_dev_model
from pools.launchers import InstanceSpec, LocalLauncher
from pools.launchers.engine_args import EngineTraces
from pools.testing import router_process
from pools.testing.otlp_receiver import OtlpReceiver
from pools.testing.router_process import free_port
from tests.e2e.stack import seed_vllm_flags, wait_ready

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / ".gpupool" / "models" / "tiny"
ENGINE_BASE_PORT = int(os.environ.get("GPUPOOL_TEST_ENGINE_BASE_PORT", "8150"))
ENGINE_COUNT = 3
KV_CACHE_BYTES = 64 * 1024 * 1024
MAX_MODEL_LEN = 4096
# The engines require a key (as every launched engine does); tests give it through the
# environment so routers started as subprocesses (`gpupool serve`) can name the same variable.
ENGINE_KEY_ENV = "GPUPOOL_TEST_ENGINE_KEY"
os.environ.setdefault(ENGINE_KEY_ENV, "test-engine-key-" + os.urandom(6).hex())

T = TypeVar("T")


class EngineFleet:
    """Real engines under a `LocalLauncher`, driven from synchronous tests."""

    def __init__(self, run_dir: Path) -> None:
        if not is_dev_model(MODEL_DIR):
            make_dev_model(MODEL_DIR, "tiny")
        seed_vllm_flags(run_dir)
        # the engines export vLLM's own spans here (observability.engine_traces), for the
        # tracing tests: a request's `llm_request` span under the router's gpupool.engine span
        self.engine_spans = OtlpReceiver()
        self.config = parse_config(
            {
                "model": {
                    "name": "tiny",
                    "path": str(MODEL_DIR),
                    "max_model_len_tokens": MAX_MODEL_LEN,
                },
                "engines": {
                    "launcher": "local",
                    "local": {
                        "count": ENGINE_COUNT,
                        "base_port": ENGINE_BASE_PORT,
                        "kv_cache_bytes": KV_CACHE_BYTES,
                        "api_key_env": ENGINE_KEY_ENV,
                        "run_dir": str(run_dir),
                        "restart_backoff_s": 1.0,
                        "stop_grace_s": 10.0,
                        "startup_timeout_s": 300,
                        "vllm_args": ["--max-num-seqs", "32"],
                    },
                },
                "pools": {
                    "agent": {"classes": ["agent"], "share": {"initial_frac": 0.34}},
                    "normal": {"classes": ["normal"], "share": {"initial_frac": 0.66}},
                },
                "observability": {
                    "otlp_endpoint": self.engine_spans.url,
                    "export_interval_s": 0.2,
                },
            }
        )
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, daemon=True, name="engine-fleet-loop"
        )
        self._thread.start()
        self.launcher = LocalLauncher(
            self.config.engines.local,
            self.config.model,
            progress=lambda m: print(f"[engines] {m}", file=sys.stderr, flush=True),
            gpu_count=0,
            traces=EngineTraces.of(self.config.observability, "local"),
        )
        self.instances: list[InstanceSpec] = []

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 600) -> T:
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout=timeout_s)

    def start(self) -> list[InstanceSpec]:
        self.instances = self.run(self.launcher.start())
        return self.instances

    def pid(self, index: int) -> int:
        pid = self.launcher.engines[index].pid
        assert pid is not None
        return pid

    def kill(self, index: int, sig: int = signal.SIGKILL) -> int:
        pid = self.pid(index)
        os.killpg(pid, sig)
        return pid

    def wait_healthy(self, index: int, timeout_s: float = 180) -> None:
        url = self.instances[index].url
        wait_ready(url, None, None, timeout_s, path="/health", interval_s=0.25)

    def close(self) -> None:
        try:
            self.run(self.launcher.aclose(), timeout_s=120)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self.engine_spans.close()


@pytest.fixture(scope="package")
def engine_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineFleet]:
    fleet = EngineFleet(tmp_path_factory.mktemp("engines"))
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.close()


@pytest.fixture(scope="package")
def real_engines(engine_fleet: EngineFleet) -> list[InstanceSpec]:
    return engine_fleet.instances


def wait_for(cond: Any, timeout_s: float = 30.0, interval_s: float = 0.05) -> None:
    """Poll `cond` until it holds; fail the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(interval_s)


def write_router_config(path: Path, urls: list[str], **extra: Any) -> Path:
    config: dict[str, Any] = {
        "model": {"name": "tiny", "path": str(MODEL_DIR), "max_model_len_tokens": MAX_MODEL_LEN},
        "engines": {
            "launcher": "static",
            "static": {"urls": urls, "api_key_env": ENGINE_KEY_ENV},
        },
        "pools": {
            "agent": {"classes": ["agent"], "share": {"initial_frac": 0.34}},
            "normal": {"classes": ["normal"], "share": {"initial_frac": 0.66}},
        },
        "router": {
            "scrape_interval_s": 0.5,
            "ledger_path": str(path.parent / "ledger.sqlite"),
            "state_path": str(path.parent / "state.json"),
        },
    }
    for key, value in extra.items():
        config.setdefault(key, {})
        if isinstance(value, dict):
            config[key].update(value)
        else:
            config[key] = value
    path.write_text(yaml.safe_dump(config))
    return path


class RouterProcess(router_process.RouterProcess):
    """`gpupool serve` on `port`, ready when constructed (`pools.testing.router_process`)."""

    def __init__(self, config_path: Path, port: int, log_path: Path) -> None:
        super().__init__(config_path, log_path, port=port, cwd=REPO)
        try:
            self.wait_ready(60, interval_s=0.2)
        except BaseException:
            self.stop()  # a router that never got ready does not outlive the test
            raise


@pytest.fixture(scope="package")
def router_url(
    real_engines: list[InstanceSpec], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    d = tmp_path_factory.mktemp("router")
    config = write_router_config(d / "gpupool.yaml", [e.url for e in real_engines])
    router = RouterProcess(config, free_port(), d / "router.log")
    try:
        yield router.url
    finally:
        router.stop()
