"""Benchmark: the latency the PostgreSQL store adds to a request through the whole router, at
concurrency 1, against the embedded SQLite store, side by side in one run (issue 25: added
p50 within 0.3 ms).

    .venv/bin/python -m benchmarks.store_router_latency [--requests 400] [--rounds 5]
        [--kinds plain,governed,agent,governed-agent,session,governed-session,responses]
        [--baseline-tree DIR] [--queue-order run_las] [--out FILE]

It starts a real PostgreSQL (tests/postgres.py's server: unix socket, fsync off), one fake
engine process (`pools.testing.fake_engine`, no delays) and two `gpupool serve` processes
over that engine: one on the embedded store (a ledger file in a temporary folder), one on
the PostgreSQL database (`store.url`). Same config otherwise, `router.ledger_durable: true`
(the default: a response's record is committed before its final bytes). Three kinds of
request, each a non-streaming chat completion of 8 tokens from one keep-alive connection,
one at a time:

- `plain`: a tenant without budgets or a tier: the store on the path is the ledger commit;
- `governed`: a tenant with a tokens-per-minute budget and a concurrency tier: shared
  budgets (a lease top-up now and then) and a request slot (acquired before dispatch);
- `agent`: the plain tenant's agent run steps (`x-gpupool-run-id`, 10 steps a run): the
  run's step number (and home) from the store;
- `governed-agent`: the governed tenant's agent run steps: a request slot, the step number
  and, at each run's first step, a run slot.
- `session`: the plain tenant's session steps (`x-session-id`, one session per round and
  router, a new user message every 10 steps: a task, one run each): the session's run from
  the store with the step's number (since s45: `gpupool_session_step`, one statement);
  `governed-session`: the governed tenant's.
- `responses`: the plain tenant's Responses API requests (`/v1/responses`, stored: each a
  new response, no `previous_response_id`): on PostgreSQL its placement is written before
  the final bytes beside the ledger's record (since s46).

`--baseline-tree DIR`: a third router, on the PostgreSQL store too (a database of its own),
runs the router code of DIR (a checkout of another commit, e.g. `git worktree add DIR
<commit>`: `PYTHONPATH=DIR`), in the same turns: before and after a change in one run, each
against the same SQLite router. Its rows are `postgres-base`. `--gap-ms G`: each measured
request waits G ms first (a tenant whose requests do not follow each other at once: a
request slot's hand-over, 10 ms, does not reach the next one).

Each round sends `--requests` of every kind to each router, the routers taking turns every
`--block` requests (20; in every order in turn, `_order`), each on a keep-alive connection
of its own for the whole run, so a change of the machine's load lands on both. Reported per kind and
store: p50 / p90 / p99 over all rounds, the added p50 (PostgreSQL - SQLite) per round and
over all (for agent kinds also apart for each run's first step, which waits for the store's
answer before placement, and the later ones, sent on before it), the load average, and each
PostgreSQL router's agent steps sent on before the store's answer
(`gpupool_governance_step_speculated_total`, by outcome; none before s41) and how many of
them waited for it at the response (`..._speculated_awaited_total`; none before s43), and
those numbered with their ledger record's commit instead
(`gpupool_governance_step_numbered_at_commit_total`; since s44 every known run's
non-streaming step without a tier, so all of the later `agent` steps), and since s48 those
numbered from the run's lease (`gpupool_governance_run_lease_steps_total`: with
`store.run_lease`, the later `agent` steps instead) and the steps that waited for another
replica's lease (`..._run_lease_moves_total`).
The router processes, the engine and PostgreSQL share the machine's CPUs with this client,
as a small deployment would.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from pools.testing.router_process import RouterProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / ".gpupool" / "models" / "tiny"
PASSWORD_ENV = "GPUPOOL_BENCH_STORE_PASSWORD"
KEYS = {"plain": "plain-" + "p" * 24, "governed": "governed-" + "g" * 24}
METRICS_KEY = "metrics-" + "m" * 24  # GET /metrics (router.metrics_api_key_env)
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
STEPS_PER_RUN = 10
KINDS = (
    "plain",
    "governed",
    "agent",
    "governed-agent",
    "session",
    "governed-session",
    "responses",
)
RESPONSES_BODY = {"model": "tiny", "input": "hi", "max_output_tokens": 8}
STORES = ("sqlite", "postgres")
BASELINE = "postgres-base"  # the --baseline-tree router


def _config(
    folder: Path, engine: str, store: dict[str, Any] | None, router_options: dict[str, Any]
) -> dict[str, Any]:
    name = "postgres" if store else "sqlite"
    router: dict[str, Any] = {
        "state_path": str(folder / f"state-{name}.json"),
        "log_level": "warning",
        "ledger_durable": True,
        "metrics_api_key_env": "GPUPOOL_BENCH_METRICS_KEY",
        **router_options,
    }
    if store is None:
        router["ledger_path"] = str(folder / "ledger.sqlite")
    config: dict[str, Any] = {
        "model": {"name": "tiny", "path": str(MODEL)},
        "engines": {"launcher": "static", "static": {"urls": [engine]}},
        "pools": {"normal": {"classes": ["normal", "agent"], "share": {"initial_frac": 1.0}}},
        "router": router,
        "governance": {
            # runs are not ended (they go idle): room for every governed-agent run
            "tiers": {"wide": {"max_concurrent_runs": 100_000, "max_concurrent_requests": 100}}
        },
        "tenants": [
            {"name": "plain", "api_key_env": "GPUPOOL_BENCH_PLAIN_KEY"},
            {
                "name": "governed",
                "api_key_env": "GPUPOOL_BENCH_GOVERNED_KEY",
                "tier": "wide",
                "tokens_per_minute": 10_000_000,
            },
        ],
    }
    if store is not None:
        config["store"] = store
    return config


def _headers(kind: str, k: int, tag: str) -> dict[str, str]:
    tenant = "governed" if kind.startswith("governed") else "plain"
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    if kind.endswith("agent"):
        headers["x-gpupool-run-id"] = f"{tag}-{k // STEPS_PER_RUN}"
    elif kind.endswith("session"):
        headers["x-session-id"] = tag
    return headers


def _body(kind: str, k: int) -> dict[str, object]:
    """A session's step k belongs to task k // STEPS_PER_RUN (its user message: a new task
    starts the session's next run); `responses` sends RESPONSES_BODY; other kinds BODY."""
    if kind == "responses":
        return RESPONSES_BODY
    if not kind.endswith("session"):
        return BODY
    task = {"role": "user", "content": f"task {k // STEPS_PER_RUN}"}
    return {**BODY, "messages": [task]}


async def _send(
    session: aiohttp.ClientSession, url: str, kind: str, ks: range, tag: str, gap_s: float
) -> list[float]:
    """Latencies (ms) of requests `ks` (their numbers: an agent run is 10 of them), one at a
    time on the session's one connection, `gap_s` apart."""
    took: list[float] = []
    for k in ks:
        if gap_s > 0:
            await asyncio.sleep(gap_s)
        headers = _headers(kind, k, tag)
        started = time.perf_counter()
        body = _body(kind, k)
        path = "/v1/responses" if kind == "responses" else "/v1/chat/completions"
        async with session.post(f"{url}{path}", json=body, headers=headers) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"{kind}: HTTP {r.status}: {await r.text()}")
        took.append((time.perf_counter() - started) * 1e3)
    return took


async def _round(
    sessions: dict[str, aiohttp.ClientSession],
    urls: dict[str, str],
    kind: str,
    requests: int,
    block: int,
    tag: str,
    gap_s: float = 0.0,
) -> dict[str, list[float]]:
    """`requests` requests of `kind` to each router, the routers taking turns every `block`
    requests (so a change of the machine's load lands on all), in each of their orders in
    turn (`_order`)."""
    took: dict[str, list[float]] = {store: [] for store in urls}
    for b, first in enumerate(range(0, requests, block)):
        ks = range(first, min(requests, first + block))
        order = _order(list(urls), b)
        for store in order:
            tagged = f"{tag}-{store}"
            took[store] += await _send(sessions[store], urls[store], kind, ks, tagged, gap_s)
    return took


def _order(routers: list[str], b: int) -> list[str]:
    """Block `b`'s order: rotated by `b`, so each router takes each place in turn and no
    router's turn follows its own (each turn's first request comes to a process that slept
    while the others were served). Until s45 the order was reversed every other block: with
    three routers the first and the last took two turns in a row half the time, the middle
    one never, and its turns' first requests (agent kinds: first steps) came cold: with the
    same code in both PostgreSQL routers, the middle one's first steps +0.31 ms p50 over the
    other's (plain and all agent steps within 0.03 ms; s45's results)."""
    n = len(routers)
    return routers[b % n :] + routers[: b % n]


def _parts(kind: str, took: dict[str, list[float]]) -> dict[str, dict[str, list[float]]]:
    """The round's latencies of `kind` (request k at index k); for agent kinds also split
    into each run's first step (which waits for the store's answer before placement: the
    router does not know the run yet) and the later ones (sent on before it)."""
    parts = {kind: took}
    if kind.endswith(("agent", "session")):
        parts[f"{kind} (first steps)"] = {
            s: [t for k, t in enumerate(v) if k % STEPS_PER_RUN == 0] for s, v in took.items()
        }
        parts[f"{kind} (later steps)"] = {
            s: [t for k, t in enumerate(v) if k % STEPS_PER_RUN != 0] for s, v in took.items()
        }
    return parts


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _measure(
    urls: dict[str, str], args: argparse.Namespace
) -> tuple[dict[tuple[str, str], list[float]], dict[tuple[str, str], list[float]], list[float]]:
    kinds = args.kinds.split(",")
    sessions = {
        store: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) for store in urls
    }
    try:
        for kind in kinds:  # warm-up: connections, pools, leases, caches
            await _round(sessions, urls, kind, 100, args.block, "warm")
        samples: dict[tuple[str, str], list[float]] = {(k, s): [] for k in kinds for s in urls}
        added: dict[tuple[str, str], list[float]] = {(k, s): [] for k in kinds for s in urls}
        loads = []
        for n in range(args.rounds):
            for kind in kinds:
                took = await _round(
                    sessions, urls, kind, args.requests, args.block, f"r{n}", args.gap_ms / 1e3
                )
                for part, picked in _parts(kind, took).items():
                    for store in urls:
                        samples.setdefault((part, store), []).extend(picked[store])
                        p50 = statistics.median(picked[store]) - statistics.median(picked["sqlite"])
                        added.setdefault((part, store), []).append(p50)
            loads.append(os.getloadavg()[0])
            print(
                f"round {n + 1}: added p50 "
                + ", ".join(
                    f"{k} {added[(k, s)][-1]:+.3f} ms ({s})"
                    for k in kinds
                    for s in urls
                    if s != "sqlite"
                )
                + f" (load {loads[-1]:.1f})",
                file=sys.stderr,
                flush=True,
            )
    finally:
        for session in sessions.values():
            await session.close()
    return samples, added, loads


SPECULATED = "gpupool_governance_step_speculated_total"
AWAITED = "gpupool_governance_step_speculated_awaited_total"  # since s43
NUMBERED = "gpupool_governance_step_numbered_at_commit_total"  # since s44
# since s48 (store.run_lease): steps numbered from the holder's memory, and moves waited for
LEASED = {
    "gpupool_governance_run_lease_steps_total": "numbered from the run's lease",
    "gpupool_governance_run_lease_moves_total": "waited for another replica's lease",
}


async def _speculated(urls: dict[str, str]) -> dict[str, dict[str, float]]:
    """Each router's `SPECULATED` samples by outcome (empty: the metric is not there)."""
    out: dict[str, dict[str, float]] = {}
    async with aiohttp.ClientSession() as session:
        for store, url in urls.items():
            headers = {"authorization": f"Bearer {METRICS_KEY}"}
            async with session.get(f"{url}/metrics", headers=headers) as r:
                text = await r.text()
            out[store] = {}
            for line in text.splitlines():
                if line.startswith(SPECULATED + "{"):
                    labels, _, value = line.rpartition(" ")
                    outcome = labels.partition('outcome="')[2].partition('"')[0]
                    out[store][outcome] = float(value)
                elif line.startswith(AWAITED + " "):
                    out[store]["of them, the response waited for the answer"] = float(
                        line.rpartition(" ")[2]
                    )
                elif line.startswith(NUMBERED + "{"):
                    labels, _, value = line.rpartition(" ")
                    outcome = labels.partition('outcome="')[2].partition('"')[0]
                    out[store][f"numbered with the record: {outcome}"] = float(value)
                elif (name := line.partition(" ")[0]) in LEASED:
                    out[store][LEASED[name]] = float(line.rpartition(" ")[2])
    return out


def _report(
    samples: dict[tuple[str, str], list[float]],
    added: dict[tuple[str, str], list[float]],
    loads: list[float],
    args: argparse.Namespace,
    speculated: dict[str, dict[str, float]] | None = None,
) -> str:
    command = "python -m benchmarks.store_router_latency " + shlex.join(sys.argv[1:])
    lines = [
        "# Store latency through the router, c=1: embedded SQLite vs PostgreSQL",
        "",
        f"`{command.strip()}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())},"
        f" {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), load (1 min)"
        f" {min(loads):.1f}-{max(loads):.1f}; {args.rounds} rounds x {args.requests} requests"
        f" per kind and router, the routers taking turns every {args.block} requests"
        + (f", {args.gap_ms:g} ms idle before each." if args.gap_ms else ".")
        + (
            f" `{BASELINE}`: the router code of {args.baseline_tree}"
            f" ({_commit(args.baseline_tree)}) beside this tree's ({_commit(ROOT)})."
            if args.baseline_tree
            else ""
        ),
        "",
        "| kind | store | p50 ms | p90 ms | p99 ms | added p50 ms (per-round range) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for kind, store in samples:
        values = samples[(kind, store)]
        extra = ""
        if store != "sqlite":
            per_round = added[(kind, store)]
            whole = statistics.median(values) - statistics.median(samples[(kind, "sqlite")])
            extra = f"{whole:+.3f} ({min(per_round):+.3f}..{max(per_round):+.3f})"
        lines.append(
            f"| {kind} | {store} | {statistics.median(values):.3f} |"
            f" {_pct(values, 0.9):.3f} | {_pct(values, 0.99):.3f} | {extra} |"
        )
    for store, outcomes in (speculated or {}).items():
        if store != "sqlite":
            counts = ", ".join(f"{k} {v:.0f}" for k, v in sorted(outcomes.items())) or "none"
            lines.append(
                f"\n`{store}`: agent steps sent on before the store's answer (s41), or"
                f" numbered with their record (s44): {counts}"
            )
    return "\n".join(lines) + "\n"


def _commit(tree: Path) -> str:
    """The tree's commit, `+` when it has uncommitted changes to tracked files."""
    head = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(tree), "diff", "--quiet", "HEAD", "--", "router", "pools"],
        capture_output=True,
    ).returncode
    return (head or "?") + ("+" if dirty else "")


async def _run(
    args: argparse.Namespace, urls: dict[str, str], password: str, folder: Path, port: int
) -> str:
    env = {**os.environ, PASSWORD_ENV: password}
    for tenant, key in KEYS.items():
        env[f"GPUPOOL_BENCH_{tenant.upper()}_KEY"] = key
    env["GPUPOOL_BENCH_METRICS_KEY"] = METRICS_KEY
    routers: dict[str, RouterProcess] = {}
    try:
        for store in (*STORES, BASELINE) if args.baseline_tree else STORES:
            shared, router_env = None, env
            if store != "sqlite":
                options = {"password_env": PASSWORD_ENV, **_options(args.store)}
                shared = {"url": urls[store], **options}
            if store == BASELINE:
                router_env = {**env, "PYTHONPATH": str(args.baseline_tree)}
            folder_of = folder / store
            folder_of.mkdir()
            data = _config(folder_of, f"http://127.0.0.1:{port}", shared, _options(args.router))
            if args.queue_order is not None:  # every router's pool, e.g. run_las
                data["pools"]["normal"]["queue"] = {"order": args.queue_order}
            config = folder_of / "config.json"
            config.write_text(json.dumps(data))
            routers[store] = RouterProcess(config, folder_of / "router.log", env=router_env)
        for router in routers.values():
            await router.wait_ready_async(120)
        samples, added, loads = await _measure({s: r.url for s, r in routers.items()}, args)
        speculated = await _speculated({s: r.url for s, r in routers.items()})
    finally:
        for router in routers.values():
            router.stop()
    return _report(samples, added, loads, args, speculated)


@contextlib.contextmanager
def fake_engine() -> Iterator[int]:
    """A fake engine process (`pools.testing.fake_engine`, no delays) on a free port, which is
    yielded; stopped on exit."""
    port = free_port()
    engine = subprocess.Popen(
        [sys.executable, "-m", "pools.testing.fake_engine", "--port", str(port)],
        stdout=subprocess.DEVNULL,
    )
    try:
        yield port
    finally:
        engine.terminate()
        engine.wait(10)


def _options(pairs: list[str]) -> dict[str, Any]:
    """`key=value` pairs, each value read as JSON (else a string)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, _, text = pair.partition("=")
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=400, help="per kind, store and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--kinds",
        default="plain,governed,agent",
        help=f"comma-separated, of: {','.join(KINDS)}",
    )
    parser.add_argument(
        "--block", type=int, default=20, help="the stores take turns every BLOCK requests"
    )
    parser.add_argument(
        "--store", action="append", default=[], metavar="KEY=VALUE", help="a store.* setting"
    )
    parser.add_argument(
        "--router",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a router.* setting, for both routers",
    )
    parser.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="idle time before each measured request (a tenant's sparse requests)",
    )
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help="a third router (PostgreSQL) running the router code of this checkout",
    )
    parser.add_argument(
        "--queue-order",
        choices=("fifo", "wfq", "run_las"),
        help="the pool's queue.order on every router (default: the config's default, wfq)",
    )
    parser.add_argument("--out", type=Path, help="write the report (Markdown) here too")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.kinds.split(",")) - set(KINDS))
    if unknown:
        parser.error(f"--kinds: unknown {', '.join(unknown)} (known: {', '.join(KINDS)})")
    pg = importlib.import_module("tests.postgres")  # test support, not the product
    with pg.start_postgres() as server, tempfile.TemporaryDirectory() as tmp:
        urls = {"postgres": server.create_database("store_router_latency")}
        if args.baseline_tree:
            urls[BASELINE] = server.create_database("store_router_latency_base")
        with fake_engine() as port:
            report = asyncio.run(_run(args, urls, pg.PASSWORD, Path(tmp), port))
    print(report)
    if args.out is not None:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
