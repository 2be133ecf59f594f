"""Benchmark: issue 25's failure drills for `gpupool serve --replicas N` on one PostgreSQL store,
over fake engines that stream slowly (so requests are in flight when something breaks).

    .venv/bin/python -m benchmarks.replica_drills [--drills kill,outage,hang] [--replicas 3]
        [--rounds 1] [--requests 300] [--outage-s 30] [--real-engines] [--json FILE]

It starts its own PostgreSQL (tests/postgres.py's server: initdb + postgres from the binaries
in /usr/local/bin or Debian's, a unix socket in a temporary folder, run as `nobody` when this
runs as root; fsync off), two fake engine processes (`pools.testing.fake_engine`, TTFT 60 ms,
40 ms per token) and, per drill, `gpupool serve --replicas N` on a database of its own. Every
request is sent on a new connection, so the kernel spreads them over the routers
(SO_REUSEPORT). Three tenants, each with a concurrency tier (so every request holds a slot
in `concurrency_slots`, named `<replica>:<request id>`: that is how a router's in-flight
requests are counted from outside): `alpha` with a tokens-per-minute budget, `beta` with a
tier of 10 requests at once, `gamma` with a requests-per-minute budget.

- **kill**: `--requests` requests (streaming and not, with usage) from 24 workers; when half
  have completed, the router holding the most slots is sent SIGKILL. Reported: the requests
  that failed and whether each was in flight at the kill (sent before it, ended after), the
  killed router's slots at the kill (its in-flight requests, less those already answered),
  requests served after the kill, a new router in its place (its replica id through
  /admin/pools), the dead router's slots gone from the database (seconds after the kill), the
  shared budget levels, and the ledger: one row per answered request with the tokens the client
  was told (`usage`), none missing, none extra. Beside that load, until it ends, 4 workers of
  a fourth tenant, `delta` (600 tokens per minute, no tier), spend its budget within seconds;
  its ledger tokens against what its bucket could give (full at its first request, plus the
  refill until its last answer) is the overspend, against the bound of one request's
  reservation (prompt + `max_tokens`) per replica that served. `--victim leader` kills the
  router that leads the rebalancer instead (named by `/admin/pools`: `rebalancer.leader`), and
  reports the seconds from the kill until another router answers that it leads (polled on new
  connections every 50 ms), beside the rebalancer's interval (the issue's bar: 2 intervals).
- **outage**: for `budgets_on_outage` open, then closed: steady load from 12 workers; after
  10 s PostgreSQL is stopped (fast shutdown) for `--outage-s`, then started; the load runs
  15 s more. Reported per phase (before, during, after): 200s, 503 `store_unavailable` and
  anything else; every router's `gpupool_ledger_*` and `gpupool_governance_store_up` during
  the outage and after; the seconds from the restart until the ledger holds every answered
  request (rows = 200s, tokens = the clients' usage) and until the last 503.
- **hang** (only when asked): the outage with `open`, but PostgreSQL's processes SIGSTOPped
  instead of stopped (a hung server: connections accepted, never answered), then SIGCONT.

`--real-engines`: the same drills in front of two real CPU vLLM engines (the tiny dev model,
gpupool's local launcher, 64 MiB of KV each) instead of the fake ones: their answers are
generated, so the load is what two CPU engines serve, and the ledger's tokens are the
engines' own counts.

Progress goes to stderr, the summary to stdout (and `--json`). Nothing it starts outlives it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.engines import cpu_engines
from pools.testing.router_process import RouterProcess, free_port

MODEL = Path(__file__).resolve().parents[1] / ".gpupool" / "models" / "tiny"
PASSWORD_ENV = "GPUPOOL_DRILL_STORE_PASSWORD"
ENGINE_KEY_ENV = "GPUPOOL_DRILL_ENGINE_KEY"  # the real engines' key (--real-engines)
KEYS = {
    "alpha": "alpha-" + "a" * 24,
    "beta": "beta-" + "b" * 24,
    "gamma": "gamma-" + "c" * 24,
    "delta": "delta-" + "e" * 24,
    "admin": "admin-" + "d" * 24,
}
TENANTS = ("alpha", "beta", "gamma")  # the drills' load
SPENDER = "delta"  # the kill drill's budget-bound tenant, beside the load
SPENDER_TOKENS_PER_MINUTE = 600  # spent within ~3 s by its workers: the rest is refill
SPENDER_WORKERS = 4
MAX_TOKENS = 20  # the most a drill request asks for
REBALANCER_INTERVAL_S = 2.0  # the routers' rebalancer.interval_s


def _postgres() -> Any:
    """tests/postgres.py, the tests' real server (imported by name: it is test support, not
    the product, and not type-checked with the packages)."""
    return importlib.import_module("tests.postgres")


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Reply:
    """One request as its client saw it; times in seconds since the drill's start."""

    tenant: str
    stream: bool
    sent_s: float
    ended_s: float = 0.0
    status: int = 0
    complete: bool = False  # a whole body with usage, or a stream through [DONE]
    request_id: str | None = None
    code: str | None = None  # the error body's code, when there is one
    tokens: int = 0  # prompt + completion, as `usage` told the client
    error: str | None = None


@dataclass
class Load:
    """Workers that send requests on new connections until `stop` is set or `budget` runs
    out; `on_done` is called after each reply."""

    url: str
    workers_per_tenant: int
    budget: int | None
    started: float = field(default_factory=time.monotonic)
    replies: list[Reply] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    completed: int = 0
    tenants: tuple[str, ...] = TENANTS

    def now(self) -> float:
        return time.monotonic() - self.started

    async def run(self) -> None:
        connector = aiohttp.TCPConnector(force_close=True, limit=0)
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            workers = [
                self._worker(session, tenant, random.Random(f"{tenant}{n}"))
                for tenant in self.tenants
                for n in range(self.workers_per_tenant)
            ]
            await asyncio.gather(*workers)

    async def _worker(
        self, session: aiohttp.ClientSession, tenant: str, rng: random.Random
    ) -> None:
        while not self.stop.is_set():
            if self.budget is not None:
                if self.budget <= 0:
                    return
                self.budget -= 1
            reply = Reply(tenant=tenant, stream=rng.random() < 0.5, sent_s=self.now())
            self.replies.append(reply)
            await _one(session, self.url, reply, rng.randint(6, MAX_TOKENS))
            reply.ended_s = self.now()
            if reply.status == 200 and reply.complete:
                self.completed += 1
            if reply.status not in (0, 200):
                await asyncio.sleep(0.2)  # a refusal: back off a little, as a client would


async def _one(session: aiohttp.ClientSession, url: str, reply: Reply, max_tokens: int) -> None:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "drill " * 8}],
        "max_tokens": max_tokens,
    }
    await send(session, url, reply, body, {"Authorization": f"Bearer {KEYS[reply.tenant]}"})


async def send(
    session: aiohttp.ClientSession,
    url: str,
    reply: Reply,
    body: dict[str, Any],
    headers: dict[str, str],
) -> None:
    """POST a chat completion `body` (streamed with usage when `reply.stream`) and note in
    `reply` what the client saw: status, request id, error code, `usage` tokens, whether the
    answer came whole. A broken connection or a timeout is noted in `reply.error`."""
    if reply.stream:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            reply.status = r.status
            reply.request_id = r.headers.get("x-gpupool-request-id")
            if r.status != 200:
                with contextlib.suppress(Exception):
                    reply.code = (await r.json(content_type=None))["error"].get("code")
                return
            if not reply.stream:
                usage = (await r.json())["usage"]
                reply.tokens = int(usage["total_tokens"])
                reply.complete = True
                return
            async for raw in r.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    reply.complete = True
                elif line.startswith("data: ") and '"usage"' in line:
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        reply.tokens = int(usage["total_tokens"])
    except (TimeoutError, aiohttp.ClientError, ValueError) as err:
        reply.error = type(err).__name__


# -- the pieces: PostgreSQL, engines, routers ------------------------------------------------


@contextlib.contextmanager
def _engines(count: int) -> Iterator[list[str]]:
    procs, urls = [], []
    try:
        for _ in range(count):
            port = free_port()
            argv = ["-m", "pools.testing.fake_engine", "--port", str(port)]
            argv += ["--ttft-ms", "60", "--itl-ms", "40", "--num-gpu-blocks", "100000"]
            procs.append(subprocess.Popen([sys.executable, *argv], start_new_session=True))
            urls.append(f"http://127.0.0.1:{port}")
        yield urls
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@contextlib.asynccontextmanager
async def _real_engines(count: int, run_dir: Path) -> AsyncIterator[list[str]]:
    """`count` real CPU vLLM engines (`benchmarks.engines.cpu_engines`), stopped on the way
    out; their key in `ENGINE_KEY_ENV` (the routers inherit it)."""
    os.environ.setdefault(ENGINE_KEY_ENV, "drill-" + secrets.token_hex(8))
    launcher = cpu_engines(
        MODEL,
        count=count,
        port=free_port(),
        key_env=ENGINE_KEY_ENV,
        run_dir=run_dir,
        max_num_seqs=64,
        progress=lambda m: print(f"[engines] {m}", file=sys.stderr, flush=True),
    )
    try:
        specs = await launcher.start()
        yield [spec.url for spec in specs]
    finally:
        await launcher.aclose()


def _config(
    folder: Path, engines: list[str], url: str, store: dict[str, Any], *, real_engines: bool
) -> Path:
    static: dict[str, Any] = {"urls": engines}
    if real_engines:  # their key is in ENGINE_KEY_ENV (`_real_engines`)
        static["api_key_env"] = ENGINE_KEY_ENV
    config = {
        "model": {"name": "tiny", "path": str(MODEL)},
        "engines": {"launcher": "static", "static": static},
        "pools": {"normal": {"classes": ["normal", "agent"], "share": {"initial_frac": 1.0}}},
        "router": {
            "state_path": str(folder / "state.json"),
            "log_level": "warning",
            "ledger_durable": True,
            "scrape_interval_s": 0.2,
            "admin_api_key_env": "GPUPOOL_DRILL_ADMIN_KEY",
        },
        "store": {"url": url, "password_env": PASSWORD_ENV, **store},
        # short, so the leader drill's bar (the lead handed over within 2 intervals) is tight
        "rebalancer": {"interval_s": REBALANCER_INTERVAL_S},
        "governance": {
            "tiers": {
                "wide": {"max_concurrent_runs": 100, "max_concurrent_requests": 200},
                "narrow": {"max_concurrent_runs": 100, "max_concurrent_requests": 10},
            }
        },
        "tenants": [
            {
                "name": "alpha",
                "api_key_env": "GPUPOOL_DRILL_ALPHA_KEY",
                "tier": "wide",
                "tokens_per_minute": 400_000,
            },
            {"name": "beta", "api_key_env": "GPUPOOL_DRILL_BETA_KEY", "tier": "narrow"},
            {
                "name": "gamma",
                "api_key_env": "GPUPOOL_DRILL_GAMMA_KEY",
                "tier": "wide",
                "requests_per_minute": 20_000,
            },
            {  # no tier: no slots, so the kill drill's slot counts are the load's alone
                "name": SPENDER,
                "api_key_env": f"GPUPOOL_DRILL_{SPENDER.upper()}_KEY",
                "tokens_per_minute": SPENDER_TOKENS_PER_MINUTE,
            },
        ],
    }
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return path


def _env(password: str, mark: str) -> dict[str, str]:
    env = {**os.environ, PASSWORD_ENV: password, "GPUPOOL_DRILL_MARK": mark}
    for name, key in KEYS.items():
        env[f"GPUPOOL_DRILL_{name.upper()}_KEY"] = key
    return env


def marked(mark: str) -> list[int]:
    """Live processes whose environment carries `mark` (the supervisor, fork server, routers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            marked = f"GPUPOOL_DRILL_MARK={mark}".encode() in (entry / "environ").read_bytes()
            if marked and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
    return found


def _stop_router(router: RouterProcess, mark: str) -> None:
    router.stop()
    for pid in marked(mark):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class Db:
    """Blocking reads of the drill's database (run through asyncio.to_thread)."""

    def __init__(self, url: str, password: str) -> None:
        self.url, self.password = url, password

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.url, password=self.password, connect_timeout=2) as conn:
            return list(conn.execute(sql, params).fetchall())

    def slots(self) -> list[str]:
        return [row[0] for row in self.query("SELECT holder FROM concurrency_slots")]

    def ledger(self, ids: list[str]) -> dict[str, tuple[int, int]]:
        """request id -> (rows, prompt + completion tokens) for those ids."""
        rows = self.query(
            "SELECT request_id, COUNT(*), CAST(SUM(prompt_tokens + completion_tokens) AS BIGINT)"
            " FROM requests WHERE request_id = ANY(%s) GROUP BY request_id",
            ids,
        )
        return {r[0]: (int(r[1]), int(r[2])) for r in rows}

    def buckets(self) -> list[tuple[Any, ...]]:
        return self.query(
            "SELECT tenant, bucket, level, capacity FROM budget_buckets ORDER BY 1, 2"
        )


async def _replica(url: str) -> str | None:
    """The replica id of whichever router a new connection reaches."""
    with contextlib.suppress(TimeoutError, aiohttp.ClientError, KeyError):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            headers = {"Authorization": f"Bearer {KEYS['admin']}"}
            async with session.get(f"{url}/admin/pools", headers=headers) as r:
                replica: str = (await r.json())["rebalancer"]["leader"]["replica"]
                return replica
    return None


async def _leadership(url: str) -> tuple[str, bool, str | None] | None:
    """(the answering router's replica id, whether it leads, the leader it last saw) from
    `/admin/pools` on a new connection; None when no router answered."""
    with contextlib.suppress(TimeoutError, aiohttp.ClientError, KeyError):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            headers = {"Authorization": f"Bearer {KEYS['admin']}"}
            async with session.get(f"{url}/admin/pools", headers=headers) as r:
                view = (await r.json())["rebalancer"]["leader"]
                return str(view["replica"]), bool(view["leading"]), view["leader"]
    return None


async def _leader_pid(url: str, timeout_s: float = 30.0) -> str:
    """The pid of the router that leads (replica ids are `host:pid:random`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = await _leadership(url)
        if seen is not None and seen[2]:
            return seen[2].split(":")[1]
        await asyncio.sleep(0.1)
    raise RuntimeError(f"no router named a leader within {timeout_s} s")


async def _handover_s(url: str, killed_pid: str, since: float, timeout_s: float = 60.0) -> float:
    """Seconds from `since` (monotonic) until a router other than `killed_pid` answers that it
    leads."""
    deadline = since + timeout_s
    while time.monotonic() < deadline:
        seen = await _leadership(url)
        if seen is not None and seen[1] and seen[0].split(":")[1] != killed_pid:
            return time.monotonic() - since
        await asyncio.sleep(0.05)
    raise RuntimeError(f"no router took the lead within {timeout_s} s of the kill")


async def _replicas(url: str, want: int, timeout_s: float = 30.0) -> set[str]:
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(seen) < want and time.monotonic() < deadline:
        replica = await _replica(url)
        if replica:
            seen.add(replica)
    return seen


async def _scrape_all(url: str, want: int, tries: int = 40) -> dict[str, dict[str, float]]:
    """`gpupool_ledger_*` and the store's up gauge of each router, keyed by its replica id:
    /admin/pools then /metrics on one keep-alive connection, which stays on one router."""
    found: dict[str, dict[str, float]] = {}
    headers = {"Authorization": f"Bearer {KEYS['admin']}"}
    for _ in range(tries):
        if len(found) >= want:
            break
        with contextlib.suppress(TimeoutError, aiohttp.ClientError, KeyError, ValueError):
            async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1),
                timeout=aiohttp.ClientTimeout(total=10),
                headers=headers,
            ) as session:
                async with session.get(f"{url}/admin/pools") as r:
                    replica = str((await r.json())["rebalancer"]["leader"]["replica"])
                async with session.get(f"{url}/metrics") as r:
                    text = await r.text()
            values: dict[str, float] = {}
            for line in text.splitlines():
                if line.startswith(("gpupool_ledger_", "gpupool_governance_store_up")):
                    name, value = line.rsplit(" ", 1)
                    if not name.endswith("_created"):
                        values[name] = float(value)
            found[replica] = values
    return found


def _routers(
    args: argparse.Namespace,
    pg: Any,
    engines: list[str],
    folder: Path,
    database: str,
    store: dict[str, Any],
) -> tuple[Db, str, RouterProcess]:
    """`gpupool serve --replicas N` on a fresh database `database` (its log `<database>.log`):
    the database, the mark its processes carry, the router process (not ready yet)."""
    password: str = _postgres().PASSWORD
    url = pg.create_database(database)
    mark = secrets.token_hex(8)
    router = RouterProcess(
        _config(folder, engines, url, store, real_engines=args.real_engines),
        folder / f"{database}.log",
        args=["--replicas", str(args.replicas)],
        env=_env(password, mark),
    )
    return Db(url, password), mark, router


# -- the kill drill ---------------------------------------------------------------------------


async def kill_drill(
    args: argparse.Namespace, pg: Any, engines: list[str], folder: Path, round_: int
) -> dict[str, Any]:
    name, store = f"drill_kill_{round_}", {"slot_lease_s": args.slot_lease_s}
    db, mark, router = _routers(args, pg, engines, folder, name, store)
    try:
        await router.wait_ready_async(120)
        before = await _replicas(router.url, args.replicas)
        _log(f"kill drill: {len(before)} routers answering: {sorted(before)}")
        load = Load(router.url, workers_per_tenant=8, budget=args.requests)
        task = asyncio.ensure_future(load.run())
        # beside it, until it ends: a tenant whose budget runs out, to bound the overspend
        spender = Load(router.url, SPENDER_WORKERS, None, started=load.started, tenants=(SPENDER,))
        spending = asyncio.ensure_future(spender.run())
        while load.completed < args.requests // 2 and not task.done():  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        holders = await asyncio.to_thread(db.slots)
        by_pid: dict[str, list[str]] = {}
        for holder in holders:
            parts = holder.split(":")
            if len(parts) >= 4 and parts[-2] != "run":
                by_pid.setdefault(parts[1], []).append(parts[-1])
        if args.victim == "leader":
            victim = await _leader_pid(router.url)
        else:
            victim = max(by_pid, key=lambda pid: len(by_pid[pid]))
        answered = {r.request_id for r in load.replies if r.complete}
        victim_slots = by_pid.get(victim, [])
        in_flight = [rid for rid in victim_slots if rid not in answered]
        os.kill(int(victim), signal.SIGKILL)
        killed_mono = time.monotonic()
        killed_s = load.now()
        _log(
            f"kill drill: SIGKILL router pid {victim} ({args.victim}) at {killed_s:.2f} s, after"
            f" {load.completed} completed; its slots: {len(victim_slots)}"
            f" ({len(in_flight)} of requests not yet answered); slots per router"
            f" {sorted(len(v) for v in by_pid.values())}"
        )
        killed_wall_s = time.time()
        handover_s = None
        if args.victim == "leader":
            handover_s = await _handover_s(router.url, victim, killed_mono)
            _log(f"kill drill: another router leads {handover_s:.2f} s after the kill")
        await task
        spender.stop.set()
        await spending
        # the dead router's slots: expired (dropped before any count) at their last renewal +
        # slot_lease_s; the rows themselves go at the tenant's next acquire
        expiries = await asyncio.to_thread(
            db.query,
            "SELECT MAX(expires_at_s), COUNT(*) FROM concurrency_slots WHERE holder LIKE %s",
            f"%:{victim}:%",
        )
        last_expiry, rows_left = expiries[0]
        slots_free_s = None if last_expiry is None else float(last_expiry) - killed_wall_s
        await asyncio.sleep(max(0.0, (slots_free_s or 0.0) + 0.5))
        beta = Load(router.url, workers_per_tenant=1, budget=3)
        await beta.run()  # one request per tenant after the lease, each acquiring a slot
        left_after = await asyncio.to_thread(
            db.query,
            "SELECT COUNT(*) FROM concurrency_slots WHERE holder LIKE %s",
            f"%:{victim}:%",
        )
        await task
        after = await _replicas(router.url, args.replicas)
        replaced = sorted(r for r in after if r not in before)
        alive = [r for r in after if f":{victim}:" not in r]
        served_ids = [r.request_id for r in load.replies if r.complete and r.request_id]
        ledger = await asyncio.to_thread(db.ledger, served_ids)
        failed_ids = [
            r.request_id
            for r in load.replies
            if r.status == 200 and not r.complete and r.request_id
        ]
        failed_ledger = await asyncio.to_thread(db.ledger, failed_ids)
        buckets = await asyncio.to_thread(db.buckets)
        ok_rows = await asyncio.to_thread(
            db.query, "SELECT COUNT(*) FROM requests WHERE status_code = 200"
        )
        spent = await asyncio.to_thread(
            db.query,
            "SELECT COUNT(*), CAST(SUM(prompt_tokens + completion_tokens) AS BIGINT),"
            " MAX(prompt_tokens) FROM requests WHERE tenant = %s AND status_code = 200",
            SPENDER,
        )
    finally:
        _stop_router(router, mark)
    refused = [r for r in load.replies if r.status in (429, 503)]
    failed = [r for r in load.replies if not (r.status == 200 and r.complete) and r not in refused]
    failed_in_flight = [r for r in failed if r.sent_s < killed_s <= r.ended_s + 0.05]
    served = [r for r in load.replies if r.complete]
    missing = [rid for rid in served_ids if rid not in ledger]
    tokens_off = [
        r.request_id
        for r in served
        if r.request_id in ledger and ledger[r.request_id][1] != r.tokens
    ]
    result = {
        "failed_not_in_flight": [
            {
                "sent_s": round(r.sent_s - killed_s, 3),
                "ended_s": round(r.ended_s - killed_s, 3),
                "status": r.status,
                "error": r.error,
                "stream": r.stream,
            }
            for r in failed
            if r not in failed_in_flight
        ],
        "ledger_rows_for_failed_streams": len(failed_ledger),
        "requests": len(load.replies),
        "served_200": len(served),
        "failed": len(failed),
        "failed_statuses": sorted({f"{r.status}:{r.code or r.error}" for r in failed}),
        "refused": len(refused),
        "refused_codes": sorted({f"{r.status}:{r.code}:{r.tenant}" for r in refused}),
        "refused_after_kill": sum(1 for r in refused if r.sent_s > killed_s),
        "failed_in_flight_at_kill": len(failed_in_flight),
        "failed_streams_after_headers": sum(1 for r in failed if r.status == 200),
        "failed_not_in_flight_at_kill": len(failed) - len(failed_in_flight),
        "victim": args.victim,
        "leader_handover_s": None if handover_s is None else round(handover_s, 2),
        "rebalancer_interval_s": REBALANCER_INTERVAL_S,
        "killed_router_slots_at_kill": len(victim_slots),
        "killed_router_unanswered_at_kill": len(in_flight),
        "slots_per_router_at_kill": sorted(len(v) for v in by_pid.values()),
        "served_after_kill": sum(1 for r in served if r.sent_s > killed_s),
        "killed_at_s": round(killed_s, 2),
        "new_router_in_place": replaced,
        "routers_answering_after": len(alive),
        "dead_router_slots_left_at_end": int(rows_left),
        "dead_router_slots_free_after_s": None if slots_free_s is None else round(slots_free_s, 1),
        "dead_router_slot_rows_after_next_acquire": int(left_after[0][0]),
        "served_after_lease": sum(1 for r in beta.replies if r.status == 200 and r.complete),
        "slot_lease_s": args.slot_lease_s,
        "ledger_rows_for_served": sum(n for n, _ in ledger.values()),
        "ledger_missing": len(missing),
        "ledger_tokens_mismatch": len(tokens_off),
        "ledger_rows_status_200_total": int(ok_rows[0][0]),
        "client_tokens": sum(r.tokens for r in served),
        "ledger_tokens": sum(t for _, t in ledger.values()),
        "budget_buckets_end": [list(b) for b in buckets],
        "overspend": _overspend(spender, spent[0], args.replicas + len(replaced)),
    }
    _log(f"kill drill: {json.dumps(result)}")
    return result


def _overspend(spender: Load, spent: tuple[Any, ...], replicas: int) -> dict[str, Any]:
    """The budget-bound tenant's tokens (the ledger's, for its answered requests) against what
    its bucket could give from its first request to its last answer: full at the start
    (`tokens_per_minute`) plus the refill. The bar: over by at most one request's reservation
    (its prompt + `max_tokens`) per replica that served in the round (the killed one's
    replacement included)."""
    rows, tokens, max_prompt = int(spent[0]), int(spent[1] or 0), int(spent[2] or 0)
    served = [r for r in spender.replies if r.status == 200 and r.complete]
    if not served:
        return {"served": 0}
    start_s = min(r.sent_s for r in spender.replies)
    end_s = max(r.ended_s for r in served)
    allowed = SPENDER_TOKENS_PER_MINUTE * (1 + (end_s - start_s) / 60)
    reservation = max_prompt + MAX_TOKENS
    return {
        "tenant": SPENDER,
        "tokens_per_minute": SPENDER_TOKENS_PER_MINUTE,
        "requests": len(spender.replies),
        "served": len(served),
        "ledger_rows": rows,
        "refused": sorted(
            {f"{r.status}:{r.code}" for r in spender.replies if r.status in (429, 503)}
        ),
        "refused_count": sum(1 for r in spender.replies if r.status in (429, 503)),
        "failed": sum(1 for r in spender.replies if not r.complete and r.status not in (429, 503)),
        "window_s": round(end_s - start_s, 2),
        "ledger_tokens": tokens,
        "client_tokens": sum(r.tokens for r in served),
        "allowed_tokens": round(allowed, 1),
        "over_tokens": round(tokens - allowed, 1),
        "bound_tokens": replicas * reservation,
        "replicas": replicas,
        "within_bound": tokens - allowed <= replicas * reservation,
    }


def _server_processes(postmaster: int) -> list[int]:
    """The postmaster and its children (backends, WAL writer, ...): SIGSTOP them all and the
    server hangs: connections are accepted by the kernel and never answered."""
    found = [postmaster]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == postmaster:
                    found.append(int(entry.name))
    return found


def _p50(values: list[float]) -> float | None:
    return round(sorted(values)[len(values) // 2], 3) if values else None


# -- the outage drill -------------------------------------------------------------------------


async def outage_drill(
    args: argparse.Namespace,
    pg: Any,
    engines: list[str],
    folder: Path,
    policy: str,
    hang: bool = False,
) -> dict[str, Any]:
    kind = "hang" if hang else "stop"
    name, store = f"drill_outage_{policy}_{kind}", {"budgets_on_outage": policy}
    db, mark, router = _routers(args, pg, engines, folder, name, store)
    recovered: dict[str, float | None] = {"ledger_complete_after_s": None}
    try:
        await router.wait_ready_async(120)
        await _replicas(router.url, args.replicas)
        load = Load(router.url, workers_per_tenant=4, budget=None)
        task = asyncio.ensure_future(load.run())
        await asyncio.sleep(10)
        down_s = load.now()
        if hang:
            server = _server_processes(pg.process.pid)
            for pid in server:
                os.kill(pid, signal.SIGSTOP)
        else:
            await asyncio.to_thread(pg.stop)
        _log(f"outage drill ({policy}, {kind}): PostgreSQL down at {down_s:.1f} s")
        await asyncio.sleep(args.outage_s * 0.8)
        during = await _scrape_all(router.url, args.replicas)
        await asyncio.sleep(args.outage_s * 0.2)
        if hang:
            for pid in server:
                os.kill(pid, signal.SIGCONT)
        else:
            await asyncio.to_thread(pg.start)
        up_s = load.now()
        _log(f"outage drill ({policy}, {kind}): PostgreSQL back at {up_s:.1f} s")
        # the records of every response answered before the restart, in the database?
        owed = [r.request_id for r in load.replies if r.complete and r.request_id]
        while load.now() - up_s < 15:
            if len(await asyncio.to_thread(db.ledger, owed)) == len(owed):
                recovered["ledger_complete_after_s"] = round(load.now() - up_s, 1)
                break
            await asyncio.sleep(0.25)
        await asyncio.sleep(max(0.0, 15 - (load.now() - up_s)))
        load.stop.set()
        await task
        served = [r for r in load.replies if r.status == 200 and r.complete]
        ids = [r.request_id for r in served if r.request_id]
        ledger: dict[str, tuple[int, int]] = {}
        for _ in range(60):
            ledger = await asyncio.to_thread(db.ledger, ids)
            if len(ledger) == len(ids):
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(2)  # one more flush, so the gauges read what was written
        after = await _scrape_all(router.url, args.replicas)
    finally:
        _stop_router(router, mark)

    def phase(r: Reply) -> str:
        return "before" if r.sent_s < down_s else "during" if r.sent_s < up_s else "after"

    phases: dict[str, dict[str, int]] = {}
    for r in load.replies:
        key = "200" if r.status == 200 and r.complete else f"{r.status}:{r.code or r.error}"
        counts = phases.setdefault(phase(r), {})
        counts[key] = counts.get(key, 0) + 1
    refused = [r for r in load.replies if r.status == 503]
    last_503_s = max((r.ended_s for r in refused), default=None)
    result = {
        "policy": policy,
        "kind": kind,
        "outage_s": round(up_s - down_s, 1),
        "phases": phases,
        "refused_503_by_tenant": {t: sum(1 for r in refused if r.tenant == t) for t in TENANTS},
        "served_200": len(served),
        "served_200_during": sum(1 for r in served if phase(r) == "during"),
        "latency_p50_s": {
            p: _p50([r.ended_s - r.sent_s for r in served if phase(r) == p])
            for p in ("before", "during", "after")
        },
        "ledger_rows_for_served": sum(n for n, _ in ledger.values()),
        "ledger_missing": len(ids) - len(ledger),
        "client_tokens": sum(r.tokens for r in served),
        "ledger_tokens": sum(t for _, t in ledger.values()),
        **recovered,
        "last_503_after_restart_s": (None if last_503_s is None else round(last_503_s - up_s, 1)),
        "metrics_during": list(during.values()),
        "metrics_after": list(after.values()),
    }
    _log(f"outage drill ({policy}, {kind}): {json.dumps(result)}")
    return result


# -- main -------------------------------------------------------------------------------------


async def _drills(args: argparse.Namespace, pg: Any, folder: Path) -> dict[str, Any]:
    results: dict[str, Any] = {
        "replicas": args.replicas,
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg(),
    }
    async with contextlib.AsyncExitStack() as stack:
        if args.real_engines:
            engines = await stack.enter_async_context(_real_engines(2, folder / "engines"))
        else:
            engines = stack.enter_context(_engines(2))
        if "kill" in args.drills:
            results["kill"] = []
            for round_ in range(args.rounds):
                results["kill"].append(await kill_drill(args, pg, engines, folder, round_))
                results["load_after_kill"] = os.getloadavg()
        if "outage" in args.drills:
            for policy in ("open", "closed"):
                results[f"outage_{policy}"] = await outage_drill(args, pg, engines, folder, policy)
                results[f"load_after_outage_{policy}"] = os.getloadavg()
        if "hang" in args.drills:
            results["outage_open_hang"] = await outage_drill(
                args, pg, engines, folder, "open", hang=True
            )
    return results


def _spend_line(o: dict[str, Any]) -> str:
    if not o.get("served"):
        return "the budget-bound tenant was not served"
    return (
        f"{o['tenant']} spent {o['ledger_tokens']} tokens in {o['window_s']} s of a bucket that"
        f" could give {o['allowed_tokens']} (over by {o['over_tokens']}; bound"
        f" {o['bound_tokens']} = {o['replicas']} replicas x one reservation;"
        f" {o['served']} served, {o['refused_count']} refused {o['refused']})"
    )


def _summary(results: dict[str, Any]) -> None:
    print(
        f"replicas {results['replicas']}, {results['cpus']} CPUs, load at start "
        f"{results['load_before'][0]:.1f}"
    )
    for kill in results.get("kill", []):
        print(
            f"kill -9: {kill['requests']} requests, {kill['served_200']} served, {kill['failed']}"
            f" failed ({kill['failed_in_flight_at_kill']} in flight at the kill,"
            f" {kill['failed_not_in_flight_at_kill']} not; statuses {kill['failed_statuses']});"
            f" the killed router held {kill['killed_router_slots_at_kill']} slots"
            f" ({kill['killed_router_unanswered_at_kill']} unanswered) at the kill;"
            f" {kill['served_after_kill']} served after it; {kill['refused']} refused"
            f" {kill['refused_codes']}; new router {kill['new_router_in_place']};"
            f" its {kill['dead_router_slots_left_at_end']} slots free"
            f" {kill['dead_router_slots_free_after_s']} s after the kill (lease"
            f" {kill['slot_lease_s']} s), {kill['dead_router_slot_rows_after_next_acquire']} rows"
            f" left after the next acquires ({kill['served_after_lease']}/3 served);"
            f" ledger {kill['ledger_rows_for_served']} rows for"
            f" {kill['served_200']} served, {kill['ledger_missing']} missing,"
            f" tokens {kill['ledger_tokens']} vs clients' {kill['client_tokens']}"
            f"; budget: {_spend_line(kill['overspend'])}"
        )
        if kill.get("leader_handover_s") is not None:
            print(
                f"the leader killed: another router led {kill['leader_handover_s']} s later"
                f" (rebalancer interval {kill['rebalancer_interval_s']} s; bar: 2 intervals)"
            )
    for key in ("outage_open", "outage_closed", "outage_open_hang"):
        out = results.get(key)
        if out:
            print(
                f"outage {out['policy']}, {out['kind']} ({out['outage_s']} s):"
                f" {json.dumps(out['phases'])};"
                f" 503 by tenant {out['refused_503_by_tenant']}; ledger"
                f" {out['ledger_rows_for_served']} rows for {out['served_200']} served"
                f" ({out['ledger_missing']} missing), tokens {out['ledger_tokens']} vs"
                f" {out['client_tokens']}; complete {out['ledger_complete_after_s']} s after the"
                f" restart; last 503 {out['last_503_after_restart_s']} s after it;"
                f" p50 latency {out['latency_p50_s']}"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        epilog="Needs PostgreSQL's binaries (scripts/install.sh) and the tiny model"
        " (.gpupool/models/tiny).",
    )
    parser.add_argument(
        "--drills",
        default="kill,outage",
        help="kill, outage (stopped server), hang (SIGSTOPped server, policy open): any of them",
    )
    parser.add_argument("--replicas", type=int, default=3, help="router processes")
    parser.add_argument("--requests", type=int, default=300, help="requests of the kill drill")
    parser.add_argument("--rounds", type=int, default=1, help="kill drill rounds")
    parser.add_argument(
        "--victim",
        choices=("busiest", "leader"),
        default="busiest",
        help="the kill drill's router: the one holding the most slots, or the rebalancer's leader",
    )
    parser.add_argument("--slot-lease-s", type=float, default=5.0, help="store.slot_lease_s")
    parser.add_argument("--outage-s", type=float, default=30.0, help="PostgreSQL down this long")
    parser.add_argument(
        "--real-engines",
        action="store_true",
        help="two real CPU vLLM engines (the tiny dev model) instead of the fake ones",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    args.drills = set(args.drills.split(","))
    with tempfile.TemporaryDirectory() as tmp, _postgres().start_postgres() as pg:
        results = asyncio.run(_drills(args, pg, Path(tmp)))
    _summary(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
