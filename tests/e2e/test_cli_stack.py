"""The whole stack through the CLI, in two `gpupool up` stacks (each takes 25-45 s to start on
two cores, so each is checked for several things at once):

- the embedded default as a newcomer runs it (three real CPU engines): the official OpenAI
  client through it, then Ctrl-C with streams running: they finish, new connections are refused
  from "shutting down" on, it exits 0 and no engine is left behind (SIGTERM takes the same
  handler, `router/cli/stack.py`);
- a new user's config (two CPU engines, no KV size, no dtype) with a tenant and the router at
  debug: both engines start and serve, each refuses a request without its key, no prompt or key
  reaches any file written, and every engine dies when gpupool itself is killed;

and bad configs exiting 2.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
import yaml

from tests.e2e.stack import GPUPOOL, REPO, seed_vllm_flags, wait_ready

pytestmark = pytest.mark.e2e


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _engines_on(ports: range) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "vllm.entrypoints" in cmd and any(f"--port {p}" in cmd for p in ports):
            found.append(proc)
    return found


def _engine_children_alive(pids: list[int]) -> list[int]:
    return [
        p
        for p in pids
        if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
    ]


def _process_tree(pid: int) -> list[int]:
    try:
        return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        return [pid]


STREAMS = 4  # running when Ctrl-C comes
STREAM_TOKENS = 300  # `ignore_eos`: each stream runs its full length (seconds on CPU)


class _Stream(threading.Thread):
    """One streamed chat completion: when its first content came, whether it ended with
    [DONE], its finish reason, its error if it failed."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.first_content = threading.Event()
        self.done = False
        self.finish_reason: str | None = None
        self.error: str | None = None

    def run(self) -> None:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "count"}],
            "max_tokens": STREAM_TOKENS,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream(
                "POST", f"{self.url}/v1/chat/completions", json=body, timeout=120
            ) as resp:
                for line in resp.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        choices = json.loads(line[6:]).get("choices") or [{}]
                        if choices[0].get("delta", {}).get("content"):
                            self.first_content.set()
                        self.finish_reason = choices[0].get("finish_reason") or self.finish_reason
        except httpx.HTTPError as err:
            self.error = repr(err)


def _refused_while_draining(url: str, proc: subprocess.Popen[bytes]) -> tuple[int, list[int]]:
    """New connections tried every 0.1 s until gpupool exits: (refused, statuses answered)."""
    refused, answered = 0, []
    while proc.poll() is None:
        try:
            resp = httpx.get(f"{url}/v1/models", timeout=5)
            answered.append(resp.status_code)
        except httpx.HTTPError:
            refused += 1
        time.sleep(0.1)
    return refused, answered


def test_up_on_the_default_serves_openai_and_ctrl_c_leaves_nothing(tmp_path: Path) -> None:
    port = _free_port()
    # the default run_dir (./.gpupool/run); without the flag list there, `gpupool up` reads
    # vLLM's --help first (15-20 s; the launcher's cache, read once per session elsewhere)
    seed_vllm_flags(REPO / ".gpupool" / "run")
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [GPUPOOL, "up", "--port", str(port)], cwd=REPO, stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    streams: list[_Stream] = []
    try:
        wait_ready(url, proc, log, timeout_s=400, interval_s=0.2)
        deadline = time.monotonic() + 10
        while "press Ctrl-C" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        text = log.read_text()
        assert f"OpenAI base URL: {url}/v1" in text
        assert "pool 'agent'" in text and "pool 'normal'" in text
        engines = _engines_on(range(8100, 8103))
        assert len(engines) == 3, "the default is three engines"
        tree = [p for e in engines for p in _process_tree(e.pid)]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        assert [m.id for m in client.models.list().data] == ["tiny"]
        chunks = list(
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=5,
                stream=True,
            )
        )
        assert any(c.choices and c.choices[0].delta.content for c in chunks)
        raw = client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            tools=[
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
                }
            ],
        )
        assert raw.headers["x-gpupool-pool"] == "agent"
        plain = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert plain.headers["x-gpupool-pool"] == "normal"
        streams = [_Stream(url) for _ in range(STREAMS)]
        for stream in streams:
            stream.start()
        for stream in streams:
            assert stream.first_content.wait(60), stream.error
    except BaseException:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)
        raise
    # which streams run at Ctrl-C is read the moment it is sent: read later (after the
    # "shutting down" line, as it once was), a fast machine had finished three of four streams
    # by then. The last stream to start has just had its first token of 300, so at least one
    # is always running.
    running_at_ctrl_c = sum(not s.done for s in streams)
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends gpupool (its engines are its own)
    deadline = time.monotonic() + 10
    while "shutting down" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    refused, answered = _refused_while_draining(url, proc)
    code = proc.wait(timeout=90)
    for stream in streams:
        stream.join(timeout=30)
    text = log.read_text()
    assert code == 0, text
    assert running_at_ctrl_c >= 1, running_at_ctrl_c
    # every stream, those running at Ctrl-C among them, ran to its end: none cut by the stop
    assert [(s.done, s.finish_reason, s.error) for s in streams] == [
        (True, "length", None)
    ] * STREAMS
    assert answered == [] and refused >= 1, (refused, answered)
    assert "engines stopped" in text
    assert _engines_on(range(8100, 8103)) == []
    assert _engine_children_alive(tree) == [], "an engine process outlived gpupool"


NEW_USER_ENGINE_PORTS = range(8180, 8182)
TENANT = "team-secret"
RUN_ID = "run-secrets-1"


def _new_user_config(tmp_path: Path, router_port: int) -> dict[str, Any]:
    """A new user's config, `local: {count: 2}` with no kv_cache_bytes and no dtype, plus a tenant
    whose key comes from GPUPOOL_TEST_SECRET_KEY and the router logging at debug; every file
    gpupool writes (engine logs, ledger, state) lands under `tmp_path`. 512 tokens of context, so
    that the over-length prompt (~3,000 tokens) is refused."""
    return {
        "model": {
            "name": "tiny",
            "path": str(REPO / ".gpupool/models/tiny"),
            "max_model_len_tokens": 512,
        },
        "engines": {
            "launcher": "local",
            "local": {
                "count": 2,
                "base_port": NEW_USER_ENGINE_PORTS.start,
                "run_dir": str(tmp_path / "run"),
            },
        },
        "pools": {
            "agent": {"classes": ["agent"], "share": {"initial_frac": 0.5}},
            "normal": {"classes": ["normal"], "share": {"initial_frac": 0.5}},
        },
        "tenants": [{"name": TENANT, "api_key_env": "GPUPOOL_TEST_SECRET_KEY"}],
        "router": {
            "port": router_port,
            "log_level": "debug",
            "ledger_path": str(tmp_path / "ledger.sqlite"),
            "state_path": str(tmp_path / "state.json"),
        },
    }


def _send_requests_carrying_the_markers(url: str, key: str, prompt: str) -> None:
    """Every kind of request whose prompt or key could reach a log: chat (through the OpenAI
    client, exactly 3 tokens out), chat streaming, a streamed completion, an agent step with
    tools (run RUN_ID), a prompt over the context length (400), a wrong key that also carries
    the key's marker (401), a path that does not exist (404)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key)
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=3
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    auth = {"Authorization": f"Bearer {key}"}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4}
    with httpx.Client(base_url=url, timeout=60) as http:
        with http.stream(
            "POST", "/v1/chat/completions", json={**chat, "stream": True}, headers=auth
        ) as resp:
            assert resp.status_code == 200
            assert b"[DONE]" in resp.read()
        completion = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "stream": True}
        with http.stream("POST", "/v1/completions", json=completion, headers=auth) as resp:
            assert resp.status_code == 200
            resp.read()
        tool = {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
        }
        agent = http.post(
            "/v1/chat/completions",
            json={**chat, "tools": [tool]},
            headers={**auth, "x-gpupool-run-id": RUN_ID},
        )
        assert agent.status_code == 200, agent.text
        too_long = {**chat, "messages": [{"role": "user", "content": (prompt + " ") * 200}]}
        refused = http.post("/v1/chat/completions", json=too_long, headers=auth)
        assert refused.status_code == 400, refused.text
        bad_key = http.post(
            "/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {key}-wrong"}
        )
        assert bad_key.status_code == 401, bad_key.text
        missing = http.post("/v1/nonexistent", json=chat, headers=auth)
        assert missing.status_code == 404, missing.text


def test_two_cpu_engines_with_a_tenant_serve_log_no_secret_and_die_with_a_killed_parent(
    tmp_path: Path,
) -> None:
    """One stack on a new user's config (see `_new_user_config`), checked in phases:

    1. Both engines start. Before gpupool chose the CPU KV size each engine reserved 92 % of
       memory and the second one died; the log says which dtype and KV size it chose.
    2. Requests whose prompt carries a marker, for a tenant whose key carries another, are
       served (`_send_requests_carrying_the_markers`).
    3. Around the router, each engine refuses a request without its own key (401, on
       /invocations too); the tenant's key is in no engine process's environment or command
       line.
    4. `kill -9` of `gpupool up`: every engine process (each engine's whole tree) dies within
       60 s. Survivors are killed, so none outlives the test.
    5. Neither marker is in anything gpupool or its engines wrote: the router's stdout and
       stderr (at debug), every file under run_dir (engine logs), the ledger and its WAL, the
       state files. So that the grep looks where the records are: the router logged at debug,
       the engine logs are not empty, and the ledger holds the tenant and the run id (a
       response's record is committed before its final bytes, so the kill loses none).
    """
    key_marker = "zqKEYMARK" + secrets.token_hex(4)
    prompt_marker = "zqPROMPTMARK" + secrets.token_hex(4)
    key = f"sk-{key_marker}-{secrets.token_hex(8)}"
    run_dir = tmp_path / "run"
    config = _new_user_config(tmp_path, _free_port())
    config_path = tmp_path / "two.yaml"
    config_path.write_text(yaml.safe_dump(config))
    seed_vllm_flags(run_dir)
    url = f"http://127.0.0.1:{config['router']['port']}"
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [GPUPOOL, "up", "--config", str(config_path)],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "GPUPOOL_TEST_SECRET_KEY": key},
        )
    try:
        # 1. both engines start; the log says what gpupool chose for them
        wait_ready(url, proc, log, timeout_s=400, interval_s=0.2)
        text = log.read_text()
        assert "engine dtype " in text and "KV cache: " in text and "split across 2" in text
        assert len(_engines_on(NEW_USER_ENGINE_PORTS)) == 2

        # 2. requests carrying the markers are served
        _send_requests_carrying_the_markers(url, key, f"please repeat {prompt_marker} back to me")

        # 3. around the router: refused without the engine's key; the tenant's key not handed on
        for port in NEW_USER_ENGINE_PORTS:
            direct = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                timeout=30,
            )
            assert direct.status_code == 401, direct.text
            assert httpx.post(f"http://127.0.0.1:{port}/invocations", timeout=30).status_code == 401
        pid_files = sorted(run_dir.glob("engine-*.pid"))
        assert len(pid_files) == 2, pid_files
        for pid_file in pid_files:
            engine = psutil.Process(int(pid_file.read_text().split()[0]))
            for each in [engine, *engine.children(recursive=True)]:
                seen = Path(f"/proc/{each.pid}/environ").read_bytes()
                seen += Path(f"/proc/{each.pid}/cmdline").read_bytes()
                assert key_marker.encode() not in seen, f"the tenant key reached pid {each.pid}"
    finally:
        # 4. kill -9 of gpupool (also when a phase above failed: nothing may outlive the test)
        engines = _engines_on(NEW_USER_ENGINE_PORTS)
        tree = [p for e in engines for p in _process_tree(e.pid)]
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _engine_children_alive(tree):
            time.sleep(0.2)
        survivors = _engine_children_alive(tree)
        for pid in survivors:  # do not leave them behind for the rest of the suite
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert len(engines) == 2, "both engines were alive when gpupool was killed"
    assert survivors == [], "engines outlived a SIGKILLed gpupool"

    # 5. no marker in anything written, and the grep looks where the records are
    text = log.read_text()
    assert "DEBUG router.admission.admitter" in text, "the router did not log at debug"
    engine_logs = [p for p in run_dir.rglob("*") if p.is_file() and p.suffix == ".log"]
    assert len(engine_logs) >= 2 and all(p.stat().st_size > 0 for p in engine_logs), engine_logs
    written = [log, *(p for p in tmp_path.rglob("*") if p.is_file() and p != config_path)]
    assert {"ledger.sqlite", "ledger.sqlite-wal"} <= {p.name for p in written}, written
    for p in written:  # read before sqlite3 opens the ledger (which may fold the WAL in)
        data = p.read_bytes()
        for marker in (key_marker, prompt_marker):
            assert marker.encode() not in data, f"{marker} found in {p}"
    with contextlib.closing(sqlite3.connect(tmp_path / "ledger.sqlite")) as db:
        tenants = {row[0] for row in db.execute("SELECT DISTINCT tenant FROM requests")}
        runs = {row[0] for row in db.execute("SELECT DISTINCT run_id FROM requests")}
    assert tenants == {TENANT}
    assert RUN_ID in runs


def test_bad_config_exits_2_with_a_clear_message(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "pools": {"normal": {"classes": ["normal"], "share": {"initial_frac": 2}}},
                "engines": {"launcher": "static"},
            }
        )
    )
    commands = (
        ["check-config", str(bad)],
        ["up", "--config", str(bad)],
        ["serve", "--config", str(bad)],
    )
    # all three at once (each is mostly its own imports: one core each)
    procs = [
        subprocess.Popen(
            [GPUPOOL, *command],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for command in commands
    ]
    try:
        for command, proc in zip(commands, procs, strict=True):
            _, stderr = proc.communicate(timeout=60)
            assert proc.returncode == 2, (command, stderr)
            assert "pools.normal.share.initial_frac" in stderr
            assert "engines" in stderr and "Traceback" not in stderr
    finally:
        for proc in procs:  # none outlives the test, also when one failed
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
