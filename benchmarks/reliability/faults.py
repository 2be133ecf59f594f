"""Fault scenarios on real CPU vLLM engines under load.

One implementation, two callers: `tests/integration/test_faults_real.py` runs each scenario
with about 20 concurrent streams and asserts on the result; `benchmarks/reliability/run.py`
runs them with heavier load and writes the numbers to a report. Each scenario starts its own
`gpupool serve` (or `gpupool up`) as a subprocess, drives streaming chat requests through it
with aiohttp, injects one fault and returns a JSON-ready dict of what happened: requests sent,
served, failed by kind, times to leave and rejoin rotation, ledger records lost.

The scenarios:

- `engine_kill`: `kill -9` of a normal-pool engine while its streams run and more requests
  wait in the router's queue. Streams on it end with an OpenAI-shaped error event; requests
  not yet started there are served elsewhere; the launcher restarts the engine and the router
  sends it traffic again.
- `engine_freeze`: `SIGSTOP` of an engine. Its requests end at their deadline
  (`x-gpupool-deadline-ms`), it leaves rotation (failed scrapes), the rest is served, and after
  `SIGCONT` it is back and the engine holds no leftover sequence.
- `slow_metrics`: a TCP proxy in front of each engine delays one engine's `/metrics` beyond
  `router.stale_after_s` (the scrape still succeeds). Stale telemetry counts as full: nothing
  is dispatched to that engine while its last reading is stale.
- `router_kill`: `kill -9` of `gpupool serve` under load. The ledger loses at most the records
  of the last flush interval; the engines drop the dead router's sequences; the next start
  serves and a run's step numbering continues after the last stored step.
- `graceful_stop`: `SIGTERM` to `gpupool serve` or `gpupool up` with streams in flight. New
  connections are refused at once, in-flight streams finish within the grace period, every
  finished request is in the ledger, then (`up`) the engines stop.

Load: the router is told the engines take `slots` sequences each (it reads the engines'
`--max-num-seqs` from `engines.local.vllm_args`, the operating point's ceiling; the engines
themselves may take more), so `streams` requests fill the normal pool and the rest wait in
its queue. Requests are `ignore_eos` chat completions with a fixed `max_tokens`, so a request
was served in full exactly when its usage says `max_tokens` completion tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import psutil
import yaml

from pools.config import RouterConfig, default_of
from pools.launchers import InstanceSpec, LocalLauncher
from pools.testing import router_process
from pools.testing.router_process import free_port

__all__ = [
    "DelayProxy",
    "EngineControl",
    "Load",
    "Reply",
    "RouterProcess",
    "Setup",
    "engine_freeze",
    "engine_kill",
    "graceful_stop",
    "router_kill",
    "slow_metrics",
]

JsonDict = dict[str, Any]


class EngineControl(Protocol):
    """The engines a scenario faults: `instances[i]` is `engine-i` in the router's config, the
    launcher restarts one that dies, `kill` signals one's process group."""

    @property
    def instances(self) -> list[InstanceSpec]: ...

    @property
    def launcher(self) -> LocalLauncher: ...

    def kill(self, index: int, sig: int = signal.SIGKILL) -> int: ...


@dataclass(frozen=True)
class Load:
    """The load of one scenario: `streams` concurrent streams and `plain` non-streaming
    requests fill the normal pool (`slots` per engine, two engines), `queued` more wait in its
    queue, `later` more are sent after the fault, `max_tokens` each."""

    streams: int = 20
    queued: int = 10
    later: int = 10
    max_tokens: int = 300
    slots: int = 12
    plain: int = 4
    later_interval_s: float = 0.2

    async def fill(
        self, traffic: Traffic, prefix: str, headers: dict[str, str] | None = None
    ) -> None:
        """Fire the streams; once the router has them, the plain requests (the picker spreads
        them over the engines' free slots, so each engine gets some); once it has those too,
        the queued ones, and return when the router holds every request (on an engine or in
        its queue) that has not already ended."""
        for i in range(self.streams):
            traffic.fire(f"{prefix}{i}", max_tokens=self.max_tokens, headers=headers)
        await _held(traffic, "the streams", full_is_enough=True)
        for i in range(self.plain):
            traffic.fire(f"{prefix}p{i}", max_tokens=self.max_tokens, stream=False, headers=headers)
        await _held(traffic, "the plain requests", full_is_enough=True)
        for i in range(self.queued):
            traffic.fire(f"{prefix}q{i}", max_tokens=self.max_tokens, headers=headers)
        await _held(traffic, "the queued requests", full_is_enough=False)


async def _held(traffic: Traffic, what: str, *, full_is_enough: bool) -> None:
    """Wait until the router holds every request fired so far that has not ended: leased to an
    engine or waiting in a queue (`full_is_enough`: or some wait, i.e. the pool is full)."""
    last: JsonDict = {}

    async def held() -> bool:
        view = await admin_view(traffic.session, traffic.url)
        leases = sum(int(i["inflight"]) for i in view["instances"].values())
        queued = sum(int(p["queue"]["depth"]) for p in view["pools"].values())
        open_ = sum(1 for r in traffic.replies if r.ended_at is None)
        last.update(leases=leases, queued=queued, open=open_, **tally(traffic.replies))
        return leases + queued >= open_ or (full_is_enough and queued > 0)

    try:
        await until(held, 60, f"the router holding {what}", 0.05)
    except TimeoutError as err:
        raise TimeoutError(f"{err}: {last}") from None


@dataclass(frozen=True)
class Setup:
    """Where a scenario runs: the engines, a scratch folder, the dev model and the name of the
    env var holding the engines' key (the routers started here read it)."""

    engines: EngineControl
    work: Path
    model_dir: Path
    key_env: str
    say: Callable[[str], None] = lambda _m: None


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


@dataclass
class Reply:
    """What a client saw of one request (times: this process's `time.monotonic()`)."""

    tag: str
    max_tokens: int
    stream: bool
    sent_at: float
    headers_at: float | None = None  # response head received
    first_token_at: float | None = None
    ended_at: float | None = None
    status: int | None = None
    instance: str | None = None
    request_id: str | None = None
    content_events: int = 0
    done: bool = False  # `data: [DONE]` seen
    completion_tokens: int | None = None
    error: JsonDict | None = None  # an error event, or the error body of a non-200
    exception: str | None = None  # the connection failed

    @property
    def kind(self) -> str:
        """ok, or how it failed: connection_error, http_<status>_<code>,
        error_event_<code>, truncated (no [DONE], no error), short (fewer tokens)."""
        if self.exception is not None:
            return "connection_error"
        if self.status != 200:
            return f"http_{self.status}_{(self.error or {}).get('code')}"
        if self.error is not None:
            return f"error_event_{self.error.get('code')}"
        if self.stream and not self.done:
            return "truncated"
        if self.completion_tokens != self.max_tokens:
            return "short"
        return "ok"

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    @property
    def refused(self) -> bool:
        """Refused by admission with a 429 (retryable, Retry-After): not lost, not served."""
        return self.status == 429

    @property
    def lost(self) -> bool:
        """Neither served nor refused with a 429."""
        return not self.ok and not self.refused

    @property
    def openai_error(self) -> bool:
        """The failure came in OpenAI's error shape (message, type, code)."""
        e = self.error
        return (
            isinstance(e, dict)
            and isinstance(e.get("message"), str)
            and isinstance(e.get("type"), str)
            and isinstance(e.get("code"), str)
        )

    def duration_s(self) -> float:
        return (self.ended_at or time.monotonic()) - self.sent_at


def _body(tag: str, max_tokens: int, stream: bool) -> JsonDict:
    body: JsonDict = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"fault scenario request {tag}: go on"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def send(
    session: aiohttp.ClientSession,
    url: str,
    tag: str,
    *,
    max_tokens: int,
    stream: bool = True,
    headers: dict[str, str] | None = None,
    timeout_s: float = 180.0,
    reply: Reply | None = None,
) -> Reply:
    """One chat completion through the router at `url`; never raises for a failure."""
    if reply is None:
        reply = Reply(tag, max_tokens, stream, time.monotonic())
    try:
        async with session.post(
            f"{url}/v1/chat/completions",
            json=_body(tag, max_tokens, stream),
            headers=headers or {},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            reply.headers_at = time.monotonic()
            reply.status = resp.status
            reply.instance = resp.headers.get("x-gpupool-instance")
            reply.request_id = resp.headers.get("x-gpupool-request-id")
            if resp.status != 200 or not stream:
                _read_json(reply, await resp.read())
                return reply
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    reply.done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    reply.error = event["error"]
                    continue
                if event.get("usage"):
                    reply.completion_tokens = event["usage"].get("completion_tokens")
                for choice in event.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        reply.content_events += 1
                        if reply.first_token_at is None:
                            reply.first_token_at = time.monotonic()
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as err:
        reply.exception = f"{type(err).__name__}: {err}"
    finally:
        reply.ended_at = time.monotonic()
    return reply


async def closed_loop(
    session: aiohttp.ClientSession,
    url: str,
    tag: str,
    stop: asyncio.Event,
    into: list[Reply],
    *,
    max_tokens: int,
    headers: dict[str, str] | None = None,
    stop_on_exception: bool = False,
) -> None:
    """One closed-loop client: `send` one request after another (tagged `tag-0`, `tag-1`, ...)
    into `into` until `stop` is set, or (`stop_on_exception`) until one fails without an
    answer (the router is gone)."""
    n = 0
    while not stop.is_set():
        reply = await send(session, url, f"{tag}-{n}", max_tokens=max_tokens, headers=headers)
        into.append(reply)
        n += 1
        if stop_on_exception and reply.exception:
            return


def _read_json(reply: Reply, raw: bytes) -> None:
    try:
        data = json.loads(raw)
    except ValueError:
        reply.error = {"message": raw[:200].decode("utf-8", "replace")}
        return
    if not isinstance(data, dict):
        return
    if isinstance(data.get("error"), dict):
        reply.error = data["error"]
    usage = data.get("usage")
    if isinstance(usage, dict):
        reply.completion_tokens = usage.get("completion_tokens")


class Traffic:
    """Requests fired as tasks; `replies` fills as they are sent."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session = session
        self.url = url
        self.replies: list[Reply] = []
        self._tasks: list[asyncio.Task[Reply]] = []

    def fire(
        self,
        tag: str,
        *,
        max_tokens: int,
        stream: bool = True,
        headers: dict[str, str] | None = None,
        timeout_s: float = 180.0,
    ) -> Reply:
        reply = Reply(tag, max_tokens, stream, time.monotonic())
        self.replies.append(reply)
        self._tasks.append(
            asyncio.ensure_future(
                send(
                    self.session,
                    self.url,
                    tag,
                    max_tokens=max_tokens,
                    stream=stream,
                    headers=headers,
                    timeout_s=timeout_s,
                    reply=reply,
                )
            )
        )
        return reply

    async def wait(self, timeout_s: float = 240.0) -> None:
        if self._tasks:
            await asyncio.wait_for(asyncio.gather(*self._tasks), timeout_s)


def tally(replies: Iterable[Reply]) -> JsonDict:
    """sent, served (ok), failures by kind, and one example of each kind (what the client saw,
    how long after sending)."""
    kinds: dict[str, int] = {}
    examples: dict[str, str] = {}
    sent = 0
    for r in replies:
        sent += 1
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
        if r.kind != "ok" and r.kind not in examples:
            what = r.exception or str((r.error or {}).get("message", ""))[:160]
            examples[r.kind] = f"{r.tag} on {r.instance} after {r.duration_s():.2f} s: {what}"
    served = kinds.pop("ok", 0)
    return {
        "sent": sent,
        "served": served,
        "failed": sum(kinds.values()),
        "failed_by_kind": kinds,
        "examples": examples,
    }


# Shorter than uvicorn's 5 s keep-alive: the load client never reuses a connection the router
# is closing just then (a race every HTTP/1.1 client has; aiohttp does not retry a POST).
CLIENT_KEEPALIVE_S = 2.0


def client_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)
    )


# ---------------------------------------------------------------------------------------------
# The router under test, and what to ask it
# ---------------------------------------------------------------------------------------------


class RouterProcess:
    """`gpupool serve|up --config ... --port ...` as a child process, its output in `log`
    (`pools.testing.router_process.RouterProcess`, with this harness's async waits)."""

    def __init__(self, command: str, config: Path, log: Path, *, port: int | None = None) -> None:
        self._router = router_process.RouterProcess(config, log, command=command, port=port)
        self.command = command
        self.port = self._router.port
        self.url = self._router.url
        self.log = log
        self.proc = self._router.proc

    async def wait_ready(self, timeout_s: float = 90.0) -> float:
        """Seconds until `/ready` answers 200; raises if the router exits or never is."""
        try:
            return await self._router.wait_ready_async(timeout_s)
        except AssertionError as err:
            raise RuntimeError(str(err)) from None

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    async def wait_exit(self, timeout_s: float) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(self.proc.wait, timeout_s)
        return self.proc.poll()

    async def stop(self) -> None:
        await self._router.stop_async(grace_s=60)

    def tail(self, lines: int = 30) -> str:
        return self._router.tail(lines)


def router_config(
    setup: Setup,
    urls: list[str],
    name: str,
    *,
    slots: int,
    router: JsonDict | None = None,
    engines: JsonDict | None = None,
) -> Path:
    """A router config over `urls` (static engines; `engines` replaces that section), its
    ledger and state in `setup.work / name`. Both pools take long SLOs and deadlines, and
    runs have no guards: the faults, not the SLOs or governance, decide what fails."""
    folder = setup.work / name
    folder.mkdir(parents=True, exist_ok=True)
    slo = {"ttft_p95_ms": 10000, "tpot_p95_ms": 500}
    queue = {"max_depth": 1024, "max_wait_s": 60}
    config: JsonDict = {
        "model": {"name": "tiny", "path": str(setup.model_dir), "max_model_len_tokens": 4096},
        "engines": engines
        or {
            "launcher": "static",
            "static": {"urls": urls, "api_key_env": setup.key_env},
            "local": {"vllm_args": ["--max-num-seqs", str(slots)]},
        },
        "pools": {
            "agent": {
                "classes": ["agent"],
                "share": {"initial_frac": 0.34},
                "slo": slo,
                "queue": queue,
            },
            "normal": {
                "classes": ["normal"],
                "share": {"initial_frac": 0.66},
                "slo": slo,
                "queue": queue,
            },
        },
        # no run guards either (the router_kill run steps past the default 50 on a fast CPU)
        "classes": {
            name: {
                "timeout_s": 300,
                "run_guards": {"max_steps": None, "max_duration_s": None, "loop_repeats": 0},
            }
            for name in ("agent", "normal")
        },
        "router": {
            "scrape_interval_s": 0.5,
            "scrape_timeout_s": 1.0,
            "stale_after_s": 2.0,
            "connect_timeout_s": 1.0,
            "ledger_path": str(folder / "ledger.sqlite"),
            "state_path": str(folder / "state.json"),
            **(router or {}),
        },
    }
    path = folder / "gpupool.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def admin_view(session: aiohttp.ClientSession, url: str) -> JsonDict:
    async with session.get(f"{url}/admin/pools", timeout=aiohttp.ClientTimeout(total=5)) as r:
        view: JsonDict = await r.json()
        return view


async def router_metric(
    session: aiohttp.ClientSession, url: str, name: str, **labels: str
) -> float:
    async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


async def engine_sequences(session: aiohttp.ClientSession, engine_url: str) -> float:
    """Running + waiting sequences the engine itself reports (`/metrics` needs no key)."""
    async with session.get(f"{engine_url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            total += float(line.rpartition(" ")[2])
    return total


async def until(
    cond: Callable[[], Awaitable[bool]] | Callable[[], bool],
    timeout_s: float,
    what: str,
    interval_s: float = 0.1,
) -> float:
    """Seconds until `cond()` holds; raises `TimeoutError` naming `what`."""
    started = time.monotonic()
    while True:
        value = cond()
        if not isinstance(value, bool):
            value = await value
        if value:
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(interval_s)


async def engine_healthy(session: aiohttp.ClientSession, engine_url: str) -> bool:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
        async with session.get(
            f"{engine_url}/health", timeout=aiohttp.ClientTimeout(total=2)
        ) as resp:
            return resp.status == 200
    return False


async def instance_healthy(session: aiohttp.ClientSession, url: str, instance: str) -> bool:
    view = await admin_view(session, url)
    return bool(view["instances"][instance]["healthy"])


async def router_idle(session: aiohttp.ClientSession, url: str) -> bool:
    """No lease and no reserved KV block left on any instance, no request queued."""
    view = await admin_view(session, url)
    return all(
        i["inflight"] == 0 and i["kv_reserved_blocks"] == 0 for i in view["instances"].values()
    ) and all(p["queue"]["depth"] == 0 for p in view["pools"].values())


async def probe_until_served_by(
    session: aiohttp.ClientSession, url: str, instance: str, *, attempts: int = 40
) -> tuple[int, list[Reply]]:
    """Send short requests one at a time until one is served by `instance`; returns how many
    it took (0: none was) and the replies."""
    replies = []
    for i in range(attempts):
        reply = await send(session, url, f"probe-{i}", max_tokens=4, stream=False)
        replies.append(reply)
        if reply.ok and reply.instance == instance:
            return i + 1, replies
    return 0, replies


def retried_request_ids(log: Path) -> set[str]:
    """Request ids the router retried on another instance after a failure before the engine
    answered (its info log: `gp-...: engine-N failed before answering (...); retrying`)."""
    out = set()
    for line in log.read_text(errors="replace").splitlines():
        if "failed before answering" in line:
            for word in line.split():
                if word.startswith("gp-"):
                    out.add(word.rstrip(":"))
    return out


def _normal_instances(view: JsonDict) -> list[str]:
    return sorted(view["pools"]["normal"]["instances"])


def _index(instance_id: str) -> int:
    return int(instance_id.rsplit("-", 1)[1])


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


# ---------------------------------------------------------------------------------------------
# 1. kill -9 of an engine
# ---------------------------------------------------------------------------------------------


async def engine_kill(setup: Setup, load: Load, *, restart_timeout_s: float = 240) -> JsonDict:
    """`kill -9` of a normal-pool engine with `load.streams` streams running (half on it) and
    `load.queued` waiting; `load.later` more are sent after the kill. Then the launcher's
    restart and the router's readmission are timed."""
    engines = setup.engines
    config = router_config(
        setup, [e.url for e in engines.instances], "engine-kill", slots=load.slots
    )
    router = RouterProcess("serve", config, setup.work / "engine-kill" / "router.log")
    try:
        await router.wait_ready()
        async with client_session() as session:
            view = await admin_view(session, router.url)
            victim, *survivors = _normal_instances(view)
            index = _index(victim)
            engine_url = engines.instances[index].url
            restarts_before = engines.launcher.engines[index].restarts
            traffic = Traffic(session, router.url)
            await load.fill(traffic, "k")
            started_on_victim = min(load.slots, load.streams // 2) // 2 or 1
            await until(
                lambda: (
                    sum(1 for r in traffic.replies if r.instance == victim and r.content_events)
                    >= started_on_victim
                ),
                60,
                "streams running on the victim",
                0.02,
            )
            old_pid = engines.kill(index, signal.SIGKILL)
            killed_at = time.monotonic()
            setup.say(f"engine-kill: killed {victim} (pid {old_pid})")
            for i in range(load.later):
                traffic.fire(f"k-later{i}", max_tokens=load.max_tokens)
                await asyncio.sleep(load.later_interval_s)
            await traffic.wait()
            served_at = time.monotonic()
            await until(
                lambda: engine_healthy(session, engine_url),
                restart_timeout_s,
                f"{victim} restarted by the launcher",
                0.25,
            )
            engine_up_at = time.monotonic()
            await until(
                lambda: instance_healthy(session, router.url, victim),
                60,
                f"the router sees {victim} healthy",
                0.1,
            )
            router_healthy_at = time.monotonic()
            tries, probes = await probe_until_served_by(session, router.url, victim)
            readmitted_at = time.monotonic() if tries else None
            engine = engines.launcher.engines[index]
            idle_s = await until(lambda: router_idle(session, router.url), 10, "router idle")
            retries = await router_metric(session, router.url, "gpupool_upstream_retries_total")
    finally:
        await router.stop()
    replies = traffic.replies
    in_flight = [
        r
        for r in replies
        if r.instance == victim and r.headers_at is not None and r.headers_at < killed_at
    ]
    not_started = [r for r in replies if r not in in_flight]
    in_flight_survivor = [r for r in not_started if r.headers_at and r.headers_at < killed_at]
    retried = retried_request_ids(router.log)
    retried_replies = [r for r in replies if r.request_id in retried]
    return {
        "scenario": "engine_kill",
        "load": asdict(load),
        "victim": victim,
        "survivors": survivors,
        "all": tally(replies),
        "in_flight_on_victim": {
            **tally(in_flight),
            "ended_with_openai_error_event": sum(
                1 for r in in_flight if r.kind.startswith("error_event") and r.openai_error
            ),
            "ended_with_done": sum(1 for r in in_flight if r.done),
            "error_codes": sorted({str((r.error or {}).get("code")) for r in in_flight}),
        },
        "not_started_on_victim": {
            **tally(not_started),
            "sent_after_kill": load.later,
            "were_running_elsewhere": len(in_flight_survivor),
            "lost": sum(1 for r in not_started if r.lost),
            "refused_429": sum(1 for r in not_started if r.refused),
            "served_by_victim_after_kill": sum(
                1 for r in not_started if r.instance == victim and r.ok
            ),
            "non_streaming": sum(1 for r in not_started if not r.stream),
        },
        "retried_on_another_engine": {
            "requests": len(retried_replies),
            "non_streaming": sum(1 for r in retried_replies if not r.stream),
            "served": sum(1 for r in retried_replies if r.ok),
        },
        "upstream_retries": retries,
        "restarted": engine.restarts > restarts_before and engine.pid != old_pid,
        "seconds": {
            "kill_to_all_answered": _round(served_at - killed_at),
            "kill_to_engine_healthy": _round(engine_up_at - killed_at),
            "kill_to_router_healthy": _round(router_healthy_at - killed_at),
            "kill_to_first_request_served_by_it": _round(
                None if readmitted_at is None else readmitted_at - killed_at
            ),
            "router_idle_after": _round(idle_s),
        },
        "probes_until_served_by_it": tries,
        "probe_failures": sum(1 for p in probes if not p.ok),
    }


# ---------------------------------------------------------------------------------------------
# 2. SIGSTOP of an engine
# ---------------------------------------------------------------------------------------------


async def engine_freeze(setup: Setup, load: Load, *, deadline_s: float = 12.0) -> JsonDict:
    """`SIGSTOP` of a normal-pool engine with streams on it, every request carrying
    `x-gpupool-deadline-ms`; requests keep arriving until past the deadline; then `SIGCONT`."""
    engines = setup.engines
    config = router_config(
        setup, [e.url for e in engines.instances], "engine-freeze", slots=load.slots
    )
    router = RouterProcess("serve", config, setup.work / "engine-freeze" / "router.log")
    headers = {"x-gpupool-deadline-ms": str(int(deadline_s * 1000))}
    frozen = False
    index = -1
    try:
        await router.wait_ready()
        async with client_session() as session:
            view = await admin_view(session, router.url)
            victim, *survivors = _normal_instances(view)
            index = _index(victim)
            engine_url = engines.instances[index].url
            traffic = Traffic(session, router.url)
            await load.fill(traffic, "f", headers)
            started_on_victim = min(load.slots, load.streams // 2) // 2 or 1
            await until(
                lambda: (
                    sum(1 for r in traffic.replies if r.instance == victim and r.content_events)
                    >= started_on_victim
                ),
                60,
                "streams running on the victim",
                0.02,
            )
            engines.kill(index, signal.SIGSTOP)
            frozen = True
            stopped_at = time.monotonic()
            setup.say(f"engine-freeze: stopped {victim}")
            out_at: float | None = None
            # keep requests coming (short ones) until well past the deadline
            i = 0
            while time.monotonic() < stopped_at + deadline_s + 3:
                traffic.fire(f"f-later{i}", max_tokens=32, headers=headers)
                i += 1
                if out_at is None and not await instance_healthy(session, router.url, victim):
                    out_at = time.monotonic()
                await asyncio.sleep(load.later_interval_s)
            await traffic.wait()
            engines.kill(index, signal.SIGCONT)
            frozen = False
            continued_at = time.monotonic()
            await until(
                lambda: instance_healthy(session, router.url, victim),
                60,
                f"the router sees {victim} healthy again",
            )
            back_at = time.monotonic()
            tries, probes = await probe_until_served_by(session, router.url, victim)
            readmitted_at = time.monotonic() if tries else None
            # the engine dropped the sequences whose clients the router closed at the deadline
            drained_s = await until(
                lambda: _no_sequences(session, engine_url), 30, f"{victim} holds no sequence"
            )
            idle_s = await until(lambda: router_idle(session, router.url), 10, "router idle")
            timeouts = await router_metric(
                session, router.url, "gpupool_requests_total", outcome="timeout"
            )
    finally:
        if frozen:
            engines.kill(index, signal.SIGCONT)
        await router.stop()
    replies = traffic.replies
    done_before = [r for r in replies if r.ended_at is not None and r.ended_at <= stopped_at]
    on_victim = [r for r in replies if r.instance == victim and r not in done_before]
    rest = [r for r in replies if r.instance != victim and r not in done_before]
    late = [
        r.duration_s() - deadline_s
        for r in on_victim
        if r.kind in ("error_event_deadline_exceeded", "http_504_deadline_exceeded")
    ]
    after_out = [r for r in replies if out_at is not None and r.sent_at > out_at + 0.05]
    return {
        "scenario": "engine_freeze",
        "load": asdict(load),
        "deadline_s": deadline_s,
        "victim": victim,
        "survivors": survivors,
        "all": tally(replies),
        "ended_before_the_freeze": tally(done_before),
        "on_frozen_engine": {
            **tally(on_victim),
            "ended_by_deadline": len(late),
            "openai_error_shape": sum(1 for r in on_victim if r.openai_error),
            "ended_after_deadline_s": {
                "min": _round(min(late, default=None)),
                "max": _round(max(late, default=None)),
            },
        },
        "elsewhere": {
            **tally(rest),
            "lost": sum(1 for r in rest if r.lost),
            "refused_429": sum(1 for r in rest if r.refused),
            "refused_429_max_s": _round(
                max((r.duration_s() for r in rest if r.refused), default=None)
            ),
        },
        "sent_after_it_left_rotation": {
            "sent": len(after_out),
            "dispatched_to_it": sum(1 for r in after_out if r.instance == victim),
        },
        "router_timeouts_metric": timeouts,
        "seconds": {
            "stop_to_out_of_rotation": _round(None if out_at is None else out_at - stopped_at),
            "cont_to_router_healthy": _round(back_at - continued_at),
            "cont_to_first_request_served_by_it": _round(
                None if readmitted_at is None else readmitted_at - continued_at
            ),
            "engine_drained_after_healthy": _round(drained_s),
            "router_idle_after": _round(idle_s),
        },
        "probes_until_served_by_it": tries,
        "probe_failures": sum(1 for p in probes if not p.ok),
    }


async def _no_sequences(session: aiohttp.ClientSession, engine_url: str) -> bool:
    return await engine_sequences(session, engine_url) == 0


# ---------------------------------------------------------------------------------------------
# 3. slow /metrics
# ---------------------------------------------------------------------------------------------


class DelayProxy:
    """A TCP proxy in front of one engine that holds each `GET /metrics` request for
    `delay_s` before passing it on, and notes when completions are dispatched through it and
    when /metrics answers start flowing back. HTTP/1.1 without pipelining: a connection
    carries one request at a time, so a chunk that starts a request starts with its method.

    While it holds a request the client's connection has no engine connection, and the held
    request goes to the engine on a new one: vLLM closes a connection idle for 5 s
    (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), and closing the client's under the held request would be
    a failed scrape the engine never caused (with a 4 s delay on the kept-alive connection, a
    slow machine's run lost that race and failed the test)."""

    def __init__(self, upstream_url: str) -> None:
        host_port = upstream_url.split("://", 1)[1]
        host, port = host_port.rsplit(":", 1)
        self.host, self.upstream_port = host, int(port)
        self.delay_s = 0.0
        self.dispatched_at: list[float] = []  # a completion request reached the proxy
        self.metrics_answered_at: list[float] = []  # a /metrics answer started back
        self.metrics_forwarded_at: list[float] = []  # a /metrics request went to the engine
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        awaiting_metrics = [False]
        # the engine connection and the task copying its answers back; replaced for a held
        # /metrics request, and the client's connection ends when the engine closes its own
        upstream: list[tuple[asyncio.StreamWriter, asyncio.Task[None]]] = []

        async def engine_to_client(up_reader: asyncio.StreamReader) -> None:
            with contextlib.suppress(OSError):
                while data := await up_reader.read(65536):
                    if awaiting_metrics[0]:
                        awaiting_metrics[0] = False
                        self.metrics_answered_at.append(time.monotonic())
                    writer.write(data)
                    await writer.drain()
            writer.close()

        def disconnect() -> None:
            for up_writer, pump in upstream:
                pump.cancel()
                up_writer.close()
            upstream.clear()

        async def connect() -> asyncio.StreamWriter:
            disconnect()
            up_reader, up_writer = await asyncio.open_connection(self.host, self.upstream_port)
            upstream.append((up_writer, asyncio.ensure_future(engine_to_client(up_reader))))
            return up_writer

        try:
            up_writer = await connect()
            while data := await reader.read(65536):
                if data.startswith(b"GET /metrics"):
                    if self.delay_s > 0:
                        disconnect()
                        await asyncio.sleep(self.delay_s)
                        up_writer = await connect()
                    awaiting_metrics[0] = True
                    self.metrics_forwarded_at.append(time.monotonic())
                elif data.startswith(b"POST "):
                    self.dispatched_at.append(time.monotonic())
                up_writer.write(data)
                await up_writer.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            disconnect()
            writer.close()

    def stale_dispatches(self, since_s: float, until_s: float, stale_after_s: float) -> list[float]:
        """Dispatches in [since, until) more than `stale_after_s` after the last /metrics answer
        before them: how far past fresh each was."""
        out = []
        answers = sorted(self.metrics_answered_at)
        for t in self.dispatched_at:
            if not since_s <= t < until_s:
                continue
            last = max((a for a in answers if a <= t), default=None)
            age = t - last if last is not None else float("inf")
            if age > stale_after_s:
                out.append(age - stale_after_s)
        return out

    def dispatches(self, since_s: float, until_s: float) -> int:
        return sum(1 for t in self.dispatched_at if since_s <= t < until_s)


async def slow_metrics(
    setup: Setup,
    *,
    clients: int = 12,
    max_tokens: int = 32,
    stale_after_s: float = 1.5,
    delay_s: float = 4.0,
    phase_s: float = 12.0,
    slack_s: float = 0.35,
    scrape_interval_s: float = 0.5,
    scrape_timeout_s: float | None = None,
    unhealthy_after_failures: int = 2,
) -> JsonDict:
    """Closed-loop clients on the normal pool through a proxy per engine; for `phase_s` one
    engine's /metrics takes `delay_s` (> `stale_after_s`, < `scrape_timeout_s`, by default
    `2 * delay_s + 2`), before and after it answers at once."""
    engines = setup.engines
    proxies = [DelayProxy(e.url) for e in engines.instances]
    for p in proxies:
        await p.start()
    config = router_config(
        setup,
        [p.url for p in proxies],
        "slow-metrics",
        slots=max(1, clients // 2),
        router={
            "stale_after_s": stale_after_s,
            "scrape_timeout_s": delay_s * 2 + 2 if scrape_timeout_s is None else scrape_timeout_s,
            "scrape_interval_s": scrape_interval_s,
            "unhealthy_after_failures": unhealthy_after_failures,
        },
    )
    router = RouterProcess("serve", config, setup.work / "slow-metrics" / "router.log")
    ages: dict[str, list[float]] = {}
    health: dict[str, list[bool]] = {}
    try:
        await router.wait_ready()
        async with client_session() as session:
            view = await admin_view(session, router.url)
            victim, *survivors = _normal_instances(view)
            proxy = proxies[_index(victim)]
            replies: list[Reply] = []
            stop = asyncio.Event()

            tasks = [
                asyncio.ensure_future(
                    closed_loop(session, router.url, f"s{c}", stop, replies, max_tokens=max_tokens)
                )
                for c in range(clients)
            ]
            await asyncio.sleep(phase_s / 3)
            slow_from = time.monotonic()
            proxy.delay_s = delay_s
            setup.say(f"slow-metrics: {victim}'s /metrics now takes {delay_s} s")
            while time.monotonic() < slow_from + phase_s:
                v = await admin_view(session, router.url)
                for iid, inst in v["instances"].items():
                    if iid in (victim, *survivors) and inst["telemetry_age_s"] is not None:
                        ages.setdefault(iid, []).append(inst["telemetry_age_s"])
                        health.setdefault(iid, []).append(bool(inst["healthy"]))
                await asyncio.sleep(0.2)
            proxy.delay_s = 0.0
            slow_until = time.monotonic()
            await asyncio.sleep(phase_s / 2)
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
            ended = time.monotonic()
            idle_s = await until(lambda: router_idle(session, router.url), 10, "router idle")
    finally:
        await router.stop()
        for p in proxies:
            await p.aclose()
    # a dispatch right after the delay is switched on may still ride the last fast reading
    late = proxy.stale_dispatches(slow_from, slow_until + delay_s, stale_after_s + slack_s)
    victim_ages = ages.get(victim, [])
    return {
        "scenario": "slow_metrics",
        "clients": clients,
        "max_tokens": max_tokens,
        "stale_after_s": stale_after_s,
        "metrics_delay_s": delay_s,
        "slow_phase_s": round(slow_until - slow_from, 2),
        "victim": victim,
        "all": tally(replies),
        "dispatches_to_slow_engine": {
            "before": proxy.dispatches(0, slow_from),
            "while_slow": proxy.dispatches(slow_from, slow_until),
            "after": proxy.dispatches(slow_until + delay_s, ended),
            "while_its_telemetry_was_stale": len(late),
            "worst_s_past_stale": _round(max(late, default=None)),
        },
        "dispatches_to_others_while_slow": sum(
            proxies[_index(s)].dispatches(slow_from, slow_until) for s in survivors
        ),
        "telemetry_age_s_while_slow": {
            iid: {"max": _round(max(a)), "share_stale": _round(_share(a, stale_after_s))}
            for iid, a in ages.items()
        },
        "slow_engine_stayed_healthy": all(health.get(victim, [False])),
        # the slow engine's /metrics answers: held `delay_s` by the proxy, then the engine's own
        "slow_engine_metrics_answer_s": _answer_times(proxy, slow_from, slow_until),
        "slow_engine_share_of_time_stale": _round(_share(victim_ages, stale_after_s)),
        "router_idle_after_s": _round(idle_s),
    }


def _answer_times(proxy: DelayProxy, since_s: float, until_s: float) -> JsonDict:
    """How long the engine itself took to start each /metrics answer forwarded in
    [since, until), after the proxy's hold: the max and the count."""
    answers = sorted(proxy.metrics_answered_at)
    took = []
    for asked in proxy.metrics_forwarded_at:
        if since_s <= asked < until_s:
            after = [a - asked for a in answers if a >= asked]
            if after:
                took.append(after[0])
    return {"count": len(took), "engine_max_s": _round(max(took, default=None))}


def _share(values: list[float], above: float) -> float:
    return sum(1 for v in values if v > above) / len(values) if values else 0.0


# ---------------------------------------------------------------------------------------------
# 4. kill -9 of the router
# ---------------------------------------------------------------------------------------------


def ledger_rows(path: Path) -> dict[str, JsonDict]:
    """Every request row of a ledger file by request id (opening it recovers the WAL)."""
    conn = sqlite3.connect(path, timeout=10)
    try:
        conn.row_factory = sqlite3.Row
        rows = conn.execute("SELECT * FROM requests").fetchall()
        check = conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()
    out = {r["request_id"]: dict(r) for r in rows}
    if check != "ok":
        raise RuntimeError(f"{path}: integrity_check says {check}")
    return out


async def router_kill(
    setup: Setup,
    *,
    clients: int = 20,
    max_tokens: int = 24,
    run_max_tokens: int = 8,
    load_s: float = 5.0,
    flush_interval_s: float = default_of(RouterConfig, "ledger_flush_interval_s"),
    slack_s: float = 0.5,
) -> JsonDict:
    """Closed-loop streaming clients on the normal pool and one agent run stepping on the
    agent pool; `kill -9` of `gpupool serve` after `load_s`; then the ledger is compared with
    what the clients were served, and a new router is started on the same ledger."""
    engines = setup.engines
    config = router_config(
        setup,
        [e.url for e in engines.instances],
        "router-kill",
        slots=max(1, clients // 2),
        router={"ledger_flush_interval_s": flush_interval_s},
    )
    ledger_path = setup.work / "router-kill" / "ledger.sqlite"
    log = setup.work / "router-kill" / "router.log"
    router = RouterProcess("serve", config, log)
    run_id = "fault-run-" + os.urandom(4).hex()
    run_headers = {"x-gpupool-run-id": run_id}
    replies: list[Reply] = []
    run_replies: list[Reply] = []
    try:
        await router.wait_ready()
        async with client_session() as session:
            killed = asyncio.Event()

            tasks = [
                asyncio.ensure_future(
                    closed_loop(
                        session,
                        router.url,
                        f"r{c}",
                        killed,
                        replies,
                        max_tokens=max_tokens,
                        stop_on_exception=True,
                    )
                )
                for c in range(clients)
            ]
            run_loop = closed_loop(
                session,
                router.url,
                "run",
                killed,
                run_replies,
                max_tokens=run_max_tokens,
                headers=run_headers,
                stop_on_exception=True,
            )
            tasks.append(asyncio.ensure_future(run_loop))
            await asyncio.sleep(load_s)
            router.signal(signal.SIGKILL)
            killed_at = time.monotonic()
            killed.set()
            await router.wait_exit(10)
            setup.say("router-kill: killed gpupool serve")
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            # the engines drop the dead router's sequences (its connections are gone)
            engines_drained_s = await until(
                lambda: _all_drained(session, [e.url for e in engines.instances]),
                30,
                "engines without the dead router's sequences",
            )
    finally:
        await router.stop()
    everything = replies + run_replies
    served = [r for r in everything if r.ok]
    rows = ledger_rows(ledger_path)
    lost = [r for r in served if r.request_id not in rows]
    lost_age = [killed_at - (r.ended_at or killed_at) for r in lost]
    served_ids = {r.request_id for r in served}
    run_steps_before = sorted(
        int(row["step_index"]) for row in rows.values() if row["run_id"] == run_id
    )
    # the next start: recovers the file, serves, continues the run's steps
    restart = RouterProcess("serve", config, log)
    try:
        ready_s = await restart.wait_ready()
        async with client_session() as session:
            after = [
                await send(session, restart.url, f"after-{i}", max_tokens=max_tokens)
                for i in range(4)
            ]
            step = await send(
                session, restart.url, "run-next", max_tokens=run_max_tokens, headers=run_headers
            )
            async with session.get(f"{restart.url}/v1/runs/{run_id}") as resp:
                run_status = resp.status
                run = await resp.json()
    finally:
        await restart.stop()
    run_steps = [(r["request_id"], r["step_index"]) for r in run.get("requests", [])]
    next_step = next((index for rid, index in run_steps if rid == step.request_id), None)
    return {
        "scenario": "router_kill",
        "clients": clients,
        "max_tokens": max_tokens,
        "ledger_flush_interval_s": flush_interval_s,
        "all": tally(everything),
        "served_before_kill": len(served),
        "in_flight_at_kill": sum(1 for r in everything if r.exception),
        "ledger": {
            "rows": len(rows),
            "served_and_recorded": len(served) - len(lost),
            "records_lost": len(lost),
            "lost_ended_s_before_kill_max": _round(max(lost_age, default=None)),
            "lost_beyond_one_flush_interval": sum(
                1 for a in lost_age if a > flush_interval_s + slack_s
            ),
            "rows_the_client_never_saw_end": sum(
                1 for rid in rows if rid not in served_ids and rows[rid]["run_id"] != run_id
            ),
        },
        "engines_drained_s": _round(engines_drained_s),
        "restart": {
            "ready_s": _round(ready_s),
            "served_after": sum(1 for r in after if r.ok),
            "sent_after": len(after),
            "run_step_served": step.ok,
            "run_steps_stored_before": len(run_steps_before),
            "run_last_stored_step": run_steps_before[-1] if run_steps_before else None,
            "run_next_step": next_step,
            # what the run endpoint answered, for a failure's diagnosis
            "run_status": run_status,
            "run_step_request_id": step.request_id,
            "run_steps_after": run_steps[-3:],
        },
    }


async def _all_drained(session: aiohttp.ClientSession, urls: list[str]) -> bool:
    for url in urls:
        if await engine_sequences(session, url) > 0:
            return False
    return True


# ---------------------------------------------------------------------------------------------
# 5. graceful SIGTERM
# ---------------------------------------------------------------------------------------------


def engine_pids(run_dir: Path) -> list[int]:
    """The engines `gpupool up` started, from the launcher's pid files."""
    pids = []
    for pid_file in sorted(run_dir.glob("engine-*.pid")):
        with contextlib.suppress(ValueError, IndexError, OSError):
            pids.append(int(pid_file.read_text().split()[0]))
    return pids


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


async def graceful_stop(
    setup: Setup,
    load: Load,
    *,
    mode: str = "serve",
    engine_count: int = 3,
    grace_s: float = 10.0,
) -> JsonDict:
    """`load.streams` streams running and `load.queued` waiting, then SIGTERM to the router;
    new connections are tried every 0.1 s while it drains. `mode="up"`: `gpupool up` with
    its own `engine_count` engines instead of `serve` in front of the shared ones."""
    name = f"graceful-{mode}"
    folder = setup.work / name
    folder.mkdir(parents=True, exist_ok=True)
    run_dir = folder / "run"
    engines_section: JsonDict | None = None
    if mode == "up":
        base = free_port()
        while any(_port_busy(base + i) for i in range(1, engine_count)):
            base = free_port()
        engines_section = {
            "launcher": "local",
            "local": {
                "count": engine_count,
                "base_port": base,
                "kv_cache_bytes": 64 * 1024 * 1024,
                "api_key_env": setup.key_env,
                "run_dir": str(run_dir),
                "startup_timeout_s": 400,
                "stop_grace_s": 15,
                "vllm_args": ["--max-num-seqs", str(load.slots)],
            },
        }
    config = router_config(
        setup,
        [e.url for e in setup.engines.instances],
        name,
        slots=load.slots,
        engines=engines_section,
    )
    router = RouterProcess(mode, config, folder / "router.log")
    refused: list[str] = []
    accepted: list[Reply] = []
    pids: list[int] = []
    try:
        ready_s = await router.wait_ready(400 if mode == "up" else 90)
        pids = engine_pids(run_dir)
        async with client_session() as session:
            traffic = Traffic(session, router.url)
            await load.fill(traffic, "g")
            running = max(1, load.streams // 2)
            await until(
                lambda: (
                    sum(1 for r in traffic.replies if r.content_events and r.ended_at is None)
                    >= running
                ),
                60,
                "streams running",
                0.02,
            )
            router.signal(signal.SIGTERM)
            term_at = time.monotonic()
            setup.say(f"{name}: SIGTERM with {running}+ streams running")
            # the router stops accepting, then says "shutting down": new connections from then
            await until(
                lambda: "shutting down" in router.log.read_text(errors="replace"),
                10,
                "the router's 'shutting down'",
                0.02,
            )
            # new connections while it drains: each must be refused, none served
            async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True)
            ) as fresh:
                while router.proc.poll() is None and time.monotonic() - term_at < grace_s:
                    await asyncio.sleep(0.1)
                    reply = await send(fresh, router.url, "new", max_tokens=4, timeout_s=5)
                    if reply.status is None:
                        refused.append((reply.exception or "").split(":", 1)[0])
                    else:
                        accepted.append(reply)
            await traffic.wait(grace_s + 30)
            code = await router.wait_exit(grace_s + 60)
            exit_at = time.monotonic()
    finally:
        await router.stop()
    replies = traffic.replies
    ended = [r.ended_at - term_at for r in replies if r.ended_at is not None]
    rows = ledger_rows(folder / "ledger.sqlite")
    served = [r for r in replies if r.ok]
    log = router.log.read_text(errors="replace")
    result: JsonDict = {
        "scenario": "graceful_stop",
        "mode": mode,
        "load": asdict(load),
        "grace_s": grace_s,
        "ready_s": _round(ready_s),
        "all": tally(replies),
        "in_flight_at_sigterm": sum(
            1 for r in replies if r.ended_at is None or r.ended_at > term_at
        ),
        "streaming_at_sigterm": sum(
            1
            for r in replies
            if r.first_token_at is not None
            and r.first_token_at < term_at
            and (r.ended_at is None or r.ended_at > term_at)
        ),
        "new_connections_while_draining": {
            "tried": len(refused) + len(accepted),
            "refused": len(refused),
            "refused_how": sorted(set(refused)),
            "answered": len(accepted),
            "answered_statuses": sorted({r.status or 0 for r in accepted}),
        },
        "last_stream_ended_s_after_sigterm": _round(max(ended, default=None)),
        "exit_code": code,
        "exit_s_after_sigterm": _round(exit_at - term_at),
        "ledger": {
            "served": len(served),
            "recorded": sum(1 for r in served if r.request_id in rows),
            "records_lost": sum(1 for r in served if r.request_id not in rows),
        },
        "log_says_shutting_down": "shutting down" in log,
    }
    if mode == "up":
        result["engines"] = {
            "started": len(pids),
            "alive_after_exit": sum(1 for p in pids if _alive(p)),
            "log_says_engines_stopped": "engines stopped" in log,
            "stopped_after_shutdown": log.find("engines stopped") > log.find("shutting down") >= 0,
        }
    return result


def _port_busy(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False
