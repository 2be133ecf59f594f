"""The mypyc build's guard (router/_compiled.py): a build is used only while it matches the
sources it was compiled from; otherwise, and with GPUPOOL_PURE=1, the router runs as Python."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from router import _compiled

MANIFEST = Path("build/compiled/manifest.json")  # where the tests' small trees keep theirs
WHERE = (
    "import router.admission.decision as m, sys; "
    "print(m.__file__); print(any(type(f).__name__ == '_CompiledFinder' for f in sys.meta_path))"
)


def _tree(root: Path) -> None:
    """A small project: router.a imports router.b, which imports router.c; router.d apart."""
    pkg = root / "router"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from router.b import B\n")
    (pkg / "b.py").write_text("from . import c\nB = 1\n")
    (pkg / "c.py").write_text("import json\nC = 2\n")
    (pkg / "d.py").write_text("D = 3\n")


def _manifest(root: Path, modules: list[str]) -> None:
    sources = {
        str(_compiled.source_path(m, root).relative_to(root)): _compiled.digest(
            _compiled.source_path(m, root)
        )
        for m in _compiled.closure(modules, root)
    }
    manifest = root / MANIFEST
    manifest.parent.mkdir(parents=True)
    body = {
        "python": sys.implementation.cache_tag,
        "modules": modules,
        "files": {},
        "sources": sources,
    }
    manifest.write_text(json.dumps(body))


def _why(root: Path, modules: list[str]) -> str | None:
    return _compiled.why_not_compiled(root, modules, root / MANIFEST)


def test_the_closure_holds_every_project_module_a_compiled_one_imports(tmp_path: Path) -> None:
    _tree(tmp_path)
    assert _compiled.closure(["router.a"], tmp_path) == [
        "router",
        "router.a",
        "router.b",
        "router.c",
    ]


def test_a_build_is_current_until_a_source_it_read_changes(tmp_path: Path) -> None:
    _tree(tmp_path)
    _manifest(tmp_path, ["router.a"])
    assert _why(tmp_path, ["router.a"]) is None
    (tmp_path / "router" / "d.py").write_text("D = 4\n")  # not read by the build
    assert _why(tmp_path, ["router.a"]) is None
    (tmp_path / "router" / "c.py").write_text("C = 3\n")  # imported two steps away
    reason = _why(tmp_path, ["router.a"])
    assert reason is not None and "router/c.py" in reason
    (tmp_path / "router" / "c.py").unlink()
    reason = _why(tmp_path, ["router.a"])
    assert reason is not None and "router/c.py" in reason


def test_a_build_for_other_modules_or_another_python_is_not_used(tmp_path: Path) -> None:
    _tree(tmp_path)
    assert _why(tmp_path, ["router.a"]) == "no compiled build"
    _manifest(tmp_path, ["router.a"])
    assert _why(tmp_path, ["router.a", "router.d"]) is not None
    manifest = tmp_path / MANIFEST
    body = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**body, "python": "cpython-39"}))
    reason = _why(tmp_path, ["router.a"])
    assert reason is not None and "cpython-39" in reason


def _where(env: dict[str, str]) -> tuple[str, bool, str]:
    done = subprocess.run(
        [sys.executable, "-c", WHERE],
        cwd=_compiled.ROOT,
        env={**os.environ, "PYTHONPATH": str(_compiled.ROOT), **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    path, finder = done.stdout.split()
    return path, finder == "True", done.stderr


def test_gpupool_pure_runs_the_sources() -> None:
    path, finder, _ = _where({_compiled.PURE_ENV: "1"})
    assert path.endswith("router/admission/decision.py") and not finder


@pytest.mark.skipif(
    _compiled.pure_requested() or _compiled.why_not_compiled() is not None,
    reason="no current mypyc build in this checkout (`make compiled`)",
)
def test_a_current_build_is_loaded_and_a_stale_copy_of_it_is_not(tmp_path: Path) -> None:
    path, finder, _ = _where({_compiled.PURE_ENV: "0"})
    assert finder and Path(path).parent.is_relative_to(_compiled.BUILD_DIR)
    assert path.endswith(".so")
    # the same build with one recorded source hash off: every module comes from its .py
    copy = tmp_path / "compiled"
    shutil.copytree(_compiled.BUILD_DIR, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["sources"]["router/admission/decision.py"] = "0" * 64
    (copy / "manifest.json").write_text(json.dumps(manifest))
    path, finder, stderr = _where({_compiled.PURE_ENV: "0", _compiled.DIR_ENV: str(copy)})
    assert path.endswith("router/admission/decision.py") and not finder
    assert "router/admission/decision.py" in stderr and _compiled.REBUILD_HINT in stderr
    # and the copy as built is used from where it lies
    shutil.copy2(_compiled.MANIFEST, copy / "manifest.json")
    path, finder, _ = _where({_compiled.PURE_ENV: "0", _compiled.DIR_ENV: str(copy)})
    assert finder and Path(path).parent.is_relative_to(copy)


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="only CI insists on the build")
def test_ci_runs_the_compiled_build() -> None:
    """`make test` under CI=true builds first (`make compiled` fails there when the build
    does): the suite must then run compiled, or it tested the Python path unawares."""
    if _compiled.pure_requested():
        pytest.skip(f"{_compiled.PURE_ENV} is set: the pure path is asked for")
    assert _compiled.why_not_compiled() is None
    path, finder, _ = _where({})
    assert finder and path.endswith(".so")
