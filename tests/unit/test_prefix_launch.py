"""engines.kv_events: which engines publish KV cache events, where, and the vLLM flags."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pools.config import ConfigError, default_config, parse_config
from pools.devmodel import make_dev_model
from pools.launchers.engine_args import (
    build_engine_command,
    engine_environ,
    kv_events_socket,
    local_kv_events,
    private_socket_dir,
)
from pools.launchers.engine_plan import HostFacts
from pools.launchers.local import LocalLauncher
from router.cli.stack import instances_without_launching

FLAGS = frozenset({"--model", "--port", "--kv-events-config", "--prefix-caching-hash-algo"})


def _value(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _pools() -> dict[str, object]:
    return {
        "agent": {"classes": ["agent"], "share": {"initial_frac": 0.25}},
        "normal": {"classes": ["normal"], "share": {"initial_frac": 0.75}},
    }


def test_on_by_default_where_gpupool_starts_engines_off_elsewhere() -> None:
    assert default_config().engines.kv_events_on
    ray = parse_config({"engines": {"launcher": "ray", "ray": {"count": 1}}, "pools": _pools()})
    assert ray.engines.kv_events_on
    static = {"launcher": "static", "static": {"urls": ["http://e:8000"]}}
    config = parse_config({"engines": static, "pools": _pools()})
    assert not config.engines.kv_events_on
    off = parse_config({"engines": {"kv_events": False}, "pools": _pools()})
    assert not off.engines.kv_events_on


@pytest.mark.parametrize("launcher", ["static", "kubernetes"])
def test_on_is_refused_where_no_engine_says_where_it_publishes(launcher: str) -> None:
    engines: dict[str, object] = {"launcher": launcher, "kv_events": True}
    engines["static"] = {"urls": ["http://e:8000"]}
    engines["kubernetes"] = {"services": [{"name": "engines"}]}
    with pytest.raises(ConfigError, match="kv_events"):
        parse_config({"engines": engines, "pools": _pools()})


def test_a_run_dir_too_long_for_a_socket_puts_them_in_a_private_tmp_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / ("d" * 90)
    assert kv_events_socket(tmp_path, 3, "pub") == tmp_path / "engine-3.kv-pub"
    long = kv_events_socket(run_dir, 3, "replay")
    assert long.name == "engine-3.kv-replay" and len(str(long)) <= 100
    assert long.parent == kv_events_socket(run_dir, 0, "pub").parent  # one per run_dir
    assert long.parent != kv_events_socket(tmp_path / ("e" * 90), 0, "pub").parent
    # a run_dir where the pub socket's path would fit and the replay socket's would not: both
    # go to the one private folder (the replay socket once went to a folder nobody made)
    between = Path("/" + "b" * (100 - len("/engine-3.kv-pub") - 1))
    assert len(str(between / "engine-3.kv-pub")) <= 100 < len(str(between / "engine-3.kv-replay"))
    pub, replay = (kv_events_socket(between, 3, kind) for kind in ("pub", "replay"))
    assert pub.parent == replay.parent != between
    assert pub.name == "engine-3.kv-pub" and replay.name == "engine-3.kv-replay"
    folder = tmp_path / "sockets"
    private_socket_dir(folder)
    assert folder.stat().st_mode & 0o777 == 0o700
    folder.chmod(0o755)
    with pytest.raises(PermissionError):
        private_socket_dir(folder)


def test_engine_publishes_on_socket_files_with_sha256_cbor(tmp_path: Path) -> None:
    config = default_config()
    model = dataclasses.replace(config.model, path=make_dev_model(tmp_path / "tiny"))
    local = dataclasses.replace(config.engines.local, run_dir=tmp_path / "run")
    cmd = build_engine_command(
        model=model, local=local, index=1, gpu_ids=None, flags=FLAGS, kv_events=True
    )
    events = json.loads(_value(cmd.argv, "--kv-events-config"))
    assert events["enable_kv_cache_events"] and events["publisher"] == "zmq"
    assert events["endpoint"] == f"ipc://{tmp_path / 'run' / 'engine-1.kv-pub'}"
    assert events["replay_endpoint"] == f"ipc://{tmp_path / 'run' / 'engine-1.kv-replay'}"
    assert _value(cmd.argv, "--prefix-caching-hash-algo") == "sha256_cbor"
    assert cmd.kv_events is not None and cmd.kv_events.endpoint == events["endpoint"]
    assert cmd.kv_events.hash_seed is None
    # an inherited PYTHONHASHSEED would change the engine's hash chain: not passed on
    assert "PYTHONHASHSEED" not in engine_environ({"PYTHONHASHSEED": "3", "A": "1"}, cmd)


def test_engine_env_seed_reaches_engine_and_router(tmp_path: Path) -> None:
    config = default_config()
    model = dataclasses.replace(config.model, path=make_dev_model(tmp_path / "tiny"))
    local = dataclasses.replace(config.engines.local, env=(("PYTHONHASHSEED", "11"),))
    cmd = build_engine_command(
        model=model, local=local, index=0, gpu_ids=None, flags=FLAGS, kv_events=True
    )
    assert engine_environ({"PYTHONHASHSEED": "3"}, cmd)["PYTHONHASHSEED"] == "11"
    assert cmd.kv_events is not None and cmd.kv_events.hash_seed == "11"


def test_off_or_unsupported_means_no_flags(tmp_path: Path) -> None:
    config = default_config()
    model = dataclasses.replace(config.model, path=make_dev_model(tmp_path / "tiny"))
    local = config.engines.local
    off = build_engine_command(model=model, local=local, index=0, gpu_ids=None, flags=FLAGS)
    old = build_engine_command(
        model=model, local=local, index=0, gpu_ids=None, flags=frozenset(), kv_events=True
    )
    for cmd in (off, old):
        assert "--kv-events-config" not in cmd.argv and cmd.kv_events is None
        assert "PYTHONHASHSEED" in engine_environ({"PYTHONHASHSEED": "3"}, cmd)


def test_serve_without_launching_follows_local_engines_events(tmp_path: Path) -> None:
    """`gpupool serve` finding local engines already running knows where they publish."""
    local = {"count": 2, "run_dir": str(tmp_path / "run"), "env": {"PYTHONHASHSEED": "5"}}
    config = parse_config({"engines": {"local": local}, "pools": _pools()})
    specs = instances_without_launching(config)
    assert [s.kv_events for s in specs] == [
        local_kv_events(config.engines.local, i) for i in (0, 1)
    ]
    assert specs[1].kv_events is not None and specs[1].kv_events.hash_seed == "5"
    assert specs[1].kv_events.endpoint == f"ipc://{tmp_path / 'run' / 'engine-1.kv-pub'}"
    off = parse_config({"engines": {"local": local, "kv_events": False}, "pools": _pools()})
    assert [s.kv_events for s in instances_without_launching(off)] == [None, None]


def _prepared_launcher(tmp_path: Path, run_dir: Path) -> LocalLauncher:
    """A two-engine local launcher on the dev model, planned for a 4-CPU host (nothing started)."""
    config = default_config()
    model = dataclasses.replace(config.model, path=make_dev_model(tmp_path / "tiny"))
    local = dataclasses.replace(config.engines.local, count=2, run_dir=run_dir)
    launcher = LocalLauncher(local, model, gpu_count=0)
    host = HostFacts(
        gpu_count=0,
        cpu_flags=frozenset({"avx2"}),
        cpu_ids=frozenset(range(4)),
        available_memory_bytes=16 * 1024**3,
    )
    launcher.prepare(host, FLAGS | {"--dtype", "--kv-cache-memory-bytes"})
    return launcher


async def test_closing_the_launcher_removes_the_socket_files(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launcher = _prepared_launcher(tmp_path, run_dir)
    files = [kv_events_socket(run_dir, i, k) for i in (0, 1) for k in ("pub", "replay")]
    run_dir.mkdir()
    for path in files:  # what engines stopped by SIGTERM leave behind
        path.touch()
    await launcher.aclose()
    assert not any(path.exists() for path in files)


async def test_closing_the_launcher_removes_its_private_socket_folder(tmp_path: Path) -> None:
    run_dir = tmp_path / ("r" * 90)  # too long for a socket path: sockets under /tmp
    launcher = _prepared_launcher(tmp_path, run_dir)
    files = [kv_events_socket(run_dir, i, k) for i in (0, 1) for k in ("pub", "replay")]
    (folder,) = {path.parent for path in files}
    assert str(folder).startswith("/tmp/gpupool-")
    private_socket_dir(folder)
    try:
        for path in files:
            path.touch()
        await launcher.aclose()
        assert not folder.exists()
    finally:
        for path in files:
            path.unlink(missing_ok=True)
        if folder.exists():
            folder.rmdir()
