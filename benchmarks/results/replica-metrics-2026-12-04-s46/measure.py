"""What `x-gpupool-replica` costs per request (issue 25): gpupool's server as the router runs it,
in three forms, rounds interleaved (the order rotated each round), each pinned to CPU 1 with
the load generator (aiohttp, closed loop, c=64) on CPU 0, through
`benchmarks.router_overhead.servers`' own round (CPU µs per request of the server process,
requests/s):

- `before`: the server of the checkout `--before` (no constant headers at all);
- `after-none`: this checkout's server without headers (`Server(..., headers=())`);
- `after-replica`: this checkout's server with the router's header, as router/cli/stack.py
  builds it (`x-gpupool-replica: <host>:<pid>:<6 hex>`);

each with both of that module's apps: `link` (the answer written through the `ClientLink`, as
the generation endpoints answer) and `asgi` (`send`, as every other route answers).

    python benchmarks/results/replica-metrics-2026-12-04-s46/measure.py --before /tmp/wt-before \
        [--rounds 5 --window-s 2.5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
from pathlib import Path

from benchmarks.router_overhead.procs import pin_self
from benchmarks.router_overhead.servers import _GPUPOOL_SERVER, _PORT, _round

_OLD_END = "max_connections=4096))"
_HEADER = f"{socket.gethostname()}:{os.getpid()}:a1b2c3"
_NEW_END = f"max_connections=4096), headers=[(b'x-gpupool-replica', {_HEADER.encode()!r})])"


def _variants(python: str, here: Path, before: Path) -> dict[str, tuple[list[str], Path]]:
    out: dict[str, tuple[list[str], Path]] = {}
    for app, fn in (("link", "link_app"), ("asgi", "app")):
        plain = _GPUPOOL_SERVER.format(port=_PORT, app=fn)
        assert _OLD_END in plain
        out[f"{app}-before"] = ([python, "-c", plain], before)
        out[f"{app}-after-none"] = ([python, "-c", plain], here)
        out[f"{app}-after-replica"] = ([python, "-c", plain.replace(_OLD_END, _NEW_END)], here)
    return out


async def _run(
    variants: dict[str, tuple[list[str], Path]], rounds: int, window_s: float
) -> dict[str, list[tuple[float, float]]]:
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            argv, checkout = variants[name]
            results[name].append(await _round(name, argv, checkout, window_s))
            print(f"round {r + 1} {name}: {results[name][-1][0]:.1f} us", file=sys.stderr)
    return results


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--before", type=Path, required=True, help="the checkout before the header")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--window-s", type=float, default=2.5)
    args = p.parse_args()
    here = Path(__file__).resolve().parents[3]
    python = str(here / ".venv" / "bin" / "python")
    if (os.cpu_count() or 1) >= 2:
        pin_self(frozenset({0}), -10)
    import uvloop

    variants = _variants(python, here, args.before.resolve())
    results = uvloop.run(_run(variants, args.rounds, args.window_s))
    print("| server | CPU µs per request at c=64: median (min-max; rounds) | req/s (median) |")
    print("| --- | --- | --- |")
    for name, rows in results.items():
        cpus = [c for c, _ in rows]
        rates = [q for _, q in rows]
        each = ", ".join(f"{c:.1f}" for c in cpus)
        print(
            f"| {name} | {statistics.median(cpus):.1f} ({min(cpus):.1f}-{max(cpus):.1f};"
            f" {each}) | {statistics.median(rates):,.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
