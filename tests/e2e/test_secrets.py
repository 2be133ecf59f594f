"""No secret reaches a log: after `gpupool up` (one real CPU engine, router log level debug)
serves requests whose prompts carry a marker, for a tenant whose API key carries another,
neither marker appears in anything gpupool or its engine wrote: the router's stdout and
stderr, every file under `engines.local.run_dir` (engine logs), the ledger and its WAL, the
state file. Requests: chat streaming and not, a completion, an agent step with tools, a prompt
over the context length (the engine's 400), a wrong key that also carries the marker, a 404
path. The engine's environment and command line are checked for the key too. The ledger is
checked to hold the tenant's name and the run id, and the engine log to be non-empty, so that
the grep looks where the records are."""

from __future__ import annotations

import os
import secrets
import signal
import sqlite3
import subprocess
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from tests.e2e.stack import GPUPOOL, REPO, seed_vllm_flags, wait_ready

pytestmark = pytest.mark.e2e

ENGINE_PORT = 8790
ROUTER_PORT = 8792


def test_prompt_and_key_markers_reach_no_log(tmp_path: Path) -> None:
    key_marker = "zqKEYMARK" + secrets.token_hex(4)
    prompt_marker = "zqPROMPTMARK" + secrets.token_hex(4)
    key = f"sk-{key_marker}-{secrets.token_hex(8)}"
    run_dir = tmp_path / "run"
    ledger = tmp_path / "ledger.sqlite"
    config = {
        "model": {
            "name": "tiny",
            "path": str(REPO / ".gpupool/models/tiny"),
            "max_model_len_tokens": 512,
        },
        "engines": {
            "launcher": "local",
            "local": {
                "count": 1,
                "base_port": ENGINE_PORT,
                "kv_cache_bytes": 32 * 2**20,
                "run_dir": str(run_dir),
            },
        },
        "pools": {
            "agent": {"classes": ["agent"], "share": {"initial_frac": 0.5}},
            "normal": {"classes": ["normal"], "share": {"initial_frac": 0.5}},
        },
        "tenants": [{"name": "team-secret", "api_key_env": "GPUPOOL_TEST_SECRET_KEY"}],
        "router": {
            "port": ROUTER_PORT,
            "log_level": "debug",
            "ledger_path": str(ledger),
            "state_path": str(tmp_path / "state.json"),
        },
    }
    path = tmp_path / "secrets.yaml"
    path.write_text(yaml.safe_dump(config))
    seed_vllm_flags(run_dir)
    url = f"http://127.0.0.1:{ROUTER_PORT}"
    log = tmp_path / "up.log"
    env = {**os.environ, "GPUPOOL_TEST_SECRET_KEY": key}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [GPUPOOL, "up", "--config", str(path)],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    auth = {"Authorization": f"Bearer {key}"}
    prompt = f"please repeat {prompt_marker} back to me"
    chat = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4}
    try:
        wait_ready(url, proc, log, timeout_s=300)
        with httpx.Client(base_url=url, timeout=60) as client:
            plain = client.post("/v1/chat/completions", json=chat, headers=auth)
            assert plain.status_code == 200, plain.text
            with client.stream(
                "POST", "/v1/chat/completions", json={**chat, "stream": True}, headers=auth
            ) as resp:
                assert resp.status_code == 200
                body = resp.read()
            assert b"[DONE]" in body
            completion = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "stream": True}
            with client.stream("POST", "/v1/completions", json=completion, headers=auth) as resp:
                assert resp.status_code == 200
                resp.read()
            tool = {
                "type": "function",
                "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
            }
            agent = client.post(
                "/v1/chat/completions",
                json={**chat, "tools": [tool]},
                headers={**auth, "x-gpupool-run-id": "run-secrets-1"},
            )
            assert agent.status_code == 200, agent.text
            too_long = client.post(
                "/v1/chat/completions",
                json={
                    **chat,
                    "messages": [{"role": "user", "content": (prompt + " ") * 200}],
                },
                headers=auth,
            )
            assert too_long.status_code == 400, too_long.text
            bad_key = client.post(
                "/v1/chat/completions",
                json=chat,
                headers={"Authorization": f"Bearer {key}-wrong"},
            )
            assert bad_key.status_code == 401, bad_key.text
            missing = client.post("/v1/nonexistent", json=chat, headers=auth)
            assert missing.status_code == 404, missing.text
        # the tenant's key is not handed to the engine either (environment, command line)
        (pid_file,) = run_dir.glob("engine-*.pid")
        engine = psutil.Process(int(pid_file.read_text().split()[0]))
        for proc_ in [engine, *engine.children(recursive=True)]:
            seen = Path(f"/proc/{proc_.pid}/environ").read_bytes()
            seen += Path(f"/proc/{proc_.pid}/cmdline").read_bytes()
            assert key_marker.encode() not in seen, f"the tenant key reached pid {proc_.pid}"
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=90)
    assert code == 0, log.read_text()
    # the router really logged at debug (router.log_level), so the grep below reads its debug
    # lines too (one per admitted request, with the request id, never the prompt or key)
    assert "DEBUG router.admitter" in log.read_text()

    engine_logs = [p for p in run_dir.rglob("*") if p.is_file() and p.suffix == ".log"]
    assert engine_logs and all(p.stat().st_size > 0 for p in engine_logs), engine_logs
    with sqlite3.connect(ledger) as db:
        tenants = {row[0] for row in db.execute("SELECT DISTINCT tenant FROM requests")}
        runs = {row[0] for row in db.execute("SELECT DISTINCT run_id FROM requests")}
    assert tenants == {"team-secret"}
    assert "run-secrets-1" in runs

    written = [log, *(p for p in tmp_path.rglob("*") if p.is_file() and p != path)]
    assert any(p.name.startswith("ledger.sqlite") for p in written)
    for p in written:
        data = p.read_bytes()
        for marker in (key_marker, prompt_marker):
            assert marker.encode() not in data, f"{marker} found in {p}"
