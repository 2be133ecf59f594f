"""The container image (Dockerfile): its cpu variant is built with the machine's image builder and
the router started from it, against one of the session's real engines, answers `/ready`.

Skipped, saying exactly why, where that cannot happen: no builder (podman, or docker with a
daemon), or a base image that is neither local nor pullable (a machine without access to
vLLM's registry). Where podman's OCI runtime cannot start containers (a sandbox without the
cgroups or rlimits it sets), the build runs its steps with `--isolation chroot` and the router
runs in a chroot of the image (`buildah run --isolation chroot`).
`GPUPOOL_TEST_VLLM_CPU_IMAGE` names another base for the cpu variant (one already loaded,
e.g. from `podman load`), and `GPUPOOL_TEST_PYTHON_IMAGE` another for the wheel stage.

The engines are requested only once the builder and the bases are known to be there, so a
skip starts nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
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
    build_argv = [
        *tool,
        "build",
        "--network",
        "host",
        "--build-arg=VARIANT=cpu",
        *(f"--build-arg={k}={v}" for k, v in bases.items()),
        "-t",
        TAG,
        str(REPO),
    ]
    build = _run(build_argv, 3600)
    if build.returncode != 0 and _no_oci_runtime(build) and tool[0].endswith("podman"):
        # a sandbox where the OCI runtime cannot start a container (cgroups, rlimits): the
        # RUN steps in a chroot instead, as buildah does without a runtime
        build = _run([*build_argv[:2], "--isolation", "chroot", *build_argv[2:]], 3600)
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
    mounts = [
        f"{tmp_path / 'config.yaml'}:/etc/gpupool/config.yaml:ro",
        f"{REPO / '.gpupool' / 'models' / 'tiny'}:/data/model:ro",
    ]
    env = f"{ENGINE_KEY_ENV}={os.environ[ENGINE_KEY_ENV]}"
    with contextlib.ExitStack() as stack:
        name = f"gpupool-test-{port}"
        started = _run(
            [*tool, "run", "-d", "--name", name, "--network", "host", "-e", env]
            + [a for m in mounts for a in ("-v", m)]
            + [TAG],
            120,
        )
        stack.callback(_run, [*tool, "rm", "-f", name], 120)  # also one that never started
        if started.returncode == 0:
            stack.callback(lambda: print(_run([*tool, "logs", name], 60).stderr[-3000:]))
        elif _no_oci_runtime(started) and (buildah := shutil.which("buildah")) is not None:
            # no OCI runtime here either: the image's command in a chroot of its filesystem
            stack.enter_context(_chroot_run(buildah, TAG, env, mounts, tmp_path / "router.log"))
        else:
            pytest.fail(f"{tool[0]} built the image but cannot run it: {_last_line(started)}")

        def ready() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout_s=120, interval_s=0.5)


def _no_oci_runtime(proc: subprocess.CompletedProcess[str]) -> bool:
    """The container runtime could not start a container (a sandbox without cgroups or
    rlimits for it), as opposed to a failing build step."""
    out = proc.stdout + proc.stderr
    return any(s in out for s in ("OCI permission denied", "cgroups in hybrid mode", "OCI runtime"))


@contextlib.contextmanager
def _chroot_run(buildah: str, image: str, env: str, mounts: list[str], log: Path) -> Iterator[None]:
    """The image's default command (as its user, in its working directory) in a chroot of its
    filesystem (`buildah run --isolation chroot`), until the block ends."""
    storage = ["--storage-driver", "vfs"]  # podman's store here (podman info: graphDriverName)
    made = _run([buildah, *storage, "from", image], 300)
    assert made.returncode == 0, made.stderr
    container = made.stdout.strip().splitlines()[-1]
    argv = [buildah, *storage, "run", "--isolation", "chroot", "--network", "host", "--env", env]
    argv += [a for m in mounts for a in ("--volume", m)]
    argv += [container, "--", "gpupool", "serve", "--config", "/etc/gpupool/config.yaml"]
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print(log.read_text()[-3000:])
        _run([buildah, *storage, "rm", container], 120)
