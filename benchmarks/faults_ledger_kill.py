"""Router `kill -9` during streaming requests: does the ledger hold a record for every response
whose final bytes (`data: [DONE]`) reached its client? (issue 23, "the ledger loses nothing")

    python -m benchmarks.faults_ledger_kill --out benchmarks/results/ledger-durable-2026-12-01 \\
        [--rounds 3] [--requests 200] [--concurrency 50] [--max-tokens 32]

Each round, for each ledger mode (`durable`: `router.ledger_durable: true`, the default;
`batched`: `false`, the behaviour before, for comparison), starts a real `gpupool serve` in front
of two fake engines (`pools.testing.fake_engine` processes streaming one token per `--itl-ms`),
sends `--requests` streaming chat completions, `--concurrency` at a time, and sends the router
SIGKILL once half of them have received `[DONE]`. It then opens the ledger file (recovering
the WAL, checking its integrity) and compares it with what the clients received:

- `lost`: responses whose `[DONE]` reached the client and that have no record (the target: 0);
- `recorded_not_done`: records of requests whose client never got `[DONE]` (committed, then
  killed before the final bytes left; not a loss, the engine did the work).

Writes DIR/ledger_kill.json and prints a summary; no engines of vLLM are started (CPU only, ~10 s
a round).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.reliability.faults import (
    Reply,
    RouterProcess,
    client_session,
    ledger_rows,
    send,
)
from pools.testing.router_process import free_port

__all__ = ["KillRound", "main", "router_config", "stream_then_kill"]

MODES = {"durable": True, "batched": False}


@dataclass(frozen=True)
class KillRound:
    """What one round saw: the clients' replies and the ledger rows after the kill."""

    mode: str
    replies: list[Reply]
    rows: dict[str, dict[str, Any]]
    kill_after_s: float  # from the first request sent to SIGKILL

    @property
    def done(self) -> list[Reply]:
        """Responses whose final bytes reached the client."""
        return [r for r in self.replies if r.done]

    @property
    def lost(self) -> list[Reply]:
        return [r for r in self.done if r.request_id not in self.rows]

    def summary(self) -> dict[str, Any]:
        done_ids = {r.request_id for r in self.done}
        return {
            "mode": self.mode,
            "requests_sent": len(self.replies),
            "done_before_kill": len(self.done),
            "recorded_of_done": len(self.done) - len(self.lost),
            "lost": len(self.lost),
            "ledger_rows": len(self.rows),
            "recorded_not_done": sum(1 for rid in self.rows if rid not in done_ids),
            "kill_after_s": round(self.kill_after_s, 3),
        }


def router_config(
    folder: Path,
    engine_urls: list[str],
    *,
    durable: bool,
    model_path: Path,
    router: dict[str, Any] | None = None,
) -> Path:
    """`gpupool serve` over static engines, one pool for everything, its files in `folder`;
    `router` adds to (or overrides) the router section."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "model": {"name": "tiny", "path": str(model_path)},
        "engines": {"launcher": "static", "static": {"urls": engine_urls}},
        "pools": {"normal": {"classes": ["normal", "agent"], "share": {"initial_frac": 1.0}}},
        "router": {
            "ledger_path": str(folder / "ledger.sqlite"),
            "state_path": str(folder / "state.json"),
            "ledger_durable": durable,
            "scrape_interval_s": 0.2,
            **(router or {}),
        },
    }
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return path


async def stream_then_kill(
    router: RouterProcess,
    *,
    requests: int,
    concurrency: int,
    max_tokens: int,
    kill_after_done: int,
) -> tuple[list[Reply], float]:
    """Send `requests` streaming requests, `concurrency` at a time; SIGKILL the router as soon
    as `kill_after_done` clients have their `[DONE]` (at once when every request has ended, if
    fewer). Returns the replies of the requests sent and the seconds from start to the kill."""
    replies: list[Reply] = []
    killed = asyncio.Event()
    enough = asyncio.Event()  # `kill_after_done` clients have their [DONE], or all ended
    slots = asyncio.Semaphore(concurrency)
    started = time.monotonic()

    async def one(session: Any, i: int) -> None:
        async with slots:
            if killed.is_set():
                return
            reply = Reply(f"kill-{i}", max_tokens, True, time.monotonic())
            replies.append(reply)
            await send(session, router.url, reply.tag, max_tokens=max_tokens, reply=reply)
            if reply.done and sum(r.done for r in replies) >= kill_after_done:
                enough.set()

    async def every_one(session: Any) -> None:
        await asyncio.gather(*(one(session, i) for i in range(requests)))
        enough.set()  # fewer than `kill_after_done` got theirs: kill now

    async with client_session() as session:
        everything = asyncio.ensure_future(every_one(session))
        await enough.wait()
        router.signal(signal.SIGKILL)
        kill_after_s = time.monotonic() - started
        killed.set()
        await asyncio.wait_for(everything, 60)
    return replies, kill_after_s


class FakeEngines:
    """`pools.testing.fake_engine` processes on free ports."""

    def __init__(self, count: int, *, itl_ms: float, log: Path) -> None:
        self.urls: list[str] = []
        self._out = log.open("ab")
        self._procs: list[subprocess.Popen[bytes]] = []
        for _ in range(count):
            port = free_port()
            argv = [sys.executable, "-m", "pools.testing.fake_engine", "--port", str(port)]
            argv += ["--ttft-ms", "5", "--itl-ms", str(itl_ms)]
            self._procs.append(subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT))
            self.urls.append(f"http://127.0.0.1:{port}")

    def stop(self) -> None:
        for proc in self._procs:
            proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self._out.close()


async def one_round(
    work: Path, engines: FakeEngines, mode: str, args: argparse.Namespace
) -> KillRound:
    folder = work / mode
    config = router_config(
        folder, engines.urls, durable=MODES[mode], model_path=args.model.resolve()
    )
    router = RouterProcess("serve", config, folder / "router.log")
    try:
        await router.wait_ready()
        replies, kill_after_s = await stream_then_kill(
            router,
            requests=args.requests,
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
            kill_after_done=args.requests // 2,
        )
        if await router.wait_exit(10) is None:
            raise RuntimeError("the router outlived SIGKILL")
    finally:
        await router.stop()
    return KillRound(mode, replies, ledger_rows(folder / "ledger.sqlite"), kill_after_s)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gpupool-ledger-kill-") as tmp:
        work = Path(tmp)
        engines = FakeEngines(2, itl_ms=args.itl_ms, log=work / "engines.log")
        try:
            for i in range(args.rounds):
                for mode in args.modes:
                    result = await one_round(work / f"round-{i}", engines, mode, args)
                    summary = {"round": i, **result.summary()}
                    print(json.dumps(summary), flush=True)
                    rounds.append(summary)
        finally:
            engines.stop()
    return {
        "command": "python -m benchmarks.faults_ledger_kill " + " ".join(sys.argv[1:]),
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "itl_ms": args.itl_ms,
        "rounds": rounds,
        "lost_total": {m: sum(r["lost"] for r in rounds if r["mode"] == m) for m in args.modes},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.faults_ledger_kill")
    p.add_argument("--out", type=Path, required=True, help="folder for ledger_kill.json")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--itl-ms", type=float, default=2.0, help="fake engines' inter-token time")
    p.add_argument("--modes", nargs="+", choices=sorted(MODES), default=list(MODES))
    p.add_argument("--model", type=Path, default=Path(".gpupool/models/tiny"))
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ledger_kill.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["lost_total"]))
    return 1 if result["lost_total"].get("durable", 0) else 0


if __name__ == "__main__":
    sys.exit(main())
