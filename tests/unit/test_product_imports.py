"""The product never imports the benchmark harness: `benchmarks/` imports the product (the
workload model and the simulator live in `router.simulate`), never the reverse."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("pools", "router", "gpu_probe", "kvcache_model")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_product_module_imports_benchmarks() -> None:
    offenders = sorted(
        f"{path.relative_to(ROOT)}: {name}"
        for package in PRODUCT
        for path in (ROOT / package).rglob("*.py")
        for name in _imports(path)
        if name == "benchmarks" or name.startswith("benchmarks.")
    )
    assert offenders == []
