"""Engines closed by default: each local engine requires a random key the router holds (on
every path but /health and /metrics, also the ones vLLM's own --api-key leaves open), tenant
key variables stay out of the engines' environment, and prompts stay out of their logs."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from pools.devmodel import make_dev_model
from pools.launchers import InstanceSpec, LocalLauncher, StaticLauncher
from pools.launchers.engine_args import build_engine_command, engine_environ
from pools.launchers.engine_guard import GUARD_MIDDLEWARE, EngineKeyGuard, Receive, Scope, Send
from pools.launchers.engine_plan import HostFacts
from pools.launchers.local import EngineProcess
from pools.testing.config import config_for_test, deep_merge
from router.cli.stack import instances_without_launching

FLAGS = frozenset(
    {
        "--dtype",
        "--kv-cache-memory-bytes",
        "--middleware",
        "--max-log-len",
        "--enable-log-requests",
        "--no-enable-log-requests",
    }
)
HOST = HostFacts(
    gpu_count=0,
    cpu_flags=frozenset({"avx2"}),
    cpu_ids=frozenset(range(4)),
    available_memory_bytes=16 * 1024**3,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dev_model(tmp_path_factory.mktemp("model") / "tiny")


def _config(tiny: Path, tmp_path: Path, **changes: Any) -> Any:
    ours = {"model": {"path": str(tiny)}, "engines": {"local": {"run_dir": str(tmp_path)}}}
    return config_for_test(**deep_merge(ours, changes))


def _value(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


# --- the key --------------------------------------------------------------------------------


def test_each_engine_gets_its_own_random_key_the_router_holds(tiny: Path, tmp_path: Path) -> None:
    config = _config(tiny, tmp_path)
    launcher = LocalLauncher(config.engines.local, config.model, gpu_count=0)
    launcher.prepare(HOST, FLAGS)
    keys = [e.spec.api_key for e in launcher.engines]
    assert all(k and len(k) >= 32 for k in keys) and len(set(keys)) == len(keys) == 3
    for engine in launcher.engines:
        # given through the environment, never on the command line (world-readable in `ps`,
        # and written to the engine's log by the launcher)
        assert engine.command.env["VLLM_API_KEY"] == engine.spec.api_key
        assert not any(engine.spec.api_key in arg for arg in engine.command.argv)
        assert "--api-key" not in engine.command.argv
        assert _value(engine.command.argv, "--middleware") == GUARD_MIDDLEWARE
        assert engine.spec.api_key not in repr(engine.command)
    launcher.prepare(HOST, FLAGS)  # a new launch: new keys
    assert not {e.spec.api_key for e in launcher.engines} & set(keys)


def test_a_configured_engine_key_is_shared_by_local_and_static(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENGINE_KEY_FOR_TEST", "s3cret-engine-key")
    config = _config(
        tiny,
        tmp_path,
        engines={
            "launcher": "local",
            "local": {"count": 2, "run_dir": str(tmp_path), "api_key_env": "ENGINE_KEY_FOR_TEST"},
            "static": {"urls": ["http://10.0.0.1:8000"], "api_key_env": "ENGINE_KEY_FOR_TEST"},
        },
    )
    launcher = LocalLauncher(config.engines.local, config.model, gpu_count=0)
    launcher.prepare(HOST, FLAGS)
    assert [e.spec.api_key for e in launcher.engines] == ["s3cret-engine-key"] * 2
    assert [s.api_key for s in instances_without_launching(config)] == ["s3cret-engine-key"] * 2
    static = StaticLauncher(config.engines.static)
    assert [s.api_key for s in static.instances] == ["s3cret-engine-key"]
    static_config = dataclasses.replace(
        config, engines=dataclasses.replace(config.engines, launcher="static")
    )
    assert [s.api_key for s in instances_without_launching(static_config)] == ["s3cret-engine-key"]
    assert "s3cret" not in repr(config)


def test_an_unset_engine_key_variable_is_a_config_error(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pools.config import ConfigError

    monkeypatch.delenv("NO_SUCH_ENGINE_KEY", raising=False)
    with pytest.raises(ConfigError, match="NO_SUCH_ENGINE_KEY"):
        _config(tiny, tmp_path, engines={"local": {"api_key_env": "NO_SUCH_ENGINE_KEY"}})


# --- the environment ------------------------------------------------------------------------


def test_key_variables_stay_out_of_the_engines_environment(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEAM_A_KEY", "tenant-secret-a")
    monkeypatch.setenv("TEAM_B_KEY", "tenant-secret-b")
    config = _config(
        tiny,
        tmp_path,
        tenants=[
            {"name": "a", "api_key_env": "TEAM_A_KEY"},
            {"name": "b", "api_key_env": "TEAM_B_KEY"},
        ],
    )
    assert {"TEAM_A_KEY", "TEAM_B_KEY"} <= config.engines.local.secret_env
    command = build_engine_command(
        model=config.model,
        local=config.engines.local,
        index=0,
        gpu_ids=None,
        flags=FLAGS,
        api_key="engine-key",
    )
    parent = {"PATH": "/usr/bin", "TEAM_A_KEY": "tenant-secret-a", "TEAM_B_KEY": "x"}
    env = engine_environ(parent, command)
    assert "TEAM_A_KEY" not in env and "TEAM_B_KEY" not in env
    assert env["PATH"] == "/usr/bin" and env["VLLM_API_KEY"] == "engine-key"


async def test_a_spawned_engine_process_sees_no_tenant_key(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real spawn path, with a stand-in process that prints its environment."""
    monkeypatch.setenv("TEAM_A_KEY", "tenant-secret-a")
    config = _config(tiny, tmp_path, tenants=[{"name": "a", "api_key_env": "TEAM_A_KEY"}])
    command = build_engine_command(
        model=config.model,
        local=config.engines.local,
        index=0,
        gpu_ids=None,
        flags=FLAGS,
        api_key="engine-key",
    )
    dump = "import json, os; print('ENV' + '=' + json.dumps(dict(os.environ)))"
    command = dataclasses.replace(command, argv=(sys.executable, "-c", dump))
    spec = InstanceSpec(instance_id="engine-0", url="http://127.0.0.1:1", gpus=1)
    engine = EngineProcess(
        spec,
        command,
        log_path=tmp_path / "engine-0.log",
        pid_path=tmp_path / "engine-0.pid",
        cpus=None,
        backoff_s=60.0,
        backoff_max_s=60.0,
        grace_s=1.0,
    )
    await engine.spawn()
    for _ in range(200):
        if "ENV={" in engine.log_path.read_text():
            break
        await asyncio.sleep(0.05)
    await engine.stop()
    log = engine.log_path.read_text()
    header, dumped = log.split("ENV=", 1)
    seen = json.loads(dumped.splitlines()[0])
    assert "TEAM_A_KEY" not in seen and "tenant-secret-a" not in log
    assert seen["VLLM_API_KEY"] == "engine-key" and "engine-key" not in header


# --- prompts out of the engines' logs -------------------------------------------------------


def test_engines_are_told_to_keep_prompts_out_of_their_logs(tiny: Path, tmp_path: Path) -> None:
    config = _config(tiny, tmp_path)
    command = build_engine_command(
        model=config.model, local=config.engines.local, index=0, gpu_ids=None, flags=FLAGS
    )
    assert _value(command.argv, "--max-log-len") == "0"
    assert "--enable-log-requests" not in command.argv
    # an older vLLM that logged requests unless told not to
    old = frozenset({"--dtype", "--disable-log-requests", "--max-log-len"})
    command = build_engine_command(
        model=config.model, local=config.engines.local, index=0, gpu_ids=None, flags=old
    )
    assert "--disable-log-requests" in command.argv


# --- the guard on every path ----------------------------------------------------------------


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.mark.parametrize(
    ("path", "open_"),
    [
        ("/health", True),
        ("/metrics", True),
        ("/v1/chat/completions", False),
        ("/invocations", False),  # vLLM's --api-key leaves this one open: the same handlers
        ("/tokenize", False),
        ("/detokenize", False),
        ("/pooling", False),
        ("/version", False),
        ("/metricsx", False),
    ],
)
async def test_guard_needs_the_key_on_every_path_but_health_and_metrics(
    path: str, open_: bool
) -> None:
    guard = EngineKeyGuard(_app, key="the-engine-key")
    transport = httpx.ASGITransport(app=guard)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
        bare = await client.post(path)
        wrong = await client.post(path, headers={"authorization": "Bearer nope"})
        basic = await client.post(path, headers={"authorization": "Basic the-engine-key"})
        right = await client.post(path, headers={"authorization": "Bearer the-engine-key"})
    assert right.status_code == 200
    for refused in (bare, wrong, basic):
        assert refused.status_code == (200 if open_ else 401), (path, refused.text)
        if not open_:
            assert refused.json()["error"]["code"] == "invalid_api_key"
            assert "the-engine-key" not in refused.text


def test_guard_without_a_key_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_API_KEY"):
        EngineKeyGuard(_app)
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    EngineKeyGuard(_app)
