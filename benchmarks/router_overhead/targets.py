"""The five targets, each in front of the same engine: how to start it, where it listens,
and why it cannot run when it cannot.

- `direct`: the engine itself, the limit (no proxy process);
- `gpupool`: `gpupool serve` over one static URL (both pools split one instance), the code of
  the checkout `--repo` names (default: the current directory);
  `gpupool-admission-off` and `gpupool-ledger-batched`: the same with `router.admission: off`
  or `router.ledger_durable: false`, for an A/B in the same run;
  `gpupool-baseline`: the same config from another checkout (`--baseline PATH`, e.g. a
  `git worktree` at the commit before a change), for a before/after in one run;
  `gpupool-trace-1`, `gpupool-trace-0.01` and `gpupool-trace-0`: the same with OpenTelemetry
  traces on (`observability.sample_ratio` 1.0, 0.01 and 0: tracing's hooks with nothing
  sampled, nothing exported), exporting to an OTLP/HTTP sink (`otlp_sink.py`, a process of
  its own on the load generator's CPU), for tracing's cost beside `gpupool` in the same run;
- `vllm-router`: vllm-project's Rust router (`pip install vllm-router`), round robin;
- `production-stack`: vLLM production-stack's Python router from a source snapshot, static
  discovery, round robin;
- `litellm`: LiteLLM's proxy (`pip install 'litellm[proxy]'`), one worker, no database.

Every proxy runs with its request logging at warning level or off, one worker process.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PeerPaths", "TargetSpec", "make_targets"]

MODEL = "tiny"


@dataclass(frozen=True)
class PeerPaths:
    """Where the peers are installed (git-ignored folders, never committed)."""

    repo: Path
    gpupool_venv: Path
    vllm_router_venv: Path
    pstack_venv: Path
    pstack_src: Path
    litellm_venv: Path
    baseline: Path | None = None  # another gpupool checkout, run as `gpupool-baseline`

    @classmethod
    def default(cls, repo: Path, baseline: Path | None = None) -> PeerPaths:
        peers = repo / ".venv-peers"
        return cls(
            baseline=baseline,
            repo=repo,
            gpupool_venv=repo / ".venv",
            vllm_router_venv=peers / "vllmrouter",
            pstack_venv=peers / "pstack",
            pstack_src=repo / "third_party" / "production-stack" / "src",
            litellm_venv=peers / "litellm",
        )


@dataclass(frozen=True)
class TargetSpec:
    """How to run one target. `argv` is None for the direct engine (nothing to start)."""

    name: str
    port: int
    argv: list[str] | None
    ready_path: str = "/v1/models"
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    needs: tuple[Path, ...] = ()
    install_hint: str = ""
    start_timeout_s: float = 60.0
    note: str = ""

    def missing(self) -> str | None:
        """Why this target cannot run here, or None."""
        absent = [str(p) for p in self.needs if not p.exists()]
        if absent:
            return f"not installed ({', '.join(absent)} missing): {self.install_hint}"
        return None


def gpupool_config(
    engine_url: str,
    state_dir: Path,
    admission: str = "on",
    ledger_durable: bool = True,
    observability: dict[str, object] | None = None,
) -> dict[str, object]:
    """One static engine shared by both pools (the single-GPU split)."""
    return {
        **({"observability": observability} if observability is not None else {}),
        "model": {"name": MODEL, "path": "./.gpupool/models/tiny"},
        "engines": {"launcher": "static", "static": {"urls": [engine_url]}},
        "pools": {
            "agent": {"classes": ["agent"], "share": {"initial_frac": 0.5}},
            "normal": {"classes": ["normal"], "share": {"initial_frac": 0.5}},
        },
        "router": {
            "ledger_path": str(state_dir / "ledger.sqlite"),
            "state_path": str(state_dir / "state.json"),
            "admission": admission,
            "ledger_durable": ledger_durable,
        },
    }


def _litellm_config(engine_url: str) -> str:
    return "\n".join(
        [
            "model_list:",
            f"  - model_name: {MODEL}",
            "    litellm_params:",
            f"      model: hosted_vllm/{MODEL}",
            f"      api_base: {engine_url}/v1",
            "      api_key: none",
            "litellm_settings:",
            "  telemetry: false",
            "  turn_off_message_logging: true",
            "",
        ]
    )


def gpupool_target(
    name: str,
    port: int,
    engine_url: str,
    paths: PeerPaths,
    workdir: Path,
    admission: str = "on",
    ledger_durable: bool = True,
    checkout: Path | None = None,
    observability: dict[str, object] | None = None,
) -> TargetSpec:
    """`gpupool serve` over one static engine (admission on, or off for comparison; the
    durable ledger, or the batched one for comparison), running the code of `checkout`
    (default `paths.repo`) with the gpupool venv's Python and packages."""
    state = workdir / f"{name}-state"
    state.mkdir(parents=True, exist_ok=True)
    cfg = workdir / f"{name}.json"
    cfg.write_text(
        json.dumps(gpupool_config(engine_url, state, admission, ledger_durable, observability))
    )
    python = paths.gpupool_venv / "bin" / "python"
    code = checkout if checkout is not None else paths.repo
    return TargetSpec(
        name=name,
        port=port,
        # -P: the checkout on PYTHONPATH comes first, ahead of the venv's editable install
        argv=[
            *(str(python), "-P", "-c", _GPUPOOL_MAIN),
            *("serve", "--config", str(cfg), "--port", str(port)),
        ],
        ready_path="/ready",
        env={"PYTHONPATH": str(code)},
        cwd=paths.repo,  # where ./.gpupool/models/tiny is
        needs=(python, code / "router" / "cli" / "__init__.py"),
        install_hint="pip install -e . into .venv",
        note="gpupool serve, one static engine split between the agent and normal pools"
        f", admission {admission}, ledger {'durable' if ledger_durable else 'batched'}"
        + (f", traces at ratio {observability['sample_ratio']}" if observability else "")
        + (f", code of {code}" if checkout is not None else ""),
    )


_GPUPOOL_MAIN = "import sys; from router.cli import main; sys.argv[0] = 'gpupool'; sys.exit(main())"


def vllm_router_target(
    name: str, port: int, metrics_port: int, engine_url: str, paths: PeerPaths
) -> TargetSpec:
    """vllm-project's Rust router over one engine, round robin."""
    vr = paths.vllm_router_venv / "bin" / "vllm-router"
    return TargetSpec(
        name=name,
        port=port,
        argv=[
            str(vr),
            "--worker-urls",
            engine_url,
            "--policy",
            "round_robin",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-port",
            str(metrics_port),
            "--log-level",
            "warning",
        ],
        ready_path="/health",
        needs=(vr,),
        install_hint="python3 -m venv .venv-peers/vllmrouter && "
        ".venv-peers/vllmrouter/bin/pip install vllm-router",
        note="vllm-project/router (Rust), round_robin",
    )


def make_targets(
    engine_url: str, ports: dict[str, int], paths: PeerPaths, workdir: Path
) -> list[TargetSpec]:
    """Every target in report order; `ports` maps a target name to its port."""
    ps_py = paths.pstack_venv / "bin" / "python"
    ll = paths.litellm_venv / "bin" / "litellm"
    ll_cfg = workdir / "litellm.yaml"
    ll_cfg.write_text(_litellm_config(engine_url))
    engine_port = int(engine_url.rsplit(":", 1)[1])
    return [
        TargetSpec(
            name="direct", port=engine_port, argv=None, note="the fake engine itself (the limit)"
        ),
        gpupool_target("gpupool", ports["gpupool"], engine_url, paths, workdir),
        gpupool_target(
            "gpupool-admission-off",
            ports["gpupool-admission-off"],
            engine_url,
            paths,
            workdir,
            admission="off",
        ),
        gpupool_target(
            "gpupool-ledger-batched",
            ports["gpupool-ledger-batched"],
            engine_url,
            paths,
            workdir,
            ledger_durable=False,
        ),
        *(
            gpupool_target(
                name,
                ports[name],
                engine_url,
                paths,
                workdir,
                observability={
                    "otlp_endpoint": f"http://127.0.0.1:{ports['otlp-sink']}",
                    "sample_ratio": ratio,
                },
            )
            for name, ratio in (
                ("gpupool-trace-1", 1.0),
                ("gpupool-trace-0.01", 0.01),
                ("gpupool-trace-0", 0.0),
            )
        ),
        *(
            [
                gpupool_target(
                    "gpupool-baseline",
                    ports["gpupool-baseline"],
                    engine_url,
                    paths,
                    workdir,
                    checkout=paths.baseline,
                )
            ]
            if paths.baseline is not None
            else []
        ),
        vllm_router_target(
            "vllm-router", ports["vllm-router"], ports["vllm-router-metrics"], engine_url, paths
        ),
        TargetSpec(
            name="production-stack",
            port=ports["production-stack"],
            argv=[
                str(ps_py),
                "-m",
                "vllm_router.app",
                "--service-discovery",
                "static",
                "--static-backends",
                engine_url,
                "--static-models",
                MODEL,
                "--routing-logic",
                "roundrobin",
                "--host",
                "127.0.0.1",
                "--port",
                str(ports["production-stack"]),
                "--log-level",
                "warning",
            ],
            ready_path="/v1/models",
            env={"PYTHONPATH": str(paths.pstack_src)},
            cwd=paths.pstack_src,
            needs=(ps_py, paths.pstack_src / "vllm_router" / "app.py"),
            install_hint="a production-stack source snapshot under third_party/production-stack "
            "and a Python 3.12 venv .venv-peers/pstack with its "
            "src/vllm_router/requirements.txt plus uvloop httptools "
            "(see benchmarks/router_overhead/setup_peers.sh)",
            note="vLLM production-stack router (Python, FastAPI + aiohttp), roundrobin",
        ),
        TargetSpec(
            name="litellm",
            port=ports["litellm"],
            argv=[
                str(ll),
                "--config",
                str(ll_cfg),
                "--host",
                "127.0.0.1",
                "--port",
                str(ports["litellm"]),
                "--num_workers",
                "1",
            ],
            ready_path="/health/liveliness",
            env={
                "LITELLM_LOG": "ERROR",
                "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
                "LITELLM_TELEMETRY": "False",
                "PYTHONWARNINGS": "ignore",
                "HOME": os.environ.get("HOME", "/tmp"),
            },
            needs=(ll,),
            start_timeout_s=150.0,
            install_hint="python3 -m venv .venv-peers/litellm && "
            ".venv-peers/litellm/bin/pip install 'litellm[proxy]'",
            note="LiteLLM proxy, hosted_vllm provider, 1 worker, no database, no master key",
        ),
    ]
