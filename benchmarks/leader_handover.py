"""Benchmark: how long after a `kill -9` of the leading router process another takes the
rebalancer's leadership (router/store/leader.py: an advisory lock, checked every second).

    .venv/bin/python -m benchmarks.leader_handover --postgres-url URL --password-env VAR
        [--trials 5]

Each trial: a child process campaigns until it leads; a candidate here campaigns beside it
(and does not lead); the child is killed with SIGKILL; the seconds until the candidate leads
are printed. The bound is one check interval (1 s) plus the server noticing the closed socket.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time

from router.store import PostgresStore
from router.store.leader import AdvisoryLockLeader

_HOLDER = """
import asyncio, os, sys
from router.store import PostgresStore
from router.store.leader import AdvisoryLockLeader

async def main() -> None:
    store = PostgresStore(sys.argv[1], password=os.environ[sys.argv[2]])
    leader = AdvisoryLockLeader(store.dedicated, replica="killed")
    await leader.start()
    while not leader.leading:
        await asyncio.sleep(0.01)
    print("LEADING", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def _trial(url: str, password_env: str) -> float:
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HOLDER, url, password_env, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert holder.stdout is not None
        if (await holder.stdout.readline()).strip() != b"LEADING":
            raise RuntimeError("the first candidate did not lead")
        store = PostgresStore(url, password=os.environ[password_env])
        candidate = AdvisoryLockLeader(store.dedicated, replica="candidate")
        leads = asyncio.Event()
        candidate.on_change = lambda leading: leads.set() if leading else None
        await candidate.start()
        try:
            await asyncio.sleep(1.5)  # it has campaigned, and lost
            if candidate.leading:
                raise RuntimeError("two leaders")
            killed_at = time.monotonic()
            holder.send_signal(signal.SIGKILL)
            await holder.wait()
            await leads.wait()
            return time.monotonic() - killed_at
        finally:
            await candidate.aclose()
    finally:
        if holder.returncode is None:
            holder.kill()
            await holder.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--postgres-url", required=True)
    parser.add_argument("--password-env", required=True, help="the env var holding the password")
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args(argv)
    for trial in range(args.trials):
        took_s = asyncio.run(_trial(args.postgres_url, args.password_env))
        print(
            f"trial {trial}: the other leads {took_s:.3f} s after kill -9 of the leader"
            f" (load {os.getloadavg()[0]:.1f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
