"""The hot modules compiled with mypyc, loaded only while their build matches the sources.

`scripts/build_compiled.py` (`make compiled`, run by `make install`) compiles the modules
in `MODULES` into `build/compiled/`, outside the source tree, and writes a manifest there: each
extension's file, and the SHA-256 of every project source the build read (the compiled modules
and every project module they import, directly or not: mypyc builds against their types). An
extension module would shadow its `.py`, so they never sit beside the sources; instead
`install()`, called by `router/__init__.py`, puts a finder in front of `sys.meta_path` that
serves the compiled modules only when every recorded hash matches the current file. Else, or
with `GPUPOOL_PURE=1`, every module is imported from its `.py` (one warning names
`make compiled`): a stale build never runs old code, and an edit runs as Python until
the next build. The modules are compiled as one group calling each other natively, so they
load all together or not at all.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

# what mypyc compiles: the request path's pure work (admission, estimation, governance,
# classification, settlement, accounting), the HTTP server it runs in (the server's protocol,
# its exchanges and `ClientLink`) and what a request calls beside them (the ledger's commit on
# the loop, the metrics, tenants, the rebalancer's signals, the fleet's leases), each listed
# module checked by mypy --strict. Not router.gateway.app: FastAPI reads its endpoints'
# signatures, which a compiled function does not carry (s50: every FastAPI route failed).
MODULES = (
    "router.admission.admitter",
    "router.admission.decision",
    "router.admission.engine_kv",
    "router.admission.estimate",
    "router.admission.picking",
    "router.admission.queueing",
    "router.governance.governor",
    "router.governance.bucket",
    "router.governance.limits",
    "router.request",
    "router.settlement",
    "router.gateway.classify",
    "router.gateway.proxy",
    "router.gateway.server",
    "router.gateway.http_protocol",
    "router.gateway.upstream",
    "router.accounting.accountant",
    "router.accounting.observer",
    "router.accounting.ledger_loop",
    "router.gateway.wait_comments",
    "router.gateway.protocols.openai_chat",
    "router.metrics",
    "router.identity",
    "router.rebalancer.rebalancer",
    "pools.fleet",
    "pools.operating_point",
)
GROUP = "gpupool"  # mypyc's shared library: `gpupool__mypyc`
ROOT = Path(__file__).resolve().parent.parent  # the checkout
PURE_ENV = "GPUPOOL_PURE"
DIR_ENV = "GPUPOOL_COMPILED_DIR"  # where the build lies, if not build/compiled/ of the checkout
BUILD_DIR = Path(os.environ.get(DIR_ENV) or ROOT / "build" / "compiled")
MANIFEST = BUILD_DIR / "manifest.json"
PROJECT_PACKAGES = ("router", "pools", "kvcache_model", "gpu_probe")
REBUILD_HINT = "make compiled"


def pure_requested() -> bool:
    """`GPUPOOL_PURE=1` (or any value but empty and 0): run every module from its `.py`."""
    return os.environ.get(PURE_ENV, "") not in ("", "0")


def source_path(module: str, root: Path = ROOT) -> Path:
    """The `.py` of a project module (its package's `__init__.py` for a package)."""
    base = root.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _imported(module: str, tree: ast.Module, root: Path) -> set[str]:
    """The project modules `tree` (module `module`'s source) names in its imports."""
    found: set[str] = set()
    package = (
        module if source_path(module, root).name == "__init__.py" else module.rpartition(".")[0]
    )
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in PROJECT_PACKAGES}


def closure(modules: Sequence[str], root: Path = ROOT) -> list[str]:
    """`modules` and every project module they import, directly or not, with their packages."""
    seen: set[str] = set()
    todo = list(modules)
    while todo:
        name = todo.pop()
        path = source_path(name, root)
        if name in seen or not path.is_file():
            continue
        seen.add(name)
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # the parent packages
        tree = ast.parse(path.read_bytes(), filename=str(path))
        todo.extend(_imported(name, tree, root))
    return sorted(seen)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stale_sources(manifest: dict[str, object], root: Path = ROOT) -> list[str]:
    """The recorded sources changed or gone since the build (none: the build is current)."""
    sources = manifest.get("sources")
    if not isinstance(sources, dict):
        return ["<manifest without sources>"]
    changed = []
    for rel, recorded in sources.items():
        path = root / rel
        if not path.is_file() or digest(path) != recorded:
            changed.append(rel)
    return changed


def why_not_compiled(
    root: Path = ROOT, modules: Sequence[str] = MODULES, manifest_path: Path = MANIFEST
) -> str | None:
    """None when the build `manifest_path` describes may run for the sources under `root`,
    else why not (for the warning)."""
    if not manifest_path.is_file():
        return "no compiled build"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        return f"unreadable {manifest_path}: {exc}"
    if manifest.get("python") != sys.implementation.cache_tag:
        return f"built for {manifest.get('python')}, running {sys.implementation.cache_tag}"
    if sorted(manifest.get("modules", [])) != sorted(modules):
        return "built for another module list"
    changed = stale_sources(manifest, root)
    if changed:
        shown = ", ".join(changed[:3]) + (
            f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        )
        return f"sources changed since the build: {shown}"
    return None


class _CompiledFinder(importlib.abc.MetaPathFinder):
    """Serves `MODULES` and their shared library from `build/compiled/`."""

    def __init__(self, files: dict[str, str]) -> None:
        self._files = files

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        rel = self._files.get(fullname)
        if rel is None:
            return None
        origin = str(BUILD_DIR / rel)
        loader = importlib.machinery.ExtensionFileLoader(fullname, origin)
        return importlib.util.spec_from_file_location(fullname, origin, loader=loader)


def install() -> bool:
    """Put the compiled build in front of the sources when it is current; True when it is."""
    if pure_requested() or any(isinstance(f, _CompiledFinder) for f in sys.meta_path):
        return False
    reason = why_not_compiled()
    if reason is not None:
        if MANIFEST.parent.exists():  # a checkout that never built stays quiet
            warnings.warn(
                f"gpupool runs its hot modules as Python ({reason}); "
                f"`{REBUILD_HINT}` compiles them again",
                RuntimeWarning,
                stacklevel=2,
            )
        return False
    files = json.loads(MANIFEST.read_text())["files"]
    sys.meta_path.insert(0, _CompiledFinder(files))
    return True
