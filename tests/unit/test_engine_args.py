"""The vLLM command line per engine: CPU and GPU, flags the installed vLLM lacks, KV size."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pools.config import (
    ConfigError,
    LocalEnginesConfig,
    ModelConfig,
    ObservabilityConfig,
    default_config,
    parse_config,
)
from pools.devmodel import make_dev_model
from pools.launchers.engine_args import EngineTraces, build_engine_command

ALL_FLAGS = frozenset(
    {
        "--model",
        "--served-model-name",
        "--host",
        "--port",
        "--dtype",
        "--load-format",
        "--max-model-len",
        "--kv-cache-memory-bytes",
        "--distributed-executor-backend",
        "--enforce-eager",
        "--tensor-parallel-size",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "--disable-uvicorn-access-log",
    }
)


def _configs(tmp_path: Path) -> tuple[ModelConfig, LocalEnginesConfig]:
    config = default_config()
    model = dataclasses.replace(config.model, path=make_dev_model(tmp_path / "tiny"))
    return model, config.engines.local


def _value(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_cpu_engine(tmp_path: Path) -> None:
    model, local = _configs(tmp_path)
    cmd = build_engine_command(
        model=model, local=local, index=2, gpu_ids=None, flags=ALL_FLAGS, python="py"
    )
    assert cmd.argv[:3] == ("py", "-m", "vllm.entrypoints.openai.api_server")
    assert cmd.port == local.base_port + 2 and _value(cmd.argv, "--port") == str(cmd.port)
    assert _value(cmd.argv, "--served-model-name") == "tiny"
    assert _value(cmd.argv, "--kv-cache-memory-bytes") == str(local.kv_cache_bytes)
    assert _value(cmd.argv, "--distributed-executor-backend") == "uni"
    assert "--enforce-eager" in cmd.argv and "--disable-log-stats" not in cmd.argv
    assert _value(cmd.argv, "--tool-call-parser") == "hermes"  # the dev model has its tokens
    assert cmd.env["OMP_NUM_THREADS"] == "1" and cmd.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "CUDA_VISIBLE_DEVICES" not in cmd.env
    assert cmd.argv[-2:] == ("--max-num-seqs", "64")  # user args last


def test_gpu_engine_gets_its_devices_and_tp(tmp_path: Path) -> None:
    model, local = _configs(tmp_path)
    local = dataclasses.replace(local, gpus_per_instance=2)
    cmd = build_engine_command(model=model, local=local, index=1, gpu_ids=[2, 3], flags=ALL_FLAGS)
    assert cmd.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert _value(cmd.argv, "--tensor-parallel-size") == "2"
    assert "--enforce-eager" not in cmd.argv and "OMP_NUM_THREADS" not in cmd.env


def test_flags_the_installed_vllm_lacks_are_not_passed(tmp_path: Path) -> None:
    model, local = _configs(tmp_path)
    old = frozenset({"--model", "--served-model-name", "--host", "--port", "--dtype"})
    cmd = build_engine_command(model=model, local=local, index=0, gpu_ids=None, flags=old)
    for flag in (
        "--kv-cache-memory-bytes",
        "--enable-auto-tool-choice",
        "--load-format",
        "--disable-uvicorn-access-log",
    ):
        assert flag not in cmd.argv
    # without --kv-cache-memory-bytes the CPU KV size falls back to VLLM_CPU_KVCACHE_SPACE (GiB)
    assert cmd.env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def _observability(**fields: object) -> ObservabilityConfig:
    return parse_config(
        {**_MINIMAL, "observability": {"otlp_endpoint": "http://tempo:4318", **fields}}
    ).observability


_MINIMAL: dict[str, object] = {
    "pools": {
        "agent": {"classes": ["agent"], "share": {"initial_frac": 0.5}},
        "normal": {"classes": ["normal"], "share": {"initial_frac": 0.5}},
    }
}


def test_launched_engines_export_their_spans_to_the_routers_collector(tmp_path: Path) -> None:
    model, local = _configs(tmp_path)
    observability = _observability(service_name="edge", export_interval_s=0.25)
    # as `headers_env` gives them, read at load
    observability = dataclasses.replace(observability, headers=(("authorization", "Bearer a b"),))
    traces = EngineTraces.of(observability, "local")
    assert traces is not None and EngineTraces.of(observability, "ray") == traces
    flags = ALL_FLAGS | {"--otlp-traces-endpoint"}
    cmd = build_engine_command(
        model=model, local=local, index=0, gpu_ids=None, flags=flags, traces=traces
    )
    assert _value(cmd.argv, "--otlp-traces-endpoint") == "http://tempo:4318/v1/traces"
    assert cmd.env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"  # vLLM's default: gRPC
    assert cmd.env["OTEL_SERVICE_NAME"] == "edge-vllm"
    assert cmd.env["OTEL_BSP_SCHEDULE_DELAY"] == "250"
    # the collector's token travels in the environment, never in argv
    assert cmd.env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] == "authorization=Bearer%20a%20b"
    assert not any("Bearer" in a for a in cmd.argv)
    # a vLLM without the flag gets none of it; the user's own endpoint wins
    bare = build_engine_command(
        model=model, local=local, index=0, gpu_ids=None, flags=ALL_FLAGS, traces=traces
    )
    assert "--otlp-traces-endpoint" not in bare.argv and "OTEL_SERVICE_NAME" not in bare.env
    own = dataclasses.replace(local, vllm_args=("--otlp-traces-endpoint", "http://mine:4317"))
    mine = build_engine_command(
        model=model, local=own, index=0, gpu_ids=None, flags=flags, traces=traces
    )
    assert mine.argv.count("--otlp-traces-endpoint") == 1
    assert _value(mine.argv, "--otlp-traces-endpoint") == "http://mine:4317"


def test_engine_traces_follow_the_launcher_and_the_setting() -> None:
    assert EngineTraces.of(_observability(), "static") is None  # engines started elsewhere
    assert EngineTraces.of(_observability(engine_traces=False), "local") is None
    assert EngineTraces.of(parse_config(_MINIMAL).observability, "local") is None  # no tracing
    static = {"launcher": "static", "static": {"urls": ["http://e:8000"]}}
    with pytest.raises(ConfigError, match="engine_traces: on needs launcher 'local' or 'ray'"):
        parse_config(
            {
                **_MINIMAL,
                "engines": static,
                "observability": {"otlp_endpoint": "http://tempo:4318", "engine_traces": True},
            }
        )
    with pytest.raises(ConfigError, match="engine_traces"):  # nothing to export without it
        parse_config({**_MINIMAL, "observability": {"engine_traces": True}})
