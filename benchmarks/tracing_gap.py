"""Benchmark: issue 29's bar, "the queue wait and engine time add up to the client-measured
latency within 5 ms", as a distribution over many requests on a real CPU vLLM engine.

    python -m benchmarks.tracing_gap [--requests 200] [--out DIR]

One real engine (the dev model under gpupool's `LocalLauncher`, exporting vLLM's own spans:
`observability.engine_traces`), `gpupool serve` in front of it with traces at ratio 1 to a
real OTLP/HTTP receiver in this process (`pools.testing.otlp_receiver`, decoding the
protobuf), and a client in a process of its own (this module with `--client`, so the
receiver's decoding never runs beside the client's timer). The client sends `--requests`
requests one at a time over one kept-alive connection, each with a `traceparent` of its own,
alternating plain chat requests (the normal pool) and agent-run steps (runs of five steps,
`x-gpupool-run-id`, the agent pool), and records the seconds around each (`perf_counter`,
request sent to body read). Then, per request, from its spans:

- `gap_ms`: client - (gpupool.admission.queue + gpupool.engine): the bar's figure, everything
  the client waited that is neither the queue nor the engine (the HTTP exchange, classify,
  governance, placement, settle);
- `outside_ms`: client - the server span (the HTTP exchange no span covers);
- `vllm_in_engine`: vLLM's `llm_request` span has the request's gpupool.engine span as parent.

Reported per kind: p50, p90, p99 and max of `gap_ms`, the share within 5 ms, p50 of
`outside_ms`, and the load average. Progress on stderr, the summary on stdout and in
`--out`/summary.json; nothing it starts outlives it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from benchmarks.engines import cpu_engines
from benchmarks.router_overhead.machine import describe, load_average
from pools.devmodel import is_dev_model, make_dev_model
from pools.launchers.engine_args import EngineTraces
from pools.testing.otlp_receiver import OtlpReceiver, ReceivedSpan
from pools.testing.router_process import RouterProcess, free_port

MODEL_DIR = Path(".gpupool/models/tiny")
KEY_ENV = "GPUPOOL_BENCH_ENGINE_KEY"
ROUTE = "POST /v1/chat/completions"
BAR_MS = 5.0
RUN_STEPS = 5


def _say(message: str) -> None:
    print(f"[tracing_gap] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the client (its own process)


class _Plain:
    """The standard library's `http.client` on one kept-alive connection: a client whose own
    work per request is small beside httpx's (the OpenAI SDK's), to tell the two apart."""

    def __init__(self, url: str) -> None:
        host, _, port = url.removeprefix("http://").partition(":")
        self._conn = http.client.HTTPConnection(host, int(port), timeout=120)

    def post(
        self, path: str, json: dict[str, Any], headers: dict[str, str] | None = None
    ) -> httpx.Response:
        self._conn.request(
            "POST",
            path,
            body=orjson.dumps(json),
            headers={"content-type": "application/json", **(headers or {})},
        )
        reply = self._conn.getresponse()
        return httpx.Response(reply.status, content=reply.read())

    def close(self) -> None:
        self._conn.close()


def _client(url: str, requests: int, out: Path, lib: str) -> None:
    """Send the requests one at a time; write [{trace_id, kind, client_s, status}]."""
    rows: list[dict[str, Any]] = []
    client: Any = httpx.Client(base_url=url, timeout=120) if lib == "httpx" else _Plain(url)
    with contextlib.closing(client):
        for i in range(5):  # warm: the connection, the router's and the engine's first paths
            client.post("/v1/chat/completions", json=_body(f"warm {i}"))
        run = 0
        for i in range(requests):
            trace_id = os.urandom(16).hex()
            headers = {"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"}
            kind = "chat" if i % 2 == 0 else "run_step"
            if kind == "run_step":
                headers["x-gpupool-run-id"] = f"run-{run // RUN_STEPS}"
                run += 1
            started = time.perf_counter()
            reply = client.post("/v1/chat/completions", json=_body(f"q {i}"), headers=headers)
            took_s = time.perf_counter() - started
            rows.append(
                {
                    "trace_id": trace_id,
                    "kind": kind,
                    "client_s": took_s,
                    "status": reply.status_code,
                }
            )
    out.write_text(json.dumps(rows))


def _body(text: str) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 8}


# ------------------------------------------------------------------ the run


def _router_config(path: Path, engine_url: str, receiver_url: str) -> Path:
    config = {
        "model": {"name": "tiny", "path": str(MODEL_DIR), "max_model_len_tokens": 2048},
        "engines": {"launcher": "static", "static": {"urls": [engine_url], "api_key_env": KEY_ENV}},
        "pools": {
            "agent": {"classes": ["agent"], "share": {"initial_frac": 0.5}},
            "normal": {"classes": ["normal"], "share": {"initial_frac": 0.5}},
        },
        "router": {
            "ledger_path": str(path.parent / "ledger.sqlite"),
            "state_path": str(path.parent / "state.json"),
        },
        "observability": {"otlp_endpoint": receiver_url, "export_interval_s": 0.2},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _measure(row: dict[str, Any], spans: list[ReceivedSpan]) -> dict[str, Any]:
    by_name = {s.name: s for s in spans if s.resource.get("service.name") == "gpupool"}
    server, engine = by_name[ROUTE], by_name["gpupool.engine"]
    queue = by_name["gpupool.admission.queue"]
    vllm = [s for s in spans if s.name == "llm_request"]
    client_s = row["client_s"]
    return {
        **row,
        "pool": server.attributes.get("gpupool.pool"),
        "gap_ms": (client_s - queue.duration_s - engine.duration_s) * 1e3,
        "outside_ms": (client_s - server.duration_s) * 1e3,
        "queue_ms": queue.duration_s * 1e3,
        "engine_ms": engine.duration_s * 1e3,
        "vllm_in_engine": len(vllm) == 1 and vllm[0].parent_span_id == engine.span_id,
        "children_ms": {
            s.name: round(s.duration_s * 1e3, 3) for s in by_name.values() if s is not server
        },
    }


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("chat", "run_step", "all"):
        mine = [r for r in rows if kind in ("all", r["kind"])]
        gaps = [r["gap_ms"] for r in mine]
        out[kind] = {
            "requests": len(mine),
            "gap_ms_p50": round(statistics.median(gaps), 3),
            "gap_ms_p90": round(_q(gaps, 0.9), 3),
            "gap_ms_p99": round(_q(gaps, 0.99), 3),
            "gap_ms_max": round(max(gaps), 3),
            "within_5ms": round(sum(g <= BAR_MS for g in gaps) / len(gaps), 4),
            "outside_ms_p50": round(statistics.median(r["outside_ms"] for r in mine), 3),
            "engine_ms_p50": round(statistics.median(r["engine_ms"] for r in mine), 3),
            "vllm_span_under_engine": sum(r["vllm_in_engine"] for r in mine),
        }
    return out


def run(requests: int, out_dir: Path, client_lib: str = "httpx") -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    if not is_dev_model(MODEL_DIR):
        make_dev_model(MODEL_DIR, "tiny")
    os.environ.setdefault(KEY_ENV, "bench-" + os.urandom(8).hex())
    before = load_average()
    with tempfile.TemporaryDirectory(prefix="tracing-gap-") as tmp_name:
        tmp = Path(tmp_name)
        receiver = OtlpReceiver()
        router: RouterProcess | None = None
        launcher = cpu_engines(
            MODEL_DIR,
            count=1,
            port=free_port(),
            key_env=KEY_ENV,
            run_dir=tmp / "engines",
            max_num_seqs=8,
            progress=_say,
            max_model_len_tokens=2048,
            traces=EngineTraces(
                url=receiver.url + "/v1/traces",
                service_name="gpupool-vllm",
                export_interval_s=0.2,
            ),
        )
        loop = asyncio.new_event_loop()
        try:
            (engine,) = loop.run_until_complete(launcher.start())
            router = RouterProcess(
                _router_config(tmp / "gpupool.yaml", engine.url, receiver.url),
                tmp / "router.log",
            )
            router.wait_ready(120)
            _say(f"engine and router ready; {requests} requests from a client process")
            client_out = tmp / "client.json"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.tracing_gap",
                    "--client",
                    router.url,
                    "--requests",
                    str(requests),
                    "--client-out",
                    str(client_out),
                    "--client-lib",
                    client_lib,
                ],
                check=True,
                timeout=60 + requests * 5,
            )
            sent = json.loads(client_out.read_text())
            failed = [r for r in sent if r["status"] != 200]
            if failed:
                raise SystemExit(f"{len(failed)} requests failed: {failed[:3]}")
            wanted = {r["trace_id"] for r in sent}
            receiver.wait_for(
                lambda spans: (
                    len(
                        {s.trace_id for s in spans if s.name == ROUTE}
                        & {s.trace_id for s in spans if s.name == "llm_request"}
                        & wanted
                    )
                    == len(wanted)
                ),
                timeout_s=60,
            )
            rows = [_measure(r, receiver.trace(r["trace_id"])) for r in sent]
        finally:
            if router is not None:
                router.stop()
            loop.run_until_complete(launcher.aclose())
            loop.close()
            receiver.close()
    result = {
        "command": " ".join(["python -m benchmarks.tracing_gap", *sys.argv[1:]]),
        "machine": describe(),
        "load_average_before": before,
        "load_average_after": load_average(),
        "client_lib": client_lib,
        "bar_ms": BAR_MS,
        "summary": _summary(rows),
        "requests": rows,
    }
    (out_dir / "summary.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/tracing-gap"))
    parser.add_argument(
        "--client-lib",
        choices=("httpx", "http.client"),
        default="httpx",
        help="the client's HTTP library: httpx (what the OpenAI SDK uses; default) or the"
        " standard library's http.client (less work of its own per request)",
    )
    parser.add_argument("--client", help=argparse.SUPPRESS)  # the client process: router URL
    parser.add_argument("--client-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.requests < 2:
        parser.error("--requests: at least 2 (one of each kind)")
    if args.client:
        _client(args.client, args.requests, args.client_out, args.client_lib)
        return 0
    result = run(args.requests, args.out, args.client_lib)
    print(json.dumps({k: v for k, v in result.items() if k != "requests"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
