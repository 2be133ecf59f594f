"""The vLLM command line and environment for one local engine, as a pure function of the config,
the instance's index, its GPU ids and the flags the installed vLLM accepts.

Rules:
- stats stay on (never `--disable-log-stats`: it removes every `vllm:*` metric gpupool reads);
- the served model name is the config's, so clients and the router agree on it;
- the dtype and the KV cache size are the engine plan's (`engine_plan.py`: on CPU the dtype the
  CPU runs fast and a KV default that leaves room for every engine); the KV cache is sized by
  `--kv-cache-memory-bytes` when the installed vLLM has it, else by `VLLM_CPU_KVCACHE_SPACE`
  (GiB) on CPU;
- version-dependent flags are passed only when `--help` lists them;
- on CPU: `OMP_NUM_THREADS=1`, `VLLM_ENABLE_V1_MULTIPROCESSING=0`, `--distributed-executor-backend
  uni` and `--enforce-eager` (otherwise one idle engine spins ~1.7 cores);
- on GPU: `CUDA_VISIBLE_DEVICES` lists the instance's GPUs and `--tensor-parallel-size` their
  count;
- closed by default: the engine's key goes in `VLLM_API_KEY` (never argv) and a guard
  middleware (`engine_guard.py`) asks for it on every path but /health and /metrics; the env
  variables holding gpupool's own keys (`secret_env`) are not inherited;
- prompts stay out of the engine's log (`--max-log-len 0`, request logging left off);
- with `kv_events` (engines.kv_events): vLLM's KV cache events on a ZMQ PUB socket file in
  run_dir plus a replay socket beside it (or, given a `KvEventsSpec` with `tcp://host:port`
  endpoints, as for a Ray engine on another node: bound on every interface at those ports),
  block hashes by `sha256_cbor`, and no
  `PYTHONHASHSEED` inherited from this process (vLLM seeds its block hash chain from it: only
  one set in the engine's own `env` reaches the engine, and the router hashes with that);
  docs/prefix_cache.md;
- with `traces` (observability.engine_traces): vLLM exports its own spans to the router's
  collector (`--otlp-traces-endpoint`, OTLP/HTTP through `OTEL_*` variables).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from pools.config import LocalEnginesConfig, ModelConfig, ObservabilityConfig
from pools.launchers.base import KvEventsSpec
from pools.launchers.engine_guard import GUARD_MIDDLEWARE
from pools.launchers.engine_plan import EnginePlan

__all__ = [
    "FORBIDDEN_FLAGS",
    "EngineCommand",
    "EngineTraces",
    "build_engine_command",
    "engine_bind_endpoint",
    "engine_environ",
    "installed_vllm_version",
    "kv_events_socket",
    "local_kv_events",
    "supported_vllm_flags",
]

log = logging.getLogger(__name__)

FORBIDDEN_FLAGS = {
    "--disable-log-stats": "it removes every vllm:* metric gpupool's telemetry needs",
}

# Used when `--help` cannot be read; these flags exist in every vLLM gpupool supports.
_BASELINE_FLAGS = frozenset(
    {
        "--model",
        "--served-model-name",
        "--host",
        "--port",
        "--dtype",
        "--load-format",
        "--max-model-len",
        "--tensor-parallel-size",
        "--enforce-eager",
        "--gpu-memory-utilization",
    }
)


@dataclass(frozen=True, slots=True)
class EngineCommand:
    argv: tuple[str, ...]  # never holds a secret: argv is world-readable (`ps`) and logged
    env: dict[str, str] = field(repr=False)  # set over the parent's (holds VLLM_API_KEY)
    port: int
    env_remove: frozenset[str] = frozenset()  # parent variables the engine must not inherit
    kv_events: KvEventsSpec | None = None  # where it publishes KV cache events; None: nowhere


@dataclass(frozen=True, slots=True)
class EngineTraces:
    """Where a launched engine exports vLLM's own spans (`observability.engine_traces`): the
    router's collector, over OTLP/HTTP, batched at the router's interval. vLLM continues the
    `traceparent` the router sends with each engine call, so its `llm_request` span (queue,
    prefill, decode times) lands under that call's `gpupool.engine` span."""

    url: str  # the collector's OTLP/HTTP traces URL (.../v1/traces)
    service_name: str  # the engines' `service.name`
    export_interval_s: float
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # may hold a token

    @classmethod
    def of(cls, config: ObservabilityConfig, launcher: str) -> EngineTraces | None:
        """The engines' tracing for `launcher` under `config`; None when they export none."""
        on = launcher in ("local", "ray") if config.engine_traces is None else config.engine_traces
        if config.otlp_endpoint is None or not on:
            return None
        return cls(
            url=config.otlp_endpoint,
            service_name=f"{config.service_name}-vllm",
            export_interval_s=config.export_interval_s,
            headers=config.headers,
        )

    def env(self) -> dict[str, str]:
        """The OpenTelemetry SDK's settings in the engine process (vLLM reads only the URL)."""
        env = {
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            "OTEL_SERVICE_NAME": self.service_name,
            "OTEL_BSP_SCHEDULE_DELAY": str(max(1, round(self.export_interval_s * 1000))),
        }
        if self.headers:
            env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] = ",".join(
                f"{quote(k)}={quote(v)}" for k, v in self.headers
            )
        return env


KV_EVENTS_SOCKET_MAX_CHARS = 100  # a unix socket path: 107 bytes on Linux, 103 on macOS


def kv_events_socket(run_dir: Path, index: int, kind: str) -> Path:
    """The socket file where local engine `index` publishes its KV events (`kind` "pub") or
    answers replay requests ("replay"): in `run_dir`, or where the longer of the two paths
    would be too long for a unix socket, both in `/tmp/gpupool-<uid>-<hash of run_dir>/`
    (`private_socket_dir` makes it; one folder for both, so that a run_dir between the two
    lengths cannot put the replay socket in a folder nobody made)."""
    name = f"engine-{index}.kv-{kind}"
    if len(str(run_dir / f"engine-{index}.kv-replay")) <= KV_EVENTS_SOCKET_MAX_CHARS:
        return run_dir / name
    digest = hashlib.sha256(str(run_dir).encode()).hexdigest()[:16]
    return Path("/tmp") / f"gpupool-{os.getuid()}-{digest}" / name


def private_socket_dir(path: Path) -> None:
    """Make `path` a directory only this user can enter (the events carry prompt token ids);
    `PermissionError` if it exists and is someone else's or open to others."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{path} is not private to this user (mode {info.st_mode:o})")


def engine_environ(parent: Mapping[str, str], command: EngineCommand) -> dict[str, str]:
    """The engine's whole environment: the parent's without `env_remove`, then `env`."""
    env = {k: v for k, v in parent.items() if k not in command.env_remove}
    env.update(command.env)
    return env


def installed_vllm_version() -> str | None:
    """Version of the installed vLLM distribution (`vllm` or `vllm-cpu`), or None."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def supported_vllm_flags(cache_dir: Path, python: str = sys.executable) -> frozenset[str]:
    """Flags the installed vLLM's OpenAI server accepts, from its `--help`, cached per version
    in `cache_dir` (reading `--help` imports vLLM: ~10 s)."""
    version = installed_vllm_version()
    if version is None:
        return _BASELINE_FLAGS
    cache = cache_dir / f"vllm-{version}-flags.txt"
    if cache.is_file():
        return frozenset(cache.read_text().split())
    try:
        out = subprocess.run(
            [python, "-m", "vllm.entrypoints.openai.api_server", "--help"],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        log.warning("could not read vLLM's --help (%s); passing only baseline flags", err)
        return _BASELINE_FLAGS
    flags = frozenset(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", out))
    if "--model" not in flags and "--port" not in flags:
        log.warning("vLLM's --help listed no flags; passing only baseline flags")
        return _BASELINE_FLAGS
    cache_dir.mkdir(parents=True, exist_ok=True)
    cache.write_text("\n".join(sorted(flags)) + "\n")
    return flags


def build_engine_command(
    *,
    model: ModelConfig,
    local: LocalEnginesConfig,
    index: int,
    gpu_ids: Sequence[int | str] | None,
    flags: frozenset[str],
    python: str = sys.executable,
    base_env: dict[str, str] | None = None,
    plan: EnginePlan | None = None,
    api_key: str | None = None,
    kv_events: bool | KvEventsSpec = False,
    traces: EngineTraces | None = None,
) -> EngineCommand:
    """The argv and env for engine `index`. `gpu_ids` (CUDA device indices or UUIDs, as the
    child's CUDA_VISIBLE_DEVICES lists them) None means a CPU engine.

    `plan` (from `engine_plan.plan_engines`) gives the dtype and KV size this machine runs;
    without one they are the config's as written. `api_key`: the key the engine requires.
    `kv_events`: publish KV cache events (when the installed vLLM has the flags): True on the
    local socket files, a `KvEventsSpec` where it names (the router's view of the endpoints;
    the engine binds a TCP one on every interface). `traces`:
    export vLLM's own spans there (unless `vllm_args` already name an endpoint)."""
    port = local.base_port + index
    dtype = plan.dtype if plan is not None else model.dtype
    kv_cache_bytes = plan.kv_cache_bytes if plan is not None else local.kv_cache_bytes
    argv = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model.path),
        "--served-model-name",
        model.name,
        "--host",
        local.host,
        "--port",
        str(port),
        "--dtype",
        dtype,
    ]
    env = dict(base_env or {})
    # vLLM keeps a Responses API response (for `previous_response_id`, GET, cancel) only with
    # this set; the router sends each follow-up to the engine that stored its response
    env.setdefault("VLLM_ENABLE_RESPONSES_API_STORE", "1")

    def add(flag: str, *values: str) -> None:
        if flag in flags:
            argv.extend([flag, *values])
        else:
            log.debug("installed vLLM has no %s; not passing it", flag)

    if model.load_format != "auto":
        add("--load-format", model.load_format)
    if model.max_model_len_tokens is not None:
        add("--max-model-len", str(model.max_model_len_tokens))
    if kv_cache_bytes is not None:
        if "--kv-cache-memory-bytes" in flags:
            argv.extend(["--kv-cache-memory-bytes", str(kv_cache_bytes)])
        elif gpu_ids is None:
            gib = max(1, round(kv_cache_bytes / 2**30))
            env["VLLM_CPU_KVCACHE_SPACE"] = str(gib)
        else:
            log.warning("installed vLLM has no --kv-cache-memory-bytes; using its default size")
    if gpu_ids is None:
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        add("--distributed-executor-backend", "uni")
        add("--enforce-eager")
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
        if len(gpu_ids) > 1:
            add("--tensor-parallel-size", str(len(gpu_ids)))
    user_args = list(local.vllm_args)
    # The dev model's tokenizer has hermes-style <tool_call> tokens; agents send `tools`, which
    # vLLM refuses without a tool parser. Real models choose their parser in vllm_args.
    if (
        "--enable-auto-tool-choice" not in user_args
        and (model.path / "config.json").is_file()
        and "gpupool_dev_model_shape" in (model.path / "config.json").read_text()
    ):
        add("--enable-auto-tool-choice")
        add("--tool-call-parser", "hermes")
    if "--disable-uvicorn-access-log" in flags:
        argv.append("--disable-uvicorn-access-log")
    # Prompts stay out of the engine's log: vLLM 0.32 logs requests only with
    # --enable-log-requests (off by default); older ones did unless --disable-log-requests.
    # --max-log-len 0 also truncates prompts and outputs to nothing if a user turns it on.
    if "--disable-log-requests" in flags and "--enable-log-requests" not in flags:
        argv.append("--disable-log-requests")
    add("--max-log-len", "0")
    for flag in ("--enable-log-requests", "--enable-log-outputs"):
        if flag in user_args:
            log.warning("engines.local.vllm_args has %s: engines will log request details", flag)
    if api_key is not None:
        # Through the environment, not `--api-key`: argv is world-readable and logged.
        env["VLLM_API_KEY"] = api_key
        # vLLM's own check covers only /v1, /v2, /inference and /cohere; the guard covers the
        # rest (/invocations runs the same handlers), all but /health and /metrics.
        if "--middleware" in flags:
            argv.extend(["--middleware", GUARD_MIDDLEWARE])
        else:
            log.warning(
                "installed vLLM has no --middleware: its key guards only /v1, /v2, /inference"
            )
    spec = _kv_events(local, index, flags, kv_events) if kv_events else None
    if spec is not None:
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": engine_bind_endpoint(spec.endpoint),
            "replay_endpoint": (
                None if spec.replay_endpoint is None else engine_bind_endpoint(spec.replay_endpoint)
            ),
            "topic": spec.topic,
        }
        argv.extend(["--kv-events-config", json.dumps(config, separators=(",", ":"))])
        argv.extend(["--prefix-caching-hash-algo", "sha256_cbor"])
    if traces is not None and "--otlp-traces-endpoint" not in user_args:
        if "--otlp-traces-endpoint" in flags:
            argv.extend(["--otlp-traces-endpoint", traces.url])
            env.update(traces.env())
        else:
            log.warning("installed vLLM has no --otlp-traces-endpoint: engines export no spans")
    argv.extend(user_args)
    for key, value in local.env:
        env[key] = value
    remove = local.secret_env | ({"PYTHONHASHSEED"} if spec is not None else set())
    return EngineCommand(
        argv=tuple(argv), env=env, port=port, env_remove=frozenset(remove), kv_events=spec
    )


def _kv_events(
    local: LocalEnginesConfig, index: int, flags: frozenset[str], given: bool | KvEventsSpec
) -> KvEventsSpec | None:
    missing = {"--kv-events-config", "--prefix-caching-hash-algo"} - flags
    if missing:
        log.warning("installed vLLM has no %s: engines publish no KV events", sorted(missing))
        return None
    return given if isinstance(given, KvEventsSpec) else local_kv_events(local, index)


def engine_bind_endpoint(endpoint: str) -> str:
    """What the engine binds for an endpoint the router connects to: a socket file as is,
    `tcp://<host>:<port>` as `tcp://*:<port>` (vLLM's publisher binds an endpoint with `*` and
    connects to any other TCP one; the host is the router's way to the engine's node)."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    _, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"KV events endpoint {endpoint!r} has no port")
    return f"tcp://*:{port}"


def local_kv_events(local: LocalEnginesConfig, index: int) -> KvEventsSpec:
    """Where local engine `index` publishes its KV events (`build_engine_command` with
    `kv_events`), for a router that finds the engines already running."""
    pub, replay = (kv_events_socket(local.run_dir, index, kind) for kind in ("pub", "replay"))
    return KvEventsSpec(
        endpoint=f"ipc://{pub}",
        replay_endpoint=f"ipc://{replay}",
        hash_seed=dict(local.env).get("PYTHONHASHSEED"),
    )
