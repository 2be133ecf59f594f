"""Who may import whom, as the packages' docstrings say it (README, "Where things live"): each
rule walks the source with `ast` and lists the imports that break it.

The product is `pools`, `router`, `gpu_probe`, `kvcache_model`; `benchmarks` imports it, never
the reverse (tests/unit/test_product_imports.py). Inside the router, `cli` runs `gateway`, the
gateway builds and wires every feature, the features share the modules directly in `router/`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("pools", "router", "gpu_probe", "kvcache_model")
FEATURES = (
    "router.admission",
    "router.accounting",
    "router.governance",
    "router.rebalancer",
    "router.ops",
    "router.prefix",
)
SHARED = (
    "router.errors",
    "router.frozen",
    "router.identity",
    "router.query_params",
    "router.request",
    "router.metrics",
    "router.runtable",
    "router.settlement",
)
# pure cores: no event loop, no network, no files, no clock of their own
PURE = (
    "router.admission.decision",
    "router.accounting.accountant",
    "router.governance.bucket",
    "router.governance.guards",
    "router.governance.headers",
    "router.governance.limits",
    "router.governance.loops",
    "router.governance.runtable",
    "router.runtable",
    "router.prefix.hashing",
    "router.prefix.index",
    "router.prefix.score",
    "router.prefix.wire",
    "pools.rebalance",
)
IO = (
    "aiohttp",
    "asyncio",
    "fastapi",
    "httpx",
    "os",
    "socket",
    "sqlite3",
    "starlette",
    "subprocess",
    "threading",
    "time",
    "uvicorn",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(path): path for package in PRODUCT for path in (ROOT / package).rglob("*.py")
    }


MODULES = _modules()


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers of the imports under `if TYPE_CHECKING:`."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                for sub in ast.walk(inner):
                    if isinstance(sub, ast.Import | ast.ImportFrom):
                        lines.add(sub.lineno)
    return lines


def _imports(module: str, *, runtime_only: bool = False) -> Iterator[str]:
    """Every module `module` imports, relative imports resolved; with `runtime_only`, not those
    under `if TYPE_CHECKING:`."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_only(tree) if runtime_only else set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                yield ".".join([*base, node.module] if node.module else base)
            elif node.module:
                yield node.module


def _offenders(
    importers: tuple[str, ...],
    forbidden: tuple[str, ...],
    *,
    unless: tuple[str, ...] = (),
    runtime_only: bool = False,
) -> list[str]:
    return sorted(
        f"{module} imports {name}"
        for module in MODULES
        if _within(module, importers) and not _within(module, unless)
        for name in _imports(module, runtime_only=runtime_only)
        if _within(name, forbidden)
    )


def test_the_walk_sees_the_imports_it_judges() -> None:
    """Not vacuous: the gateway's imports are seen, and a rule they break is caught."""
    assert {"router.ops", "router.core", "router.accounting.accountant"} <= set(
        _imports("router.gateway.app")
    )
    assert _offenders(("router.gateway",), ("router.ops",)) != []


@pytest.mark.parametrize(
    ("importers", "forbidden", "unless"),
    [
        # the pure models stand on nothing of ours
        (("kvcache_model",), ("pools", "router", "gpu_probe", "benchmarks"), ()),
        (("gpu_probe",), ("pools", "router", "benchmarks"), ()),
        # the router stands on pools, never the reverse (the test rig builds a gateway)
        (("pools",), ("router", "benchmarks"), ("pools.testing",)),
        (("router",), ("benchmarks",), ()),
        # only the command line runs the gateway; nothing runs the command line
        (PRODUCT, ("router.gateway",), ("router.gateway", "router.cli", "pools.testing")),
        (PRODUCT, ("router.cli",), ("router.cli",)),
        # features and shared modules: no composition (core, simulate) and no request path
        (FEATURES + SHARED, ("router.core", "router.simulate"), ()),
        # the decision components wired once: no I/O-owning feature
        (("router.core",), ("router.accounting", "router.governance", "router.ops"), ()),
        # the simulator runs the dispatch core, not the operators' views
        (("router.simulate",), ("router.ops",), ()),
    ],
)
def test_layering(
    importers: tuple[str, ...], forbidden: tuple[str, ...], unless: tuple[str, ...]
) -> None:
    assert _offenders(importers, forbidden, unless=unless) == []


def test_the_shared_modules_import_no_feature_at_run_time() -> None:
    """errors, frozen, identity, query_params, request, metrics, runtable stand on
    `router.errors` and `router.frozen` (a dataclass helper importing nothing of the router)
    alone; request names the accountant's and the estimator's types for the type checker
    only. (settlement is the one owner of a request's end: it calls the features.)"""
    leaves = tuple(m for m in SHARED if m != "router.settlement")
    offenders = sorted(
        f"{module} imports {name}"
        for module in leaves
        for name in _imports(module, runtime_only=True)
        if _within(name, ("router",)) and name not in ("router.errors", "router.frozen")
    )
    assert offenders == []


def test_pure_cores_do_no_io() -> None:
    assert _offenders(PURE, IO) == []


def test_router_has_at_most_twelve_modules_directly_in_it() -> None:
    direct = sorted(p.name for p in (ROOT / "router").glob("*.py"))
    assert len(direct) <= 12, direct
