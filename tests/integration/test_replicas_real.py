"""Issue 25's failure drills over real CPU engines: `gpupool serve --replicas 3` (three router
processes on one port) with a PostgreSQL store in front of the session's three real engines,
under mixed load: chat from two tenants (streamed and not), one of them on a tier of 4 requests
at once, and agent runs of several steps (tools, `x-gpupool-run-id`), every request on a new
connection, so the kernel spreads them, and a run's steps, over the routers.

- **kill -9 of one router mid-load** (SIGSTOP first, so its slots can be read as they are at
  the kill): every request that fails was in flight at the kill (sent before it, ended after)
  and fails as a broken connection or a cut stream, never with a router's answer; each of the
  killed router's slots whose request was never answered is one of those failures (no response
  header names the router, and a slot handed over keeps the id of the request that took it, so
  the failures are bounded from below by its slots and from the clients' timing, not matched
  one by one); every request answered in full has exactly one ledger row with the tokens the
  client was told, and the ledger's other answered rows are at most the failures (a record is
  committed before the last bytes, which may never come); each run's steps are numbered 0, 1,
  2, ... across the routers (a step that failed at the killed router may take a number); the
  dead router's slots are gone from the database after `store.slot_lease_s` while the load
  goes on.
- **PostgreSQL stopped and started mid-load** (`budgets_on_outage: open`): no request fails or
  is refused, before, during or after, and once the store is back the ledger holds every
  answered request once with its client's tokens: the totals equal the served tokens exactly.

Every expected value comes from what the clients saw. Nothing is timed: the drills wait on
conditions (enough answers, slots, ledger rows) with generous deadlines. The PostgreSQL server
is this module's own (tests/postgres.py; the outage stops it); each drill has a database and
routers of its own, stopped (with any process carrying the drill's mark) when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import secrets
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from benchmarks.replica_drills import Db, Reply, marked, send
from pools.launchers import InstanceSpec
from pools.testing.router_process import RouterProcess
from tests.integration.conftest import ENGINE_KEY_ENV, MAX_MODEL_LEN, MODEL_DIR
from tests.integration.test_governance_real import TOOLS  # one grep tool
from tests.postgres import PASSWORD, PostgresServer, start_postgres

pytestmark = pytest.mark.integration

REPLICAS = 3
DEADLINE_S = 60.0
SLOT_LEASE_S = 3.0  # the least the config allows
MAX_TOKENS = 8
STEPS = 4  # an agent run's steps
NARROW_LIMIT = 4  # the narrow tier's requests at once (its tenant sends 2 at a time)
PASSWORD_ENV = "GPUPOOL_REPLICAS_STORE_PASSWORD"
KEYS = {
    name: f"rep-{name}-" + secrets.token_hex(8) for name in ("chat", "narrow", "agent", "admin")
}
WORKERS = {"chat": 4, "narrow": 2, "agent": 3}  # agent: runs at once


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    """A server of this module's own: the outage drill stops and starts it."""
    with start_postgres() as server:
        yield server


def _config(folder: Path, engines: list[str], url: str) -> Path:
    def tenant(name: str, **limits: Any) -> dict[str, Any]:
        return {"name": name, "api_key_env": f"GPUPOOL_REPLICAS_{name.upper()}_KEY", **limits}

    config = {
        "model": {"name": "tiny", "path": str(MODEL_DIR), "max_model_len_tokens": MAX_MODEL_LEN},
        "engines": {
            "launcher": "static",
            "static": {"urls": engines, "api_key_env": ENGINE_KEY_ENV},
        },
        "pools": {
            "agent": {"classes": ["agent"], "share": {"initial_frac": 0.34}},
            "normal": {"classes": ["normal"], "share": {"initial_frac": 0.66}},
        },
        "router": {
            "scrape_interval_s": 0.5,
            "state_path": str(folder / "state.json"),
            "ledger_durable": True,
        },
        "store": {
            "url": url,
            "password_env": PASSWORD_ENV,
            "slot_lease_s": SLOT_LEASE_S,
            "connect_timeout_s": 1.0,  # an outage is declared after this
            "budgets_on_outage": "open",
        },
        "governance": {
            "tiers": {
                "wide": {"max_concurrent_runs": 100, "max_concurrent_requests": 100},
                "narrow": {"max_concurrent_runs": 100, "max_concurrent_requests": NARROW_LIMIT},
            }
        },
        "tenants": [
            tenant("chat", tier="wide", tokens_per_minute=50_000_000),
            tenant("narrow", tier="narrow"),
            tenant("agent", tier="wide", tokens_per_minute=50_000_000),
            tenant("admin", admin=True),
        ],
    }
    path = folder / "gpupool.json"
    path.write_text(json.dumps(config))
    return path


@contextlib.asynccontextmanager
async def replicas(
    postgres: PostgresServer, engines: list[InstanceSpec], folder: Path, database: str
) -> AsyncIterator[tuple[RouterProcess, Db]]:
    """`gpupool serve --replicas 3` on a fresh database, once every router answers; stopped
    (and any process left with the drill's mark killed) on the way out."""
    url = await asyncio.to_thread(postgres.create_database, database)
    mark = secrets.token_hex(8)
    env = {**os.environ, PASSWORD_ENV: PASSWORD, "GPUPOOL_DRILL_MARK": mark}
    env.update({f"GPUPOOL_REPLICAS_{name.upper()}_KEY": key for name, key in KEYS.items()})
    config = _config(folder, [e.url for e in engines], url)
    router = RouterProcess(
        config, folder / f"{database}.log", args=["--replicas", str(REPLICAS)], env=env
    )
    try:
        await router.wait_ready_async(DEADLINE_S)
        seen: set[str] = set()

        async def all_answer() -> bool:
            seen.add(await _replica(router.url))
            return len(seen) == REPLICAS

        await until(all_answer, "every router answering", router)
        yield router, Db(url, PASSWORD)
    finally:
        await router.stop_async()
        for pid in marked(mark):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def _replica(url: str) -> str:
    """The replica id of whichever router a new connection reaches."""
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.get(
            f"{url}/admin/pools", headers={"Authorization": f"Bearer {KEYS['admin']}"}
        )
        r.raise_for_status()
        replica: str = r.json()["rebalancer"]["leader"]["replica"]
        return replica


async def until(
    condition: Callable[[], Awaitable[bool] | bool], what: str, router: RouterProcess
) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        held = condition()
        if not isinstance(held, bool):
            held = await held
        if held:
            return
        assert time.monotonic() < deadline, f"not within {DEADLINE_S:g} s: {what}{router.tail(40)}"
        await asyncio.sleep(0.05)


# -- the load ---------------------------------------------------------------------------------


@dataclass
class Attempt:
    """One agent step as its client sent it: the run, the step's place in the client's
    history, and the reply."""

    run_id: str
    step: int
    reply: Reply


@dataclass
class Load:
    """Chat workers and agent runs on new connections until `stop` is set."""

    url: str
    started: float = field(default_factory=time.monotonic)
    replies: list[Reply] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def now(self) -> float:
        return time.monotonic() - self.started

    def answered(self, since_s: float = -1.0) -> int:
        return sum(1 for r in self.replies if r.complete and r.sent_s > since_s)

    async def run(self) -> None:
        connector = aiohttp.TCPConnector(force_close=True, limit=0)
        timeout = aiohttp.ClientTimeout(total=DEADLINE_S)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            workers = [
                self._chat(session, tenant, random.Random(f"{tenant}{n}"))
                for tenant in ("chat", "narrow")
                for n in range(WORKERS[tenant])
            ]
            workers += [self._agent(session, n) for n in range(WORKERS["agent"])]
            await asyncio.gather(*workers)

    async def _send(
        self,
        session: aiohttp.ClientSession,
        reply: Reply,
        body: dict[str, Any],
        headers: dict[str, str] | None = None,
    ) -> None:
        self.replies.append(reply)
        auth = {"Authorization": f"Bearer {KEYS[reply.tenant]}", **(headers or {})}
        await send(session, self.url, reply, body, auth)
        reply.ended_s = self.now()
        if not reply.complete:
            await asyncio.sleep(0.1)  # a refusal or a failure: back off a little, as a client

    async def _chat(self, session: aiohttp.ClientSession, tenant: str, rng: random.Random) -> None:
        while not self.stop.is_set():
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"{tenant} question {rng.random()}"}],
                "max_tokens": rng.randint(2, MAX_TOKENS),
            }
            reply = Reply(tenant=tenant, stream=rng.random() < 0.5, sent_s=self.now())
            await self._send(session, reply, body)

    async def _agent(self, session: aiohttp.ClientSession, worker: int) -> None:
        """Runs of `STEPS` steps, one after another; a step not answered is sent again (an
        agent retries), with the same history. Worker 0 is a coding agent's session
        (`x-session-id`, as Claude Code and Codex name theirs): each run a task, a new user
        message, so the session's n-th task is its run `<session>:<n>` on every router
        (its `run_id` here: `<session>:<n>`, what the ledger should record)."""
        rng = random.Random(f"agent{worker}")
        agent_session = f"session-{worker}-{secrets.token_hex(4)}" if worker == 0 else None
        for number in itertools.count():
            run_id = f"run-{worker}-{number}-{secrets.token_hex(4)}"
            if agent_session is not None:
                run_id = f"{agent_session}:{number + 1}"
            names = (
                {"x-gpupool-run-id": run_id}
                if agent_session is None
                else {"x-session-id": agent_session}
            )
            history: list[dict[str, Any]] = [
                {"role": "user", "content": f"fix the bug in module {worker}.{number}"}
            ]
            for step in range(STEPS):
                stream = rng.random() < 0.5
                while True:
                    if self.stop.is_set():
                        return
                    reply = Reply(tenant="agent", stream=stream, sent_s=self.now())
                    self.attempts.append(Attempt(run_id, step, reply))
                    body = {
                        "model": "tiny",
                        "messages": history,
                        "tools": TOOLS,
                        "max_tokens": rng.randint(2, MAX_TOKENS),
                    }
                    await self._send(session, reply, body, names)
                    if reply.complete:
                        break
                call_id = f"call-{step}"
                history = [
                    *history,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": call_id,
                                "type": "function",
                                "function": {
                                    "name": "grep",
                                    "arguments": json.dumps({"q": f"step {step} of {run_id}"}),
                                },
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": call_id, "content": f"match {step}"},
                ]


def _request_slots(holders: list[str]) -> dict[int, set[str]]:
    """Router pid -> the request ids it holds slots for (`host:pid:random:<request id>`; a
    run's slot, `...:run:<run id>`, is left out)."""
    by_pid: dict[int, set[str]] = {}
    for holder in holders:
        parts = holder.split(":")
        if len(parts) >= 4 and parts[-2] != "run":
            by_pid.setdefault(int(parts[1]), set()).add(parts[-1])
    return by_pid


async def _ledger(db: Db, load: Load, router: RouterProcess) -> dict[str, tuple[int, int]]:
    """Request id -> (rows, tokens) for every request answered in full, once all are there."""
    ids = [r.request_id for r in load.replies if r.complete and r.request_id]
    assert len(ids) == load.answered(), "an answer without x-gpupool-request-id"
    found: dict[str, tuple[int, int]] = {}

    async def all_written() -> bool:
        found.update(await asyncio.to_thread(db.ledger, ids))
        return len(found) == len(ids)

    await until(all_written, f"ledger rows for all {len(ids)} answered requests", router)
    return found


def _check_ledger(ledger: dict[str, tuple[int, int]], load: Load) -> None:
    answered = [r for r in load.replies if r.complete]
    wrong = [
        (r.request_id, ledger[str(r.request_id)], r.tokens)
        for r in answered
        if ledger[str(r.request_id)] != (1, r.tokens)
    ]
    assert not wrong, f"(request, (rows, tokens), client's tokens): {wrong}"


# -- kill -9 of one router mid-load ------------------------------------------------------------


async def test_kill_9_of_one_of_three_routers_under_mixed_load(
    postgres: PostgresServer, real_engines: list[InstanceSpec], tmp_path: Path
) -> None:
    async with replicas(postgres, real_engines, tmp_path, "replicas_kill") as (router, db):
        load = Load(router.url)
        task = asyncio.ensure_future(load.run())
        try:
            victim, stopped_s, killed_s, at_kill = await _kill_one(load, db, router)
            # the port keeps serving, and the dead router's slots (requests' and runs') go
            # once their lease has passed, at each tenant's next acquire, while the load runs
            await until(lambda: load.answered(since_s=killed_s) >= 15, "served after", router)

            async def released() -> bool:
                holders = await asyncio.to_thread(db.slots)
                return not [h for h in holders if h.split(":")[1] == str(victim)]

            await until(released, "the killed router's slots released", router)
        finally:
            load.stop.set()
            await asyncio.wait_for(task, DEADLINE_S)
        ledger = await _ledger(db, load, router)
        extra = await asyncio.to_thread(
            db.query, "SELECT request_id FROM requests WHERE status_code = 200"
        )
        numbered = await asyncio.to_thread(
            db.query,
            "SELECT request_id, step_index, run_id FROM requests WHERE run_id IS NOT NULL",
        )
        steps = {request_id: step for request_id, step, _ in numbered}
        recorded_runs = {request_id: run_id for request_id, _, run_id in numbered}

    # what failed: the killed router's requests in flight at the kill, nothing else
    answered_ids = {r.request_id for r in load.replies if r.complete}
    refused = [
        r
        for r in load.replies
        if r.status == 429 and r.code == "tenant_concurrency" and r.tenant == "narrow"
    ]
    failed = [r for r in load.replies if not r.complete and r not in refused]
    assert failed, "no request failed: the kill found none in flight"
    not_in_flight = [
        (r.tenant, r.stream, r.sent_s, r.ended_s, r.status, r.error)
        for r in failed
        if not (r.sent_s < stopped_s and r.ended_s >= killed_s - 0.001)
    ]
    assert not not_in_flight, f"failed, not in flight at the kill ({killed_s:.3f}): {not_in_flight}"
    assert not [r for r in failed if r.status not in (0, 200)], "a failure answered by a router"
    # each of its slots (held by a request id) whose request was never answered is a failure;
    # a slot handed over from an answered request to the next one keeps the first one's id
    unanswered = at_kill - answered_ids
    assert unanswered, "the killed router held no request that was not answered"
    assert len(failed) >= len(unanswered), (len(failed), sorted(unanswered))
    # the tier at its limit refuses while the dead router's slots count (the lease): after it
    assert not [r for r in refused if r.sent_s < stopped_s], "refused before the kill"

    # the ledger: one row per answer, the client's tokens; other answered rows only for the
    # killed router's requests (committed before their last bytes, which never came)
    _check_ledger(ledger, load)
    others = {row[0] for row in extra} - answered_ids
    assert len(others) <= len(failed), sorted(others)
    # each run's steps numbered in the order its client sent them, whichever router took them
    runs: dict[str, list[Attempt]] = {}
    for attempt in load.attempts:
        runs.setdefault(attempt.run_id, []).append(attempt)
    assert sum(1 for a in runs.values() if sum(x.reply.complete for x in a) >= 2) >= 3
    for run_id, attempts in runs.items():
        numbers = [
            (n, steps[a.reply.request_id]) for n, a in enumerate(attempts) if a.reply.complete
        ]
        place = [sum(1 for a in attempts[:n] if a.reply.complete) for n, _ in numbers]
        # a step took number k at the earliest after its k answered steps before it, and at the
        # latest after every attempt before it (one that failed at the killed router may have
        # taken one); without failures: 0, 1, 2, ...
        assert all(p <= step <= n for (n, step), p in zip(numbers, place, strict=True)), (
            run_id,
            numbers,
        )
        assert [s for _, s in numbers] == sorted({s for _, s in numbers}), (run_id, numbers)
        # the session's task: one run, the session's n-th, whichever routers took its steps
        recorded = {recorded_runs[a.reply.request_id] for a in attempts if a.reply.complete}
        assert recorded == {run_id}, (run_id, recorded)
    assert any(":" in run_id for run_id in runs), "no session task was served"
    print(
        f"[drill] kill -9: {len(load.replies)} requests, {len(answered_ids)} answered,"
        f" {len(failed)} failed (in flight at the kill), {len(refused)} refused after it;"
        f" the killed router held {len(at_kill)} request slots ({len(unanswered)} never"
        f" answered); {len(others)} answered rows for failed requests; {len(runs)} runs;"
        " failures (tenant, stream, status, error, sent ms before the stop): "
        + str(
            [
                (r.tenant, r.stream, r.status, r.error, round(1000 * (stopped_s - r.sent_s)))
                for r in failed
            ]
        )
    )


async def _kill_one(
    load: Load, db: Db, router: RouterProcess
) -> tuple[int, float, float, set[str]]:
    """Once 12 requests were answered, the router with at least two requests not yet answered
    is stopped (SIGSTOP: it takes nothing more), its request slots read, and killed (SIGKILL).
    Returns its pid, the load's clock when it was stopped and when killed, and the request ids
    it held slots for."""
    victim = 0

    async def one_busy() -> bool:
        nonlocal victim
        if load.answered() < 12:
            return False
        by_pid = _request_slots(await asyncio.to_thread(db.slots))
        answered = {r.request_id for r in load.replies if r.complete}  # after the read
        busy = {pid: len(ids - answered) for pid, ids in by_pid.items()}
        victim = max(busy, key=lambda pid: busy[pid], default=0)
        return busy.get(victim, 0) >= 2

    await until(one_busy, "a router with two requests in flight", router)
    os.kill(victim, signal.SIGSTOP)
    stopped_s = load.now()
    try:
        at_kill = _request_slots(await asyncio.to_thread(db.slots)).get(victim, set())
    finally:
        killed_s = load.now()
        os.kill(victim, signal.SIGKILL)
    return victim, stopped_s, killed_s, at_kill


# -- PostgreSQL stopped and started mid-load ---------------------------------------------------


async def test_postgres_stopped_and_started_under_mixed_load(
    postgres: PostgresServer, real_engines: list[InstanceSpec], tmp_path: Path
) -> None:
    async with replicas(postgres, real_engines, tmp_path, "replicas_outage") as (router, db):
        load = Load(router.url)
        task = asyncio.ensure_future(load.run())
        try:
            await until(lambda: load.answered() >= 10, "answers before the outage", router)
            await asyncio.to_thread(postgres.stop)
            down_s = load.now()
            try:
                # requests sent while the store is down, answered: the outage is declared
                # (connect_timeout_s) and each response waits COMMIT_WAIT_S for its commit
                await until(lambda: load.answered(since_s=down_s) >= 10, "during", router)
            finally:
                await asyncio.to_thread(postgres.start)
            up_s = load.now()
            await until(lambda: load.answered(since_s=up_s) >= 10, "answers after", router)
        finally:
            load.stop.set()
            await asyncio.wait_for(task, DEADLINE_S)
        assert [r for r in load.replies if r.sent_s > down_s and r.ended_s < up_s]
        not_answered = [
            (r.tenant, r.sent_s, r.ended_s, r.status, r.code, r.error)
            for r in load.replies
            if not r.complete
        ]
        assert not not_answered, f"outage {down_s:.2f}-{up_s:.2f} s: {not_answered}"
        ledger = await _ledger(db, load, router)
        rows = await asyncio.to_thread(
            db.query,
            "SELECT COUNT(*), CAST(SUM(prompt_tokens + completion_tokens) AS BIGINT)"
            " FROM requests WHERE status_code = 200",
        )
        numbered = await asyncio.to_thread(
            db.query,
            "SELECT run_id, COUNT(*) - COUNT(DISTINCT step_index) FROM requests"
            " WHERE run_id IS NOT NULL GROUP BY run_id",
        )
    _check_ledger(ledger, load)
    served = [r for r in load.replies if r.complete]
    assert (int(rows[0][0]), int(rows[0][1])) == (len(served), sum(r.tokens for r in served))
    during = sum(1 for r in served if down_s < r.sent_s < up_s)
    print(
        f"[drill] outage: {len(served)} answered, all of them, {during} sent while PostgreSQL"
        f" was down ({up_s - down_s:.1f} s); ledger {rows[0][0]} rows, {rows[0][1]} tokens;"
        # documented (docs/replicas.md, Step numbers): numbered from each replica's memory
        f" runs with a step number taken twice: {sum(1 for _, d in numbered if d)}"
        f" of {len(numbered)}"
    )


async def test_a_responses_follow_up_continues_on_another_router(
    postgres: PostgresServer, real_engines: list[InstanceSpec], tmp_path: Path
) -> None:
    """Two `gpupool serve` processes on two ports sharing one database (so the test picks
    which router answers): a stored response made through router a, its follow-up
    (`previous_response_id`, streamed) sent to router b as soon as a's response ended, and
    the follow-up's follow-up back through a: each goes to the engine that stored the
    previous one, and vLLM continues it (it would answer 404 elsewhere: gpupool's 400), its
    prompt the whole conversation so far."""
    url = await asyncio.to_thread(postgres.create_database, "replicas_responses")
    env = {**os.environ, PASSWORD_ENV: PASSWORD}
    env.update({f"GPUPOOL_REPLICAS_{name.upper()}_KEY": key for name, key in KEYS.items()})
    routers = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        config = _config(tmp_path / name, [e.url for e in real_engines], url)
        routers.append(RouterProcess(config, tmp_path / f"{name}.log", env=env))
    a, b = routers
    try:
        for router in routers:
            await router.wait_ready_async(DEADLINE_S)
        auth = {"Authorization": f"Bearer {KEYS['chat']}"}
        body = {"model": "tiny", "max_output_tokens": MAX_TOKENS}
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            first = await client.post(
                f"{a.url}/v1/responses", json={**body, "input": "Say hello."}, headers=auth
            )
            assert first.status_code == 200, first.text + a.tail(40)
            home = first.headers["x-gpupool-instance"]
            usage = first.json()["usage"]
            so_far = usage["input_tokens"] + usage["output_tokens"]
            second = await client.post(
                f"{b.url}/v1/responses",
                json={
                    **body,
                    "input": "Go on.",
                    "previous_response_id": first.json()["id"],
                    "stream": True,
                },
                headers=auth,
            )
            assert second.status_code == 200, second.text + b.tail(40)
            assert second.headers["x-gpupool-instance"] == home
            events = [
                json.loads(line[6:])
                for line in second.text.splitlines()
                if line.startswith("data: ")
            ]
            assert events[-1]["type"] == "response.completed", events[-1]
            streamed = events[-1]["response"]
            assert streamed["usage"]["input_tokens"] > so_far  # the stored conversation too
            third = await client.post(
                f"{a.url}/v1/responses",
                json={**body, "input": "And then?", "previous_response_id": streamed["id"]},
                headers=auth,
            )
            assert third.status_code == 200, third.text + a.tail(40)
            assert third.headers["x-gpupool-instance"] == home
            so_far = streamed["usage"]["input_tokens"] + streamed["usage"]["output_tokens"]
            assert third.json()["usage"]["input_tokens"] > so_far
    finally:
        for router in routers:
            await router.stop_async()
