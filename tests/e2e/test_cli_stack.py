"""The whole stack through the CLI, as a newcomer runs it: `gpupool up` on the embedded default
(three real CPU engines), the official OpenAI client through it, Ctrl-C, and no engine left
behind; also when gpupool itself is killed; two CPU engines configured without a KV size; and
bad configs exiting 2."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

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


def test_up_on_the_default_serves_openai_and_ctrl_c_leaves_nothing(tmp_path: Path) -> None:
    port = _free_port()
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [GPUPOOL, "up", "--port", str(port)], cwd=REPO, stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, log, timeout_s=400)
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
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=90)
    assert code == 0, log.read_text()
    assert "engines stopped" in log.read_text()
    assert _engines_on(range(8100, 8103)) == []
    assert _engine_children_alive(tree) == [], "an engine process outlived gpupool"


def test_engines_die_with_a_killed_parent(tmp_path: Path) -> None:
    config = {
        "model": {
            "name": "tiny",
            "path": str(REPO / ".gpupool/models/tiny"),
            "max_model_len_tokens": 2048,
        },
        "engines": {
            "launcher": "local",
            "local": {
                "count": 1,
                "base_port": 8175,
                "kv_cache_bytes": 32 * 2**20,
                "run_dir": str(tmp_path / "run"),
            },
        },
        "pools": {
            "agent": {"classes": ["agent"], "share": {"initial_frac": 0.5}},
            "normal": {"classes": ["normal"], "share": {"initial_frac": 0.5}},
        },
        "router": {"port": _free_port(), "ledger_path": str(tmp_path / "ledger.sqlite")},
    }
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump(config))
    seed_vllm_flags(tmp_path / "run")
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [GPUPOOL, "up", "--config", str(path)], cwd=REPO, stdout=out, stderr=subprocess.STDOUT
        )
    wait_ready(f"http://127.0.0.1:{config['router']['port']}", proc, log, timeout_s=300)
    (engine,) = _engines_on(range(8175, 8176))
    tree = _process_tree(engine.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _engine_children_alive(tree):
        time.sleep(0.5)
    survivors = _engine_children_alive(tree)
    for pid in survivors:  # do not leave them behind for the rest of the suite
        os.kill(pid, signal.SIGKILL)
    assert survivors == [], "engines outlived a SIGKILLed gpupool"


def test_two_cpu_engines_without_a_kv_size_start_closed_and_log_no_prompt(
    tmp_path: Path,
) -> None:
    """A new user's config: `local: {count: 2}`, no kv_cache_bytes, no dtype. Before gpupool
    chose the CPU KV size each engine reserved 92 % of memory and the second one died. Both
    start; each refuses a request without its key; the prompt reaches no log."""
    marker = "zq-e2e-prompt-marker-51c9"
    config = {
        "model": {"name": "tiny", "path": str(REPO / ".gpupool/models/tiny")},
        "engines": {
            "launcher": "local",
            "local": {"count": 2, "base_port": 8180, "run_dir": str(tmp_path / "run")},
        },
        "pools": {
            "agent": {"classes": ["agent"], "share": {"initial_frac": 0.5}},
            "normal": {"classes": ["normal"], "share": {"initial_frac": 0.5}},
        },
        "router": {
            "port": _free_port(),
            "ledger_path": str(tmp_path / "ledger.sqlite"),
            "state_path": str(tmp_path / "state.json"),
        },
    }
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(config))
    seed_vllm_flags(tmp_path / "run")
    url = f"http://127.0.0.1:{config['router']['port']}"
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [GPUPOOL, "up", "--config", str(path)], cwd=REPO, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_ready(url, proc, log, timeout_s=400)
        text = log.read_text()
        assert "engine dtype " in text and "KV cache: " in text and "split across 2" in text
        assert len(_engines_on(range(8180, 8182))) == 2
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": marker}], max_tokens=3
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 3
        for port in (8180, 8181):  # around the router: refused without the engine's key
            direct = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                timeout=30,
            )
            assert direct.status_code == 401, direct.text
            assert httpx.post(f"http://127.0.0.1:{port}/invocations", timeout=30).status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=90)
    assert code == 0, log.read_text()
    for written in [log, *(tmp_path / "run").glob("*.log")]:
        assert marker not in written.read_text(errors="replace"), written


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
    for command in (
        ["check-config", str(bad)],
        ["up", "--config", str(bad)],
        ["serve", "--config", str(bad)],
    ):
        result = subprocess.run(
            [GPUPOOL, *command], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 2, (command, result.stderr)
        assert "pools.normal.share.initial_frac" in result.stderr
        assert "engines" in result.stderr and "Traceback" not in result.stderr
