"""`gpupool serve` with the change this benchmark still proposes applied at run time, so the
report can show its effect side by side with what ships. Not a way to run gpupool: once the
change lands in router/, this target measures the same thing as `gpupool` and can be dropped.

Landed already (08a4232): the listening socket made with `proto=IPPROTO_TCP`, so accepted
connections get TCP_NODELAY (without it each keep-alive response waited ~40 ms for the client's
delayed ACK), and the stack on uvloop.

Proposed: in router/stack.py `run_blocking`, `gc.collect(); gc.freeze()` before starting the
loop. Everything is imported by then; freezing parks those ~65k objects outside the cyclic
collector's generations, so its collections stop re-scanning them (measured: ~8 % less CPU per
non-streaming request).

    python -m benchmarks.router_overhead.proposed_serve serve --config FILE --port P
"""

from __future__ import annotations

import gc
import sys

import router.stack  # noqa: F401 - imported (with the app and its dependencies) before freezing
from router.cli import main as gpupool_main

__all__ = ["main"]


def main() -> int:
    gc.collect()
    gc.freeze()
    return gpupool_main()


if __name__ == "__main__":
    sys.exit(main())
