"""The `local` launcher: N vLLM OpenAI servers as child processes of this one.

Each engine gets its own port (`base_port + i`), its own log file under the run directory,
its GPUs on a GPU machine (`CUDA_VISIBLE_DEVICES`, `gpus_per_instance` each, taken in order
from the GPUs gpupool's own `CUDA_VISIBLE_DEVICES` lists), and optionally a CPU affinity. The
dtype and KV size come from the engine plan (`engine_plan.py`). Each engine requires a key
(a random one per engine and launch unless `engines.local.api_key_env` names one), which its
`InstanceSpec.api_key` carries to the router; the env vars holding gpupool's own keys are not
passed on. `start()` waits for every `/health` with progress lines and a timeout. A
supervisor restarts an engine that dies, with exponential backoff, and says so in the log.
`aclose()` stops every engine it started: SIGTERM to the engine's process group, SIGKILL after
the grace period.

No orphans, also when gpupool itself is killed: each engine runs in its own session with
`PR_SET_PDEATHSIG=SIGTERM` (Linux), so it is told when its parent dies; and a pid file per
engine lets the next start kill engines left behind by a parent that died anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import psutil

from pools.config import LocalEnginesConfig, ModelConfig
from pools.launchers.base import InstanceSpec, LauncherError, ProgressFn
from pools.launchers.engine_args import (
    EngineCommand,
    EngineTraces,
    build_engine_command,
    engine_environ,
    kv_events_socket,
    private_socket_dir,
    supported_vllm_flags,
)
from pools.launchers.engine_plan import (
    EnginePlan,
    HostFacts,
    plan_engines,
    plan_problems,
    probe_host,
)
from pools.launchers.health import wait_healthy

__all__ = ["EngineProcess", "LocalLauncher", "gpu_assignment"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _child_setup(cpus: tuple[int, ...] | None) -> Callable[[], None]:
    """Runs in the child between fork and exec: parent-death signal and CPU affinity."""

    def setup() -> None:
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):
                libc = ctypes.CDLL("libc.so.6", use_errno=True)
                libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if cpus:
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(0, set(cpus))

    return setup


def _kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _group_alive(pgid: int) -> bool:
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            if os.getpgid(proc.info["pid"]) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                return True
    return False


class EngineProcess:
    """One supervised vLLM server process (and whatever it spawns, in its process group)."""

    def __init__(
        self,
        spec: InstanceSpec,
        command: EngineCommand,
        *,
        log_path: Path,
        pid_path: Path,
        cpus: tuple[int, ...] | None,
        backoff_s: float,
        backoff_max_s: float,
        grace_s: float,
        parent_env: Mapping[str, str] | None = None,
    ) -> None:
        self.spec = spec
        self.parent_env = os.environ if parent_env is None else parent_env
        self.command = command
        self.log_path = log_path
        self.pid_path = pid_path
        self.cpus = cpus
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.grace_s = grace_s
        self.restarts = 0
        self.exit_reason: str | None = None  # set while the process is down
        self._proc: asyncio.subprocess.Process | None = None
        self._stopping = False
        self._supervisor: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = engine_environ(self.parent_env, self.command)
        with self.log_path.open("ab") as logfile:
            logfile.write(
                f"\n=== gpupool: starting {self.spec.instance_id} at {time.ctime()}: "
                f"{' '.join(self.command.argv)}\n".encode()
            )
            logfile.flush()
            self._proc = await asyncio.create_subprocess_exec(
                *self.command.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=logfile,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_child_setup(self.cpus),
            )
        self.pid_path.write_text(f"{self._proc.pid} {self.command.port}\n")
        self.exit_reason = None
        if self._supervisor is None:
            self._supervisor = asyncio.create_task(
                self._supervise(), name=f"supervise-{self.spec.instance_id}"
            )

    def down_reason(self) -> str | None:
        """Why this engine cannot become healthy right now (None while it is running)."""
        return self.exit_reason

    async def _supervise(self) -> None:
        consecutive = 0
        while not self._stopping:
            proc = self._proc
            assert proc is not None
            started = time.monotonic()
            code = await proc.wait()
            # The engine's children (EngineCore) share its process group; take them down too.
            _kill_group(proc.pid, signal.SIGKILL)
            if self._stopping:
                return
            consecutive = 1 if time.monotonic() - started > 120 else consecutive + 1
            delay = min(self.backoff_max_s, self.backoff_s * 2 ** (consecutive - 1))
            self.exit_reason = f"exited with code {code}"
            log.warning(
                "%s %s; restarting in %.1f s (restart #%d); log: %s",
                self.spec.instance_id,
                self.exit_reason,
                delay,
                self.restarts + 1,
                self.log_path,
            )
            await asyncio.sleep(delay)
            if self._stopping:
                return
            self.restarts += 1
            await self.spawn()

    async def stop(self) -> None:
        self._stopping = True
        proc = self._proc
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
            self._supervisor = None
        if proc is None:
            return
        if proc.returncode is None:
            _kill_group(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout=self.grace_s)
            except TimeoutError:
                log.warning(
                    "%s did not stop within %.0f s; killing", self.spec.instance_id, self.grace_s
                )
        _kill_group(proc.pid, signal.SIGKILL)
        if proc.returncode is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), timeout=5)
        # Children that outlived the leader still carry its process group id.
        deadline = time.monotonic() + 5
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            _kill_group(proc.pid, signal.SIGKILL)
            await asyncio.sleep(0.1)
        self.pid_path.unlink(missing_ok=True)


def kill_leftover_engines(run_dir: Path) -> list[int]:
    """Kill engines recorded in pid files of `run_dir` whose parent died without stopping them.

    A pid is only killed if it still runs a vLLM server; returns the pids killed.
    """
    killed = []
    for pid_file in run_dir.glob("engine-*.pid"):
        try:
            pid = int(pid_file.read_text().split()[0])
            proc = psutil.Process(pid)
            if "vllm.entrypoints" in " ".join(proc.cmdline()):
                _kill_group(pid, signal.SIGKILL)
                killed.append(pid)
                log.warning("killed engine pid %d left behind by an earlier run", pid)
        except (ValueError, IndexError, psutil.Error, OSError):
            pass
        pid_file.unlink(missing_ok=True)
    return killed


def gpu_assignment(
    count: int, per_instance: int, gpu_count: int, parent_visible: str | None
) -> list[list[str] | None]:
    """The CUDA device ids of each engine (None each: CPU engines when `gpu_count` is 0).

    Engine i takes slots `i*per_instance ... (i+1)*per_instance - 1` of the GPUs this process
    may use; with the parent's own `CUDA_VISIBLE_DEVICES` (`parent_visible`, indices or UUIDs)
    slot k is that list's k-th entry, else device index k.
    """
    if gpu_count == 0:
        return [None] * count
    if gpu_count < count * per_instance:
        raise LauncherError(
            f"{count} engines x {per_instance} GPUs need {count * per_instance} GPUs; this"
            f" machine has {gpu_count}"
        )
    devices = [str(k) for k in range(gpu_count)]
    if parent_visible is not None:
        devices = [d.strip() for d in parent_visible.split(",") if d.strip()]
    return [devices[i * per_instance : (i + 1) * per_instance] for i in range(count)]


class LocalLauncher:
    """Starts, supervises and stops `count` local vLLM engines."""

    def __init__(
        self,
        local: LocalEnginesConfig,
        model: ModelConfig,
        *,
        progress: ProgressFn | None = None,
        gpu_count: int | None = None,
        host: HostFacts | None = None,
        python: str = sys.executable,
        environ: Mapping[str, str] | None = None,
        kv_events: bool = True,
        traces: EngineTraces | None = None,
    ) -> None:
        if local.cpu_affinity is not None and len(local.cpu_affinity) != local.count:
            raise LauncherError(
                f"engines.local.cpu_affinity: {len(local.cpu_affinity)} CPU lists for"
                f" {local.count} engines; give one list per engine"
            )
        self._local = local
        self._model = model
        self._progress = progress
        self._gpu_count = gpu_count  # overrides the host's GPU count (tests: 0)
        self._kv_events = kv_events  # engines.kv_events: engines publish KV cache events
        self._traces = traces  # observability.engine_traces: where engines export spans
        self._host = host  # None: probed at start()
        self._python = python
        self._environ = os.environ if environ is None else environ  # the engines' parent env
        self._engines: list[EngineProcess] = []

    @property
    def engines(self) -> list[EngineProcess]:
        return list(self._engines)

    @property
    def instances(self) -> list[InstanceSpec]:
        return [e.spec for e in self._engines]

    def prepare(self, host: HostFacts, flags: frozenset[str]) -> EnginePlan:
        """Plan the engines for `host` and build their commands; starts nothing. Raises
        `LauncherError` when an engine could not start (e.g. KV for less than one sequence)."""
        local = self._local
        if self._gpu_count is not None:
            host = dataclasses.replace(host, gpu_count=self._gpu_count)
        plan = plan_engines(local, self._model, host)
        problems = plan_problems(local, plan, host)
        if problems:
            raise LauncherError("; ".join(problems))
        assignment = gpu_assignment(
            local.count,
            local.gpus_per_instance,
            host.gpu_count,
            self._environ.get("CUDA_VISIBLE_DEVICES"),
        )
        self._engines = []
        for i, gpu_ids in enumerate(assignment):
            # the engine's key: the configured one, else a new random one per engine and launch
            key = local.api_key or secrets.token_urlsafe(32)
            command = build_engine_command(
                model=self._model,
                local=local,
                index=i,
                gpu_ids=gpu_ids,
                flags=flags,
                python=self._python,
                plan=plan,
                api_key=key,
                kv_events=self._kv_events,
                traces=self._traces,
            )
            spec = InstanceSpec(
                instance_id=f"engine-{i}",
                url=f"http://{local.host}:{command.port}",
                gpus=local.gpus_per_instance,
                api_key=key,
                kv_events=command.kv_events,
            )
            cpus = local.cpu_affinity[i] if local.cpu_affinity else None
            self._engines.append(
                EngineProcess(
                    spec,
                    command,
                    log_path=local.run_dir / f"engine-{i}.log",
                    pid_path=local.run_dir / f"engine-{i}.pid",
                    cpus=cpus,
                    backoff_s=local.restart_backoff_s,
                    backoff_max_s=local.restart_backoff_max_s,
                    grace_s=local.stop_grace_s,
                    parent_env=self._environ,
                )
            )
        return plan

    async def start(self) -> list[InstanceSpec]:
        local = self._local
        if not (self._model.path / "config.json").is_file():
            raise LauncherError(
                f"model folder {self._model.path} has no config.json (run `gpupool dev-model`)"
            )
        run_dir = local.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        if self._kv_events:  # a run_dir too long for a socket path puts them under /tmp
            sockets = {kv_events_socket(run_dir, i, "pub").parent for i in range(local.count)}
            for folder in sockets - {run_dir}:
                try:
                    private_socket_dir(folder)
                except OSError as err:
                    raise LauncherError(f"KV event sockets: {err}") from err
        kill_leftover_engines(run_dir)
        host = self._host if self._host is not None else await asyncio.to_thread(probe_host)
        flags = await asyncio.to_thread(supported_vllm_flags, run_dir, self._python)
        plan = self.prepare(host, flags)
        kind = "CPU" if plan.on_cpu else "GPU"
        self._say(f"engine dtype {plan.dtype}: {plan.dtype_reason}")
        self._say(f"KV cache: {plan.kv_reason}")
        self._say(f"starting {len(self._engines)} {kind} vLLM engine(s); logs in {run_dir}")
        try:
            for engine in self._engines:
                await engine.spawn()
            by_id = {e.spec.instance_id: e for e in self._engines}
            missing = await wait_healthy(
                {e.spec.instance_id: e.spec.url for e in self._engines},
                time.monotonic() + local.startup_timeout_s,
                self._progress,
                alive=lambda iid: by_id[iid].down_reason(),
            )
            if missing:
                details = "; ".join(
                    f"{iid}: {by_id[iid].down_reason() or 'no /health answer'}, log tail:\n"
                    + _tail(by_id[iid].log_path)
                    for iid in missing
                )
                raise LauncherError(
                    f"{len(missing)} engine(s) did not become healthy within "
                    f"{local.startup_timeout_s:.0f} s: {details}"
                )
        except BaseException:
            await self.aclose()
            raise
        return self.instances

    def _say(self, message: str) -> None:
        log.info("%s", message)
        if self._progress:
            self._progress(message)

    async def aclose(self) -> None:
        await asyncio.gather(*(e.stop() for e in self._engines), return_exceptions=True)
        await asyncio.to_thread(
            _remove_kv_event_sockets, [e.spec for e in self._engines], self._local.run_dir
        )


def _remove_kv_event_sockets(specs: list[InstanceSpec], run_dir: Path) -> None:
    """The socket files a stopped engine leaves (vLLM does not close its publisher on exit),
    and the private folder under /tmp that held them when `run_dir` was too long for them,
    once it is empty."""
    folders: set[Path] = set()
    for spec in specs:
        events = spec.kv_events
        for endpoint in () if events is None else (events.endpoint, events.replay_endpoint):
            if endpoint is not None and endpoint.startswith("ipc://"):
                path = Path(endpoint.removeprefix("ipc://"))
                path.unlink(missing_ok=True)
                folders.add(path.parent)
    for folder in folders - {run_dir}:
        with contextlib.suppress(OSError):  # not empty: another launcher's sockets are there
            folder.rmdir()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in text[-lines:])
