"""A small flame graph (SVG) of py-spy's raw samples (`frame;frame;... count`, root first), for
the results folder: frames under `min_frac` of the samples are left out, so the file stays a
few tens of kB; hover a box for its function, file and share.

`python -m benchmarks.router_overhead.flame RAW.txt OUT.svg [TITLE]`
"""

from __future__ import annotations

import html
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.router_overhead.profile import parse_raw

__all__ = ["render_svg"]

_WIDTH = 1200.0
_ROW = 16
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<where>[^()]*)\)$")


@dataclass
class _Node:
    samples: int = 0
    children: dict[str, _Node] = field(default_factory=dict)


def _label(frame: str) -> str:
    """`func (path/to/file.py:123)` -> `func (file.py)`: one box per function, not per line."""
    m = _FRAME.match(frame)
    if m is None:
        return frame
    where = m.group("where").rsplit(":", 1)[0]
    return f"{m.group('func')} ({'/'.join(where.split('/')[-2:])})"


def _color(label: str) -> str:
    if "router/" in label or "pools/" in label or "gateway/" in label:
        return "#e8a33d"  # gpupool
    if "uvicorn" in label or "httptools" in label:
        return "#6fa8dc"
    if "aiohttp" in label or "upstream" in label:
        return "#93c47d"
    if "asyncio" in label or "uvloop" in label:
        return "#b4a7d6"
    return "#d9d9d9"


def render_svg(raw: str, title: str, min_frac: float = 0.005) -> str:
    root = _Node()
    for frames, n in parse_raw(raw):
        root.samples += n
        node = root
        for frame in frames:
            node = node.children.setdefault(_label(frame), _Node())
            node.samples += n
    total = max(root.samples, 1)
    boxes: list[str] = []
    depth_max = 0

    def walk(node: _Node, x: float, depth: int) -> None:
        nonlocal depth_max
        for label, child in sorted(node.children.items()):
            frac = child.samples / total
            if frac < min_frac:
                x += frac * _WIDTH
                continue
            w = frac * _WIDTH
            y = 24 + depth * _ROW
            depth_max = max(depth_max, depth)
            name = html.escape(label)
            text = name if w > 7 * len(label) else html.escape(label[: max(0, int(w / 7) - 2)])
            boxes.append(
                f"<g><title>{name}: {child.samples} samples, {frac:.1%}</title>"
                f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{_ROW - 1}" '
                f'fill="{_color(label)}"/>'
                + (f'<text x="{x + 2:.1f}" y="{y + 11}">{text}</text>' if w > 30 else "")
                + "</g>"
            )
            walk(child, x, depth + 1)
            x += w

    walk(root, 0.0, 0)
    height = 24 + (depth_max + 1) * _ROW + 8
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH:.0f}" height="{height}" '
        'font-family="monospace" font-size="10">'
        f'<text x="4" y="14" font-size="12">{html.escape(title)} ({total} samples; boxes under '
        f"{min_frac:.1%} left out; root at the top)</text>" + "".join(boxes) + "</svg>\n"
    )


def main(argv: list[str]) -> int:
    raw, out = Path(argv[0]), Path(argv[1])
    title = argv[2] if len(argv) > 2 else raw.name
    out.write_text(render_svg(raw.read_text(), title))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
