"""Compile the router's hot modules with mypyc into build/compiled/ (`make compiled`).

    python scripts/build_compiled.py [--force] [--jobs N]

Compiles `router._compiled.MODULES` as one mypyc group, writes the extensions under
`build/compiled/` (never beside the sources, where they would shadow an edited `.py`) and a
manifest with the SHA-256 of every project source the build read; `router._compiled` loads
them only while those hashes match. Does nothing when the build is current, or when
`GPUPOOL_PURE=1` (then the router runs as Python).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _load_hook() -> ModuleType:
    """router/_compiled.py by its path: importing `router` would already apply the build."""
    spec = importlib.util.spec_from_file_location(
        "_gpupool_compiled", ROOT / "router" / "_compiled.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_compiled = _load_hook()
CACHE_DIR = ROOT / "build" / "mypyc-cache"  # mypy's cache for the build, apart from .mypy_cache
WORK_DIR = ROOT / "build" / "mypyc-work"  # the generated C and objects, kept between builds


def build(jobs: int, opt_level: int) -> None:
    from mypyc.build import mypycify  # mypyc ships with mypy (the test extra)
    from setuptools import Distribution  # type: ignore[import-untyped]

    paths = [str(_compiled.source_path(m).relative_to(ROOT)) for m in _compiled.MODULES]
    closure = _compiled.closure(_compiled.MODULES)
    sources = {
        str(_compiled.source_path(m).relative_to(ROOT)): _compiled.digest(_compiled.source_path(m))
        for m in closure
    }
    out = _compiled.BUILD_DIR
    # the generated C and its objects are kept (one tree per gcc level): a rebuild whose C
    # mypyc left byte-identical skips gcc (build_ext sees the extension current); any changed C
    # recompiles the whole group (one extension), ~75 s on 2 cores
    work = WORK_DIR / f"O{opt_level}"
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)  # mypyc reads pyproject.toml's [tool.mypy] from here
    started = time.monotonic()
    # one group (the modules call each other natively), given as `separate` so mypyc runs mypy
    # incrementally on its own cache (build/mypyc-cache): a rebuild after an edit re-checks
    # what changed, where a cold build type-checks the whole closure and its libraries
    extensions = mypycify(
        [*paths, "--cache-dir", str(CACHE_DIR)],
        group_name=_compiled.GROUP,
        target_dir=str(work / "c"),
        multi_file=True,
        separate=[(paths, _compiled.GROUP)],
        opt_level=str(opt_level),
    )
    print(f"build_compiled: mypy + C generation {time.monotonic() - started:.0f} s")
    started = time.monotonic()
    dist = Distribution({"name": "gpupool-compiled", "ext_modules": extensions})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib = str(work / "lib")
    cmd.build_temp = str(work / "obj")
    cmd.parallel = jobs
    dist.run_command("build_ext")
    took = time.monotonic() - started
    print(f"build_compiled: C compile ({jobs} jobs, -O{opt_level}) {took:.0f} s")
    files = {ext.name: cmd.get_ext_filename(ext.name) for ext in extensions}
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for rel in files.values():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(work / "lib" / rel, out / rel)
    manifest = {
        "python": sys.implementation.cache_tag,
        "modules": list(_compiled.MODULES),
        "files": files,
        "sources": sources,
    }
    _compiled.MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even when current")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="C compiles at once")
    parser.add_argument("--opt-level", type=int, default=3, choices=range(4), help="gcc -O level")
    args = parser.parse_args()
    if _compiled.pure_requested():
        print(f"build_compiled: {_compiled.PURE_ENV} is set: the router runs as Python")
        return 0
    reason = _compiled.why_not_compiled()
    if reason is None and not args.force:
        print(f"build_compiled: {_compiled.BUILD_DIR.relative_to(ROOT)} is current")
        return 0
    print(f"build_compiled: compiling {len(_compiled.MODULES)} modules ({reason or 'forced'})")
    started = time.monotonic()
    build(args.jobs, args.opt_level)
    took = time.monotonic() - started
    print(f"build_compiled: done in {took:.0f} s into {_compiled.BUILD_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    code = main()
    # mypy's whole in-memory build is freed at interpreter exit, ~100 s after a cold build
    # (the garbage collector over it, measured with py-spy): end without it, as mypy's CLI does
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
