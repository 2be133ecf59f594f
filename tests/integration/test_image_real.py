"""The container image (Dockerfile): its cpu variant is built with the machine's image builder and
the router started from it, against one of the session's real engines, answers `/ready`.

Skipped, saying exactly why, where that cannot happen: no builder (podman, buildah, or docker
with a daemon), a builder that cannot build here, or a base image that is neither local nor
pullable (a machine without access to vLLM's registry). `GPUPOOL_TEST_VLLM_CPU_IMAGE` names
another base for the cpu variant (one already loaded, e.g. from `podman load`), and
`GPUPOOL_TEST_PYTHON_IMAGE` another for the wheel stage.

The engines are requested only once the builder and the bases are known to be there, so a
skip starts nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from pools.launchers import InstanceSpec
from pools.testing.router_process import free_port
from tests.integration.conftest import ENGINE_KEY_ENV, MAX_MODEL_LEN, REPO, wait_for

pytestmark = pytest.mark.integration

TAG = "localhost/gpupool-test:cpu"


def _dockerfile_default(arg: str) -> str:
    match = re.search(rf"^ARG {arg}=(\S+)$", (REPO / "Dockerfile").read_text(), re.MULTILINE)
    assert match is not None, f"Dockerfile declares no ARG {arg}"
    return match.group(1)


def _run(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)


def _last_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit {proc.returncode}"


def _builder() -> tuple[list[str], str | None]:
    """(the build/run command's prefix, None) or ([], why there is none)."""
    for name in ("podman", "docker"):
        exe = shutil.which(name)
        if exe is None:
            continue
        info = _run([exe, "info"], 60)
        if info.returncode == 0:
            return [exe], None
        why = f"{name} is installed but `{name} info` fails: {_last_line(info)}"
        if name == "docker":
            return [], why
    if shutil.which("buildah"):
        return [], "only buildah is installed: it builds, but cannot run the image to test it"
    return [], "no image builder: none of podman, docker (with a daemon) or buildah is installed"


def _available(tool: list[str], image: str) -> str | None:
    """None when `image` is local or could be pulled; else why not."""
    if _run([*tool, "image", "inspect", image], 60).returncode == 0:
        return None
    pulled = _run([*tool, "pull", image], 1800)
    if pulled.returncode == 0:
        return None
    return f"base image {image} is not local and cannot be pulled: {_last_line(pulled)}"


def test_the_cpu_image_builds_and_its_router_answers_ready(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    tool, why = _builder()
    if why is not None:
        pytest.skip(why)
    bases = {
        "PYTHON_IMAGE": os.environ.get("GPUPOOL_TEST_PYTHON_IMAGE")
        or _dockerfile_default("PYTHON_IMAGE"),
        "VLLM_CPU_IMAGE": os.environ.get("GPUPOOL_TEST_VLLM_CPU_IMAGE")
        or _dockerfile_default("VLLM_CPU_IMAGE"),
    }
    for image in bases.values():
        if (missing := _available(tool, image)) is not None:
            pytest.skip(f"{tool[0]} works here, but the {missing}")
    build = _run(
        [
            *tool,
            "build",
            "--network",
            "host",
            "--build-arg=VARIANT=cpu",
            *(f"--build-arg={k}={v}" for k, v in bases.items()),
            "-t",
            TAG,
            str(REPO),
        ],
        3600,
    )
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]

    engines: list[InstanceSpec] = request.getfixturevalue("real_engines")
    port = free_port()
    config = {
        "model": {"name": "tiny", "path": "/data/model", "max_model_len_tokens": MAX_MODEL_LEN},
        "engines": {
            "launcher": "static",
            "static": {"urls": [engines[0].url], "api_key_env": ENGINE_KEY_ENV},
        },
        "pools": {"normal": {"classes": ["normal", "agent"], "share": {"initial_frac": 1.0}}},
        "router": {"host": "127.0.0.1", "port": port},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    name = f"gpupool-test-{port}"
    started = _run(
        [
            *tool,
            "run",
            "-d",
            "--name",
            name,
            "--network",
            "host",
            "-e",
            f"{ENGINE_KEY_ENV}={os.environ[ENGINE_KEY_ENV]}",
            "-v",
            f"{tmp_path / 'config.yaml'}:/etc/gpupool/config.yaml:ro",
            "-v",
            f"{REPO / '.gpupool' / 'models' / 'tiny'}:/data/model:ro",
            TAG,
        ],
        120,
    )
    assert started.returncode == 0, started.stderr
    try:

        def ready() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout_s=120, interval_s=0.5)
    finally:
        logs = _run([*tool, "logs", name], 60)
        _run([*tool, "rm", "-f", name], 120)
        print(logs.stdout[-3000:], logs.stderr[-3000:])
