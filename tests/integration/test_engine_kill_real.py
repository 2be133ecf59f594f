"""One `kill -9` of a real CPU vLLM engine, and what three parts of gpupool do about it.

Killing an engine costs the launcher's restart (20-30 s on a CPU), so one kill serves three
promises, each checked by its own test on the record the module fixture keeps:

- the fault scenario (`benchmarks/reliability/faults.py: engine_kill`, under load through its
  own `gpupool serve`): no request is lost that had not started on the killed engine;
- the Responses API: a response stored on the killed engine gives 400
  previous_response_not_found while the engine is dead, and still 400 (never 500) once the
  launcher has it back under the same id, holding nothing;
- the router: new requests while the engine is dead are all served by the other engine of its
  pool, and once restarted (new pid) the router marks it healthy and sends it traffic again;
- the prefix-cache index (router/prefix, on the fleet's event loop, following the victim's KV
  events from before the kill to after the restart): it holds a prompt's blocks before, holds
  none of them once the engine came back empty (the index of the dead process is dropped, never
  carried over), and follows the new process: the same prompt sent again is indexed again.

The victim is the engine `engine_kill` kills: the first engine of the normal pool of a router
with the scenario's own config, read from such a router before the kill (the record checks
the scenario killed that one). Two more routers over the same three engines are started first,
each with its pools pinned around the victim:

- `responses`: the agent class's pool is the victim alone, so a response asked for as agent
  is stored on it, not by luck;
- `router`: the normal pool is the victim and the engine the scenario leaves idle (its agent
  engine), so the requests sent while the victim is dead meet no load but their own.

The checks made "while it is dead" run beside the scenario: they start when its kill signal
is sent and the victim's `/health` has stopped answering, and `/health` is read again after
the last of them; each test that relies on them asserts it still did not answer (the restart
takes far longer than the checks, and should it ever not, the tests say so).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from benchmarks.reliability import faults
from pools.launchers import InstanceSpec, LocalLauncher
from pools.testing.router_process import free_port
from router.prefix import PrefixCache
from router.prefix.prompt import ChatPrompt
from router.prefix.subscriber import EngineEvents
from tests.integration.conftest import (
    ENGINE_KEY_ENV,
    MODEL_DIR,
    EngineFleet,
    RouterProcess,
    write_router_config,
)

pytestmark = pytest.mark.integration

# 20 streams, then 4 non-streaming requests, fill the normal pool's two engines (12 each);
# 10 more wait in its queue. The kill must find streams still running: on a fast CPU
# 300-token streams were all over by the time the queue had filled (a clean-clone run cut
# none of them), hence 1200.
KILL_LOAD = faults.Load(streams=20, plain=4, queued=10, later=10, max_tokens=1200, slots=12)
RESPONSES = {"model": "tiny", "input": "Say hello.", "max_output_tokens": 8}
HELLO = [{"role": "user", "content": "hello there"}]
DEAD_REQUESTS = 8  # new chat requests sent while the victim is dead
BACK_REQUESTS = 12  # and after the router has it healthy again


@dataclass
class KillRecord:
    """What the one kill showed; filled by the module fixture, read by the tests."""

    victim: str
    scenario: dict[str, Any] = field(default_factory=dict)  # engine_kill's result
    old_pid: int = 0
    new_pid: int | None = None
    restarts_before: int = 0
    restarts_after: int = 0
    # the victim's /health after the last check made while it was dead (the checks start once
    # it has stopped answering)
    answered_health_after_dead_checks: bool = True
    # responses router: the follow-up to the response stored on the victim
    stored_on: str = ""
    follow_up_while_dead: tuple[int, dict[str, Any]] = (0, {})
    follow_up_after_restart: tuple[int, dict[str, Any]] = (0, {})
    # router: new chat requests while dead (status, instance), then after it is back
    while_dead: list[tuple[int, str | None]] = field(default_factory=list)
    router_saw_it_healthy_again: bool = False
    instances_after_restart: list[str] = field(default_factory=list)
    statuses_after_restart: list[int] = field(default_factory=list)
    # the prefix-cache index following the victim: the prompt's full blocks it held before the
    # kill, once the engine was back (before the prompt was sent again), and after it was
    prefix_blocks: int = 0
    prefix_held_before: int = -1
    prefix_held_after_restart: int = -1
    prefix_held_after_resend: int = -1
    prefix_index_restarts: tuple[int, int] = (0, 0)  # the subscriber's count, before / after
    prefix_usable_after: bool = False


class _IndexWatch:
    """A `PrefixCache` following one engine on the fleet's event loop (it outlives the
    scenario's own `asyncio.run`), and the one prompt it is checked with."""

    def __init__(self, spec: InstanceSpec) -> None:
        prompt = ChatPrompt.from_model_dir(MODEL_DIR)
        assert prompt is not None and spec.kv_events is not None
        rules = " ".join(f"Rule {i}: a killed engine keeps nothing it cached." for i in range(60))
        self.body = {
            "model": "tiny",
            "messages": [
                {"role": "system", "content": f"Kill {os.urandom(4).hex()}. {rules}"},
                {"role": "user", "content": "What survives a restart?"},
            ],
            "max_tokens": 1,
        }
        ids = prompt.token_ids(self.body)
        assert ids is not None
        self.ids = ids
        self.spec = spec
        self.cache = PrefixCache([spec])

    @property
    def events(self) -> EngineEvents:
        return self.cache.engines[self.spec.instance_id]

    def held(self) -> int:
        return self.cache.cached_blocks(self.ids).get(self.spec.instance_id, 0)

    async def send_and_wait(self, blocks: int) -> int:
        """Send the prompt to the engine itself; its blocks once the index holds `blocks`."""
        async with asyncio.timeout(60), httpx.AsyncClient(timeout=60) as client:
            await self.events.wait_for(lambda e: e.connected)
            headers = {"Authorization": f"Bearer {self.spec.api_key}"}
            url = f"{self.spec.url}/v1/chat/completions"
            (await client.post(url, json=self.body, headers=headers)).raise_for_status()
            await self.events.wait_for(lambda e: self.held() == blocks)
        return self.held()

    async def after_restart(self) -> int:
        """Once reconnected to the restarted engine: the prompt's blocks the index holds."""
        async with asyncio.timeout(60):
            await self.events.wait_for(lambda e: e.connected)
        return self.held()


class _KillWatch:
    """The session's engines as the scenario sees them, telling the module when the scenario
    sends its SIGKILL (which engine, which pid) so the checks for a dead engine start then."""

    def __init__(self, fleet: EngineFleet, killed: asyncio.Future[tuple[int, int]]) -> None:
        self._fleet = fleet
        self._killed = killed

    @property
    def instances(self) -> list[InstanceSpec]:
        return self._fleet.instances

    @property
    def launcher(self) -> LocalLauncher:
        return self._fleet.launcher

    def kill(self, index: int, sig: int = signal.SIGKILL) -> int:
        pid = self._fleet.kill(index, sig)
        if sig == signal.SIGKILL and not self._killed.done():
            self._killed.set_result((index, pid))
        return pid


def _json(resp: httpx.Response) -> dict[str, Any]:
    try:
        data = resp.json()
    except ValueError:
        return {"raw": resp.text[:300]}
    return data if isinstance(data, dict) else {"raw": data}


async def _answers_health(client: httpx.AsyncClient, engine_url: str) -> bool:
    try:
        resp = await client.get(f"{engine_url}/health", timeout=2)
    except httpx.HTTPError:
        return False
    return resp.status_code == 200


def _pools(path: Path, urls: list[str], pinned: dict[str, tuple[list[str], list[str]]]) -> Path:
    """A router config over `urls` whose pools (name -> (classes, pinned instances)) each hold
    exactly the instances pinned to them."""
    pools = {
        name: {
            "classes": classes,
            "share": {"initial_frac": len(instances) / len(urls)},
            "pinned_instances": instances,
        }
        for name, (classes, instances) in pinned.items()
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_router_config(path, urls)
    config = yaml.safe_load(path.read_text())
    config["pools"] = pools  # these pools only (write_router_config merges into its own two)
    path.write_text(yaml.safe_dump(config))
    return path


def _scenario_normal_pool(setup: faults.Setup, urls: list[str]) -> list[str]:
    """The normal pool of a router with `engine_kill`'s config (`faults.router_config`, as the
    scenario writes it), sorted: the scenario kills the first."""
    config = faults.router_config(setup, urls, "victim-pick", slots=KILL_LOAD.slots)
    router = RouterProcess(config, free_port(), config.parent / "router.log")
    try:
        view = httpx.get(f"{router.url}/admin/pools", timeout=5).json()
    finally:
        router.stop()
    return sorted(view["pools"]["normal"]["instances"])


async def _while_dead(
    record: KillRecord,
    victim_url: str,
    responses_url: str,
    router_url: str,
    previous_id: str,
) -> None:
    """The checks made while the victim is dead: once its /health no longer answers, the
    stored response's follow-up, then new chat requests; then its /health is read again."""
    async with httpx.AsyncClient(timeout=120) as client:

        async def dead() -> bool:
            return not await _answers_health(client, victim_url)

        await faults.until(dead, 10, "the killed engine's /health stops answering", 0.02)
        resp = await client.post(
            f"{responses_url}/v1/responses",
            json={**RESPONSES, "previous_response_id": previous_id},
            headers={"x-gpupool-class": "agent"},
        )
        record.follow_up_while_dead = (resp.status_code, _json(resp))
        for _ in range(DEAD_REQUESTS):
            resp = await client.post(
                f"{router_url}/v1/chat/completions",
                json={"model": "tiny", "messages": HELLO, "max_tokens": 2},
            )
            record.while_dead.append((resp.status_code, resp.headers.get("x-gpupool-instance")))
        record.answered_health_after_dead_checks = await _answers_health(client, victim_url)


async def _kill_and_check_while_dead(
    setup: faults.Setup,
    fleet: EngineFleet,
    record: KillRecord,
    urls: dict[str, str],
    previous_id: str,
) -> tuple[int, int]:
    """Run the scenario; when it kills, make the dead-engine checks beside it. Returns the
    index and the pid it killed."""
    killed: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
    watched = dataclasses.replace(setup, engines=_KillWatch(fleet, killed))
    scenario = asyncio.ensure_future(faults.engine_kill(watched, KILL_LOAD))
    try:
        either: set[asyncio.Future[faults.JsonDict] | asyncio.Future[tuple[int, int]]]
        either = {scenario, killed}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if not killed.done():
            await scenario  # it ended (raised) before killing anything
            raise AssertionError("engine_kill returned without killing an engine")
        index, pid = killed.result()
        await _while_dead(record, urls["victim"], urls["responses"], urls["router"], previous_id)
        record.scenario = await scenario
    finally:
        if not scenario.done():
            scenario.cancel()
            await asyncio.gather(scenario, return_exceptions=True)
    return index, pid


def _wait_healthy_in(router_url: str, instance: str, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        view = httpx.get(f"{router_url}/admin/pools", timeout=5).json()
        if view["instances"][instance]["healthy"]:
            return True
        time.sleep(0.25)
    return False


@pytest.fixture(scope="module")
def kill_record(
    engine_fleet: EngineFleet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KillRecord]:
    work = tmp_path_factory.mktemp("engine-kill")
    say = lambda m: print(f"[engine-kill] {m}", file=sys.stderr, flush=True)  # noqa: E731
    setup = faults.Setup(engine_fleet, work, MODEL_DIR, ENGINE_KEY_ENV, say=say)
    urls = [e.url for e in engine_fleet.instances]
    ids = [e.instance_id for e in engine_fleet.instances]
    # the scenario's normal pool is its victim and one survivor; the third engine is its agent
    # engine, which its load leaves idle
    victim, survivor = _scenario_normal_pool(setup, urls)
    index = ids.index(victim)
    idle = next(i for i in ids if i not in (victim, survivor))
    others = [i for i in ids if i != victim]
    responses = RouterProcess(
        _pools(
            work / "responses" / "gpupool.yaml",
            urls,
            {"victim": (["agent"], [victim]), "rest": (["normal"], others)},
        ),
        free_port(),
        work / "responses" / "router.log",
    )
    router = None
    watch: _IndexWatch | None = None
    try:
        router = RouterProcess(
            _pools(
                work / "router" / "gpupool.yaml",
                urls,
                {"normal": (["normal"], [victim, idle]), "agent": (["agent"], [survivor])},
            ),
            free_port(),
            work / "router" / "router.log",
        )
        record = KillRecord(victim=victim)
        record.restarts_before = engine_fleet.launcher.engines[index].restarts
        watch = _IndexWatch(engine_fleet.instances[index])
        engine_fleet.run(watch.cache.start())
        record.prefix_blocks = len(watch.ids) // 128  # vLLM's CPU block size
        record.prefix_held_before = engine_fleet.run(watch.send_and_wait(record.prefix_blocks))
        restarts_before = watch.events.restarts
        first = httpx.post(
            f"{responses.url}/v1/responses",
            json=RESPONSES,
            headers={"x-gpupool-class": "agent"},
            timeout=120,
        )
        assert first.status_code == 200, first.text
        record.stored_on = first.headers["x-gpupool-instance"]
        assert record.stored_on == victim, (record.stored_on, victim)
        previous_id = first.json()["id"]
        try:
            killed_index, record.old_pid = asyncio.run(
                _kill_and_check_while_dead(
                    setup,
                    engine_fleet,
                    record,
                    {
                        "victim": engine_fleet.instances[index].url,
                        "responses": responses.url,
                        "router": router.url,
                    },
                    previous_id,
                )
            )
            assert killed_index == index, (killed_index, index)
        finally:
            engine_fleet.wait_healthy(index, timeout_s=240)
        # back: the launcher's restart, the router's readmission, the stored response's fate
        engine = engine_fleet.launcher.engines[index]
        record.new_pid, record.restarts_after = engine.pid, engine.restarts
        record.router_saw_it_healthy_again = _wait_healthy_in(router.url, victim)
        for _ in range(BACK_REQUESTS):
            resp = httpx.post(
                f"{router.url}/v1/chat/completions",
                json={"model": "tiny", "messages": HELLO, "max_tokens": 1},
                timeout=60,
            )
            record.statuses_after_restart.append(resp.status_code)
            record.instances_after_restart.append(resp.headers.get("x-gpupool-instance", ""))
        # the responses router too must have it healthy again, so the follow-up reaches the
        # restarted engine (which holds nothing) rather than being refused as gone
        assert _wait_healthy_in(responses.url, victim), "the responses router never took it back"
        resp = httpx.post(
            f"{responses.url}/v1/responses",
            json={**RESPONSES, "previous_response_id": previous_id},
            headers={"x-gpupool-class": "agent"},
            timeout=120,
        )
        record.follow_up_after_restart = (resp.status_code, _json(resp))
        record.prefix_held_after_restart = engine_fleet.run(watch.after_restart())
        record.prefix_held_after_resend = engine_fleet.run(
            watch.send_and_wait(record.prefix_blocks)
        )
        record.prefix_index_restarts = (restarts_before, watch.events.restarts)
        record.prefix_usable_after = watch.events.usable
        print(record)
        yield record
    finally:
        if watch is not None:
            engine_fleet.run(watch.cache.aclose())
        if router is not None:
            router.stop()
        responses.stop()
        for i in range(len(engine_fleet.instances)):
            engine_fleet.wait_healthy(i, timeout_s=240)


def test_kill_9_of_an_engine_loses_no_request_that_had_not_started_there(
    kill_record: KillRecord,
) -> None:
    r = kill_record.scenario
    assert r["victim"] == kill_record.victim, r["victim"]
    flight = r["in_flight_on_victim"]
    assert flight["sent"] >= KILL_LOAD.slots // 2, "the kill should catch streams on the engine"
    assert flight["failed"] >= 1, "no stream was still running on the engine at the kill"
    # every stream cut by the kill ends with an OpenAI-shaped error event, then [DONE]
    assert flight["failed_by_kind"] == {"error_event_engine_error": flight["failed"]}, flight
    assert flight["ended_with_openai_error_event"] == flight["failed"]
    assert flight["ended_with_done"] == flight["sent"]
    # queued at the kill, running elsewhere, non-streaming (no byte had reached the client:
    # retried elsewhere), or sent after: every one served in full
    rest = r["not_started_on_victim"]
    assert rest["lost"] == 0 and rest["served"] == rest["sent"], rest
    load = KILL_LOAD
    assert rest["sent"] == load.streams + load.plain + load.queued + load.later - flight["sent"]
    retried = r["retried_on_another_engine"]
    assert retried["served"] == retried["requests"], retried
    assert retried["non_streaming"] >= 1, "no non-streaming request was cut on the engine"
    # the launcher restarted it and the router readmitted it
    assert r["restarted"]
    assert r["probes_until_served_by_it"] >= 1, "the restarted engine got no traffic back"
    assert r["probe_failures"] == 0


def _dead_throughout(record: KillRecord) -> None:
    assert not record.answered_health_after_dead_checks, (
        "the victim answered /health again before the dead-engine checks were over: they may "
        "not all have met a dead engine"
    )


def test_a_chain_whose_engine_was_stopped_gets_400(kill_record: KillRecord) -> None:
    assert kill_record.stored_on == kill_record.victim
    _dead_throughout(kill_record)
    status, body = kill_record.follow_up_while_dead
    assert status == 400, body
    assert body["error"]["code"] == "previous_response_not_found"
    assert body["error"]["param"] == "previous_response_id"
    # back up under the same id, the restarted engine holds nothing: still 400, never a 500
    status, body = kill_record.follow_up_after_restart
    assert status == 400 and body["error"]["code"] == "previous_response_not_found", body


def test_dead_engine_does_not_fail_new_requests_and_comes_back(kill_record: KillRecord) -> None:
    victim = kill_record.victim
    _dead_throughout(kill_record)
    statuses = [status for status, _ in kill_record.while_dead]
    assert statuses == [200] * DEAD_REQUESTS, kill_record.while_dead
    for status, instance in kill_record.while_dead:
        assert instance != victim or status == 200
    # the launcher restarts the engine (with backoff) and the router takes it back
    assert kill_record.restarts_after > kill_record.restarts_before
    assert kill_record.new_pid is not None and kill_record.new_pid != kill_record.old_pid
    assert kill_record.router_saw_it_healthy_again
    assert kill_record.statuses_after_restart == [200] * BACK_REQUESTS
    assert victim in kill_record.instances_after_restart, "the restarted engine got no traffic back"


def test_the_prefix_index_drops_a_killed_engines_blocks_and_follows_its_restart(
    kill_record: KillRecord,
) -> None:
    r = kill_record
    assert r.prefix_blocks >= 3  # the system prompt spans several blocks
    assert r.prefix_held_before == r.prefix_blocks
    # the restarted engine holds nothing, and neither does the index: it never claims a block
    # the new process lacks
    assert r.prefix_held_after_restart == 0
    before, after = r.prefix_index_restarts
    assert after > before, "the subscriber saw no lost connection or new publisher"
    # it follows the new process: the prompt sent again is indexed again, and usable
    assert r.prefix_held_after_resend == r.prefix_blocks
    assert r.prefix_usable_after
