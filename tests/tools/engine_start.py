"""Time CPU vLLM engine starts of the dev model as the integration fleet starts them: gpupool's
`LocalLauncher` (`benchmarks.engines.cpu_engines`), 64 MiB KV cache, `max_model_len` 4096,
`--max-num-seqs 32`, a key, KV events on (the default; the fleet also exports spans, this does
not). Prints the seconds from spawn to every engine's `/health` 200 (the launcher's own poll,
every 1 s), then stops them. Run it under the lock, e.g. with py-spy over the whole tree:

    flock /tmp/gpupool-engines.lock .venv-peers/pyspy/bin/py-spy record --subprocesses \
        --rate 50 --format raw -o start.raw -- .venv/bin/python tests/tools/engine_start.py

The engine logs (with vLLM's timestamps) stay in `--run-dir` (tests/README.md, "Engine starts
(s45)", reads one)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.engines import cpu_engines  # noqa: E402
from pools.devmodel import is_dev_model, make_dev_model  # noqa: E402
from tests.e2e.stack import seed_vllm_flags  # noqa: E402

MODEL_DIR = REPO / ".gpupool" / "models" / "tiny"
KEY_ENV = "GPUPOOL_ENGINE_START_KEY"


async def start_and_stop(count: int, port: int, run_dir: Path) -> float:
    """Seconds until all `count` engines answered /health; they are stopped before it returns."""
    os.environ.setdefault(KEY_ENV, "engine-start-" + os.urandom(6).hex())
    t0 = time.monotonic()
    launcher = cpu_engines(
        MODEL_DIR,
        count=count,
        port=port,
        key_env=KEY_ENV,
        run_dir=run_dir,
        max_num_seqs=32,
        progress=lambda m: print(f"[{time.monotonic() - t0:6.2f} s] {m}", flush=True),
    )
    try:
        await launcher.start()
        return time.monotonic() - t0
    finally:
        await launcher.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1, help="engines started at once")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--port", type=int, default=8660, help="the first engine's port")
    parser.add_argument("--run-dir", type=Path, default=None, help="default: a temporary one")
    args = parser.parse_args()
    if args.count < 1 or args.rounds < 1:
        parser.error("--count and --rounds must be at least 1")
    if not is_dev_model(MODEL_DIR):
        make_dev_model(MODEL_DIR, "tiny")
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="engine-start-"))
    seed_vllm_flags(run_dir)  # as the tests do: no `vllm --help` inside the timed start
    for r in range(args.rounds):
        seconds = asyncio.run(start_and_stop(args.count, args.port, run_dir))
        load = os.getloadavg()[0]
        print(f"round {r}: {args.count} engine(s) healthy after {seconds:.2f} s (load {load:.2f})")
    print(f"engine logs: {run_dir}")


if __name__ == "__main__":
    main()
