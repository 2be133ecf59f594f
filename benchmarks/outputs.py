"""Where a benchmark writes what it measures.

A benchmark is given one folder (`--out`). The small files it writes there: the config it ran
with, `report.md`, a summary JSON. The bulky ones (raw `records-*.jsonl`, samples, plots,
router and engine logs, metric dumps) go to `bulk_dir(out)`: for a folder under
`benchmarks/results/` that is the same path under `benchmarks/out/`, which git ignores, so the
committed results stay small and the command a report names regenerates the rest. For any
other folder (a test's temporary one, `/tmp/x`) it is the folder itself.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["BULK", "RESULTS", "bulk_dir", "bulk_path", "display_path"]

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
BULK = REPO / "benchmarks" / "out"


def bulk_dir(out: Path) -> Path:
    """The folder for `out`'s bulky files: `benchmarks/out/<rel>` when `out` is
    `benchmarks/results/<rel>`, `out` itself otherwise. Not created here."""
    try:
        rel = out.resolve().relative_to(RESULTS)
    except ValueError:
        return out
    return BULK / rel


def bulk_path(out: Path, name: str) -> Path:
    """`bulk_dir(out) / name`, its folder created."""
    folder = bulk_dir(out)
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def display_path(path: Path) -> str:
    """`path` relative to the repository when it is inside it (for reports), else absolute."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)
