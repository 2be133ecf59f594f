"""The `ray` launcher: each engine is a Ray actor holding `gpus_per_instance` GPUs (tensor
parallel inside that one actor's bundle; 0: a CPU engine holding `cpus_per_instance` CPUs),
on an existing cluster (`engines.ray.address`: "auto" or "host:port") or a local one (None).

The actor (`EngineHost`) runs on whichever node Ray chose: it picks a free port there, builds
the vLLM command with the same launcher-neutral builder as the local launcher
(`engine_args.build_engine_command`, with `engine_plan.plan_engines` run on that node, so
dtype and KV size fit the node), sets itself back to niceness 0 (Ray runs its workers at 15,
which the engine would inherit), and starts the engine as its child under `reaper.py`, which
takes the engine's whole process tree (its OpenAI server and `VLLM::EngineCore`) down when the
engine exits, when the actor stops it, or when the actor's process dies (`ray.kill`). When the
engine exits, the actor exits too, and Ray restarts the actor (`max_restarts`), which starts a
new engine, possibly on another node and port.

The router finds the engines through `source` (`RayEngineSource`): every poll asks each
actor for its address; an actor that is dead or restarting does not answer in time and is
left out of the answer (the router drains it), and when it answers again, at its new address,
the router readmits it after a good scrape. Instance ids are stable (`ray-engine-<i>`).

With `engines.kv_events` on (the default here) each engine also publishes its KV cache events
(docs/prefix_cache.md) on TCP, since a socket file on another node does not reach the router:
the actor picks two more free ports on its node (from the engine's slots of `port_range`
when one is set), the engine binds its PUB and replay sockets on every interface there, and
the actor answers `tcp://<node ip>:<port>` for each beside its URL (`KvEventsSpec`).
`aclose()` stops each engine, then kills its actor (no restart); a local cluster is shut down.
The actors are owned by this process: if it dies, Ray takes them down, and their reapers take
their engines down.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pools.config import LocalEnginesConfig, ModelConfig, RayEnginesConfig
from pools.discovery.base import TimingFromConfig
from pools.launchers.base import InstanceSpec, KvEventsSpec, LauncherError, ProgressFn
from pools.launchers.engine_args import (
    EngineTraces,
    build_engine_command,
    engine_environ,
    supported_vllm_flags,
)
from pools.launchers.engine_plan import plan_engines, plan_problems, probe_host
from pools.launchers.health import wait_healthy
from pools.launchers.reaper import ReapedProcess

__all__ = [
    "EngineHost",
    "RayEngineSource",
    "RayLauncher",
    "engine_settings",
    "undo_worker_niceness",
]

log = logging.getLogger(__name__)


def undo_worker_niceness(target: int = 0) -> str | None:
    """Ray renices its workers to 15 (`RAY_worker_niceness`), and an engine started by an actor
    would inherit it: on a busy node its scheduler (CPU work on every step) would then run behind
    everything else. Set this process (the actor, whose children the engine and its EngineCore
    are) back to `target`. None when done or not needed; where the node forbids lowering it
    (no root, no CAP_SYS_NICE), what to do instead, for the caller to say."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if current <= target:
        return None
    try:
        os.setpriority(os.PRIO_PROCESS, 0, target)
    except PermissionError:
        return (
            f"the engine runs at niceness {current} (Ray's worker niceness) and this node does "
            f"not let the actor lower it to {target}: start Ray with RAY_worker_niceness={target} "
            "in its environment, or give its workers CAP_SYS_NICE"
        )
    return None


def engine_settings(ray: RayEnginesConfig, *, port: int, run_dir: Path) -> LocalEnginesConfig:
    """The engine settings `build_engine_command` and `plan_engines` read, for one Ray engine
    listening on `port` on all interfaces (the router reaches it from another node)."""
    return LocalEnginesConfig(
        count=ray.count,  # a CPU engine's default KV share assumes `count` engines on a node
        gpus_per_instance=max(1, ray.gpus_per_instance),
        host="0.0.0.0",
        base_port=port,
        kv_cache_bytes=ray.kv_cache_bytes,
        vllm_args=ray.vllm_args,
        env=ray.env,
        cpu_affinity=None,
        startup_timeout_s=ray.startup_timeout_s,
        restart_backoff_s=1.0,
        restart_backoff_max_s=1.0,
        stop_grace_s=15.0,
        run_dir=run_dir,
        api_key=ray.api_key,
        secret_env=ray.secret_env,
    )


def _free_port(port_range: tuple[int, int] | None, index: int = 0, count: int = 1) -> int:
    """A port free on this node now: from `port_range`, engine `index` of `count` tries only
    `first + index`, `first + index + count`, ... (two engines starting on one node at once
    never pick the same port: vLLM listens with SO_REUSEPORT, so both would bind it and the
    kernel would split connections between them); without a range, any free port."""
    return _free_ports(port_range, index, count, 1)[0]


def _free_ports(
    port_range: tuple[int, int] | None, index: int = 0, count: int = 1, n: int = 1
) -> list[int]:
    """`n` distinct ports free on this node now, from engine `index`'s slots of `port_range`
    (as `_free_port`); without a range, any free ones (held together while picked, so the
    OS hands out distinct ones)."""
    if port_range is None:
        candidates: range | list[int] = [0] * n
    else:
        candidates = range(port_range[0] + index, port_range[1] + 1, max(1, count))
    found: list[int] = []
    with contextlib.ExitStack() as held:
        for port in candidates:
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            found.append(int(s.getsockname()[1]))
            if len(found) == n:
                return found
    needs = f" (of the {n} it needs: HTTP, KV events, their replay)" if n > 1 else ""
    raise LauncherError(
        f"engines.ray.port_range {port_range}: no free port for engine {index} on this node{needs}"
    )


def ray_kv_events(
    node_ip: str, pub_port: int, replay_port: int, env: dict[str, str]
) -> KvEventsSpec:
    """Where a Ray engine on `node_ip` publishes its KV events, as the router connects to it."""
    host = f"[{node_ip}]" if ":" in node_ip else node_ip
    return KvEventsSpec(
        endpoint=f"tcp://{host}:{pub_port}",
        replay_endpoint=f"tcp://{host}:{replay_port}",
        hash_seed=env.get("PYTHONHASHSEED"),
    )


class EngineHost:
    """The body of one engine actor (wrapped by `ray.remote` at launch). Runs on a Ray node."""

    def __init__(
        self,
        index: int,
        ray_config: RayEnginesConfig,
        model: ModelConfig,
        api_key: str,
        traces: EngineTraces | None = None,
        kv_events: bool = False,
    ) -> None:
        import ray

        run_dir = Path(tempfile.gettempdir()) / "gpupool-ray"
        run_dir.mkdir(parents=True, exist_ok=True)
        ports = _free_ports(ray_config.port_range, index, ray_config.count, 3 if kv_events else 1)
        port = ports[0]
        settings = engine_settings(ray_config, port=port, run_dir=run_dir)
        node_ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        events = (
            ray_kv_events(node_ip, ports[1], ports[2], dict(ray_config.env)) if kv_events else None
        )
        host = probe_host()
        gpu_ids = [str(g) for g in ray.get_gpu_ids()] if ray_config.gpus_per_instance else None
        if gpu_ids is None:
            host = dataclasses.replace(host, gpu_count=0)
        plan = plan_engines(settings, model, host)
        problems = plan_problems(dataclasses.replace(settings, count=1), plan, host)
        if problems:
            raise LauncherError("; ".join(problems))
        command = build_engine_command(
            model=model,
            local=settings,
            index=0,
            gpu_ids=gpu_ids,
            flags=supported_vllm_flags(run_dir),
            plan=plan,
            api_key=api_key,
            kv_events=events or False,
            traces=traces,
        )
        self.url = f"http://{node_ip}:{port}"
        self.kv_events = command.kv_events  # None: this vLLM cannot publish them
        self.log_path = run_dir / f"engine-{index}-{port}.log"
        problem = undo_worker_niceness()
        if problem:
            print(f"gpupool: {problem}")  # the actor's stdout: Ray's worker log
        with self.log_path.open("ab") as logfile:
            self._proc = ReapedProcess(
                command.argv,
                settings.stop_grace_s,
                env=engine_environ(os.environ, command),
                stdout=logfile,
            )
        self._stopping = False
        threading.Thread(target=self._watch, name="engine-watch", daemon=True).start()

    def _watch(self) -> None:
        """The engine exited on its own: end this actor, so Ray restarts it (a new engine)."""
        code = self._proc.wait()
        if not self._stopping:
            print(f"gpupool: engine at {self.url} exited with {code}; restarting the actor")
            os._exit(1)

    def address(self) -> tuple[str, KvEventsSpec | None]:
        """The engine's URL and where it publishes KV events (None: nowhere)."""
        return self.url, self.kv_events

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the reaper, which gives the engine its grace (the reaper's own, from
        `engine_settings`) and then kills what is left; should the reaper not be done
        `grace_s` later, its whole tree gets SIGKILL here."""
        self._stopping = True
        self._proc.terminate()
        if self._proc.wait(grace_s + 5.0) is None:
            self._proc.kill()


class RayEngineSource(TimingFromConfig):
    """Each poll asks every engine actor for its address; one that does not answer within
    `answer_timeout_s` (dead, restarting, or still placing) is left out."""

    _config: RayEnginesConfig

    def __init__(
        self,
        config: RayEnginesConfig,
        actors: list[Any],
        api_key: str,
        *,
        get: Callable[[Any, float], Any],
        answer_timeout_s: float = 2.0,
    ) -> None:
        self._config = config
        self._actors = actors
        self._api_key = api_key
        self._get = get
        self._answer_timeout_s = answer_timeout_s

    async def poll(self) -> list[InstanceSpec]:
        refs = [actor.address.remote() for actor in self._actors]
        answers = await asyncio.gather(*(asyncio.to_thread(self._answer, ref) for ref in refs))
        return [
            InstanceSpec(
                instance_id=f"ray-engine-{i}",
                url=answer[0],
                gpus=max(1, self._config.gpus_per_instance),
                api_key=self._api_key,
                kv_events=answer[1],
            )
            for i, answer in enumerate(answers)
            if answer is not None
        ]

    def _answer(self, ref: Any) -> tuple[str, KvEventsSpec | None] | None:
        try:
            url, events = self._get(ref, self._answer_timeout_s)
        except Exception as err:  # RayActorError, GetTimeoutError, ...: not reachable now
            log.debug("a Ray engine actor did not answer: %s", type(err).__name__)
            return None
        return str(url), events if isinstance(events, KvEventsSpec) else None


class RayLauncher:
    """Places `count` vLLM engines on a Ray cluster and stops them."""

    def __init__(
        self,
        config: RayEnginesConfig,
        model: ModelConfig,
        *,
        progress: ProgressFn | None = None,
        traces: EngineTraces | None = None,
        kv_events: bool = True,
    ) -> None:
        self._config = config
        self._model = model
        self._traces = traces  # observability.engine_traces: where engines export spans
        self._kv_events = kv_events  # engines.kv_events: engines publish KV cache events
        self._progress = progress
        self._ray: Any = None
        self._actors: list[Any] = []
        self._owns_driver = False
        self._key = config.api_key or secrets.token_urlsafe(32)
        self.source: RayEngineSource | None = None
        self._instances: list[InstanceSpec] = []

    @property
    def instances(self) -> list[InstanceSpec]:
        return list(self._instances)

    @property
    def actors(self) -> list[Any]:
        return list(self._actors)

    def _say(self, message: str) -> None:
        log.info("%s", message)
        if self._progress is not None:
            self._progress(message)

    def _connect(self) -> Any:
        try:
            import ray
        except ImportError:
            raise LauncherError(
                "engines.launcher 'ray' needs Ray: pip install 'ray>=2.40' (make install does)"
            ) from None
        # this launcher connects the driver (and so disconnects it at aclose): a driver left
        # connected to a cluster that goes away ends its whole process 60 s later (Ray's
        # "Failed to connect to GCS ... The program will terminate")
        self._owns_driver = not ray.is_initialized()
        ray.init(
            address=self._config.address,
            namespace=self._config.namespace,
            include_dashboard=False,
            ignore_reinit_error=True,
            log_to_driver=False,
            configure_logging=False,
        )
        return ray

    async def start(self) -> list[InstanceSpec]:
        cfg = self._config
        where = cfg.address or "a local Ray cluster"
        self._say(f"connecting to {where}")
        try:
            ray = self._ray = await asyncio.to_thread(self._connect)
        except LauncherError:
            raise
        except Exception as err:
            raise LauncherError(f"cannot join Ray at {where}: {err}") from None
        host_cls = ray.remote(EngineHost)
        resources = (
            {"num_gpus": cfg.gpus_per_instance, "num_cpus": cfg.cpus_per_instance}
            if cfg.gpus_per_instance
            else {"num_gpus": 0, "num_cpus": cfg.cpus_per_instance}
        )
        self._actors = [
            host_cls.options(
                name=f"gpupool-engine-{i}",
                max_restarts=cfg.max_restarts,
                max_task_retries=0,
                **resources,
            ).remote(i, cfg, self._model, self._key, self._traces, self._kv_events)
            for i in range(cfg.count)
        ]
        self.source = RayEngineSource(cfg, self._actors, self._key, get=self._get)
        self._say(
            f"placed {cfg.count} engine actor(s) ({cfg.gpus_per_instance} GPU(s),"
            f" {cfg.cpus_per_instance:g} CPU(s) each); waiting for their engines"
        )
        try:
            deadline = time.monotonic() + cfg.startup_timeout_s
            specs: list[InstanceSpec] = []
            while time.monotonic() < deadline:
                specs = await self.source.poll()
                if len(specs) == cfg.count:
                    break
                await asyncio.sleep(0.5)
            if len(specs) < cfg.count:
                raise LauncherError(
                    f"{cfg.count - len(specs)} of {cfg.count} Ray engine actor(s) were not placed"
                    f" within {cfg.startup_timeout_s:.0f} s (does the cluster have"
                    f" {cfg.gpus_per_instance} GPU(s) and {cfg.cpus_per_instance:g} CPU(s) free"
                    " per engine? `ray status` shows it)"
                )
            missing = await wait_healthy(
                {s.instance_id: s.url for s in specs}, deadline, self._progress
            )
            if missing:
                raise LauncherError(
                    f"Ray engine(s) {', '.join(missing)} did not answer /health within"
                    f" {cfg.startup_timeout_s:.0f} s (their logs are in the actors' nodes'"
                    f" {tempfile.gettempdir()}/gpupool-ray/)"
                )
        except BaseException:
            await self.aclose()
            raise
        self._instances = specs
        return self.instances

    def _get(self, ref: Any, timeout_s: float) -> Any:
        return self._ray.get(ref, timeout=timeout_s)

    async def aclose(self) -> None:
        ray = self._ray
        if ray is None:
            return
        actors, self._actors = self._actors, []

        def stop_all() -> None:
            stops = [actor.stop.remote() for actor in actors]
            with contextlib.suppress(Exception):
                ray.wait(stops, num_returns=len(stops), timeout=30)
            for actor in actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
            if self._owns_driver:  # disconnects; stops the cluster only if it started one
                ray.shutdown()

        await asyncio.to_thread(stop_all)
        self._ray = None
