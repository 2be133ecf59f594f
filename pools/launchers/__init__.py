"""Engine launchers: `local` (child processes here), `static` (URLs of engines run elsewhere),
and the seam for `ray`. `make_launcher(config)` picks one from `engines.launcher`."""

from __future__ import annotations

from pools.config import Config
from pools.launchers.base import InstanceSpec, Launcher, LauncherError, ProgressFn
from pools.launchers.local import LocalLauncher
from pools.launchers.static import StaticLauncher

__all__ = [
    "InstanceSpec",
    "Launcher",
    "LauncherError",
    "LocalLauncher",
    "StaticLauncher",
    "make_launcher",
]


def make_launcher(config: Config, progress: ProgressFn | None = None) -> Launcher:
    kind = config.engines.launcher
    if kind == "local":
        return LocalLauncher(config.engines.local, config.model, progress=progress)
    if kind == "static":
        return StaticLauncher(config.engines.static, progress=progress)
    raise LauncherError(
        f"engines.launcher {kind!r} is not available in this version of gpupool; use 'local' or"
        " 'static' (for Ray, start engines with Ray and list their URLs under engines.static)"
    )
