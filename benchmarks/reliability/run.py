"""Reliability report: the fault scenarios of `benchmarks/reliability/faults.py` with heavier
load than the integration tests, on three real CPU vLLM engines (the tiny dev model) started
here, and `gpupool up` with its own three engines for the graceful stop.

    flock /tmp/gpupool-heavy.lock .venv/bin/python -m benchmarks.reliability.run \\
        --out benchmarks/results/reliability-YYYY-MM-DD

Writes `report.json` (every number, per round) and `report.md` (the tables and the checks that
held or did not). Exit code 0 when every check held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.reliability import faults
from pools.config import parse_config
from pools.devmodel import is_dev_model, make_dev_model
from pools.launchers import InstanceSpec, LocalLauncher

MODEL_DIR = Path(".gpupool/models/tiny").resolve()
KEY_ENV = "GPUPOOL_RELIABILITY_ENGINE_KEY"
JsonDict = dict[str, Any]


def _say(message: str) -> None:
    print(f"[reliability] {message}", file=sys.stderr, flush=True)


class LocalEngines:
    """Three engines under gpupool's own `LocalLauncher` (so it restarts a killed one)."""

    def __init__(self, base_port: int, run_dir: Path, max_num_seqs: int) -> None:
        config = parse_config(
            {
                "model": {"name": "tiny", "path": str(MODEL_DIR), "max_model_len_tokens": 4096},
                "engines": {
                    "launcher": "local",
                    "local": {
                        "count": 3,
                        "base_port": base_port,
                        "kv_cache_bytes": 64 * 1024 * 1024,
                        "api_key_env": KEY_ENV,
                        "run_dir": str(run_dir),
                        "restart_backoff_s": 1.0,
                        "startup_timeout_s": 400,
                        "vllm_args": ["--max-num-seqs", str(max_num_seqs)],
                    },
                },
                "pools": {"normal": {"classes": ["normal", "agent"], "share": {"initial_frac": 1}}},
            }
        )
        self._launcher = LocalLauncher(
            config.engines.local,
            config.model,
            progress=lambda m: _say(f"engines: {m}"),
            gpu_count=0,
        )
        self._instances: list[InstanceSpec] = []

    @property
    def instances(self) -> list[InstanceSpec]:
        return self._instances

    @property
    def launcher(self) -> LocalLauncher:
        return self._launcher

    async def start(self) -> None:
        self._instances = await self._launcher.start()

    async def aclose(self) -> None:
        await self._launcher.aclose()

    def kill(self, index: int, sig: int = signal.SIGKILL) -> int:
        pid = self._launcher.engines[index].pid
        assert pid is not None
        os.killpg(pid, sig)
        return pid


# ---------------------------------------------------------------------------------------------
# Checks: the same properties the integration tests assert, as named booleans
# ---------------------------------------------------------------------------------------------

Check = tuple[str, Callable[[JsonDict], bool]]

CHECKS: dict[str, list[Check]] = {
    "engine_kill": [
        (
            "streams cut by the kill end with an OpenAI error event and [DONE]",
            lambda r: (
                r["in_flight_on_victim"]["ended_with_openai_error_event"]
                == r["in_flight_on_victim"]["failed"]
                and r["in_flight_on_victim"]["ended_with_done"] == r["in_flight_on_victim"]["sent"]
            ),
        ),
        (
            "0 lost among requests not started on the killed engine (served, or a 429)",
            lambda r: r["not_started_on_victim"]["lost"] == 0,
        ),
        ("the launcher restarted the engine", lambda r: bool(r["restarted"])),
        (
            "the restarted engine serves traffic again",
            lambda r: r["probes_until_served_by_it"] >= 1 and r["probe_failures"] == 0,
        ),
    ],
    "engine_freeze": [
        (
            "requests on the frozen engine end by their deadline (within 1.5 s)",
            lambda r: (
                r["on_frozen_engine"]["ended_by_deadline"] == r["on_frozen_engine"]["sent"]
                and (r["on_frozen_engine"]["ended_after_deadline_s"]["max"] or 0) <= 1.5
            ),
        ),
        (
            "it leaves rotation and gets nothing after",
            lambda r: (
                r["seconds"]["stop_to_out_of_rotation"] is not None
                and r["sent_after_it_left_rotation"]["dispatched_to_it"] == 0
            ),
        ),
        ("0 lost elsewhere (served, or a 429)", lambda r: r["elsewhere"]["lost"] == 0),
        (
            "after SIGCONT it serves again and holds no abandoned sequence",
            lambda r: (
                r["probes_until_served_by_it"] >= 1
                and r["seconds"]["engine_drained_after_healthy"] is not None
            ),
        ),
    ],
    "slow_metrics": [
        (
            "nothing dispatched to the engine while its telemetry was stale",
            lambda r: r["dispatches_to_slow_engine"]["while_its_telemetry_was_stale"] == 0,
        ),
        (
            "the other engines' telemetry stayed fresh",
            lambda r: all(
                a["share_stale"] == 0
                for i, a in r["telemetry_age_s_while_slow"].items()
                if i != r["victim"]
            ),
        ),
        ("every request served", lambda r: r["all"]["failed"] == 0),
        ("it gets traffic again once fast", lambda r: r["dispatches_to_slow_engine"]["after"] > 0),
    ],
    "router_kill": [
        (
            "the ledger lost only records of the last flush interval",
            lambda r: r["ledger"]["lost_beyond_one_flush_interval"] == 0,
        ),
        (
            "the engines dropped the dead router's sequences",
            lambda r: r["engines_drained_s"] is not None,
        ),
        (
            "the next start serves and the run's steps continue",
            lambda r: (
                r["restart"]["served_after"] == r["restart"]["sent_after"]
                and r["restart"]["run_last_stored_step"] is not None
                and r["restart"]["run_next_step"] == r["restart"]["run_last_stored_step"] + 1
            ),
        ),
    ],
    "graceful_stop": [
        (
            "new connections refused while draining",
            lambda r: r["new_connections_while_draining"]["answered"] == 0,
        ),
        (
            "every in-flight stream and queued request finished within the grace period",
            lambda r: (
                r["all"]["failed"] == 0
                and (r["last_stream_ended_s_after_sigterm"] or 0) <= r["grace_s"]
            ),
        ),
        ("exit code 0", lambda r: r["exit_code"] == 0),
        ("every served request is in the ledger", lambda r: r["ledger"]["records_lost"] == 0),
        (
            "(`up`) its engines stopped after the router",
            lambda r: (
                "engines" not in r
                or (
                    r["engines"]["alive_after_exit"] == 0
                    and bool(r["engines"]["stopped_after_shutdown"])
                )
            ),
        ),
    ],
}


def _checks(result: JsonDict) -> list[JsonDict]:
    out = []
    for name, check in CHECKS[result["scenario"]]:
        try:
            held = bool(check(result))
        except (KeyError, TypeError):
            held = False
        out.append({"check": name, "held": held})
    return out


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


async def _scenario(results: list[JsonDict], name: str, run: Any) -> None:
    _say(f"{name} ...")
    started = time.monotonic()
    try:
        result: JsonDict = await run
    except Exception as err:  # recorded, and the next scenario still runs
        result = {"scenario": name, "error": f"{type(err).__name__}: {err}"}
    result["took_s"] = round(time.monotonic() - started, 1)
    if "error" not in result:
        result["checks"] = _checks(result)
    _say(f"{name}: {json.dumps(result)}")
    results.append(result)


async def _main(args: argparse.Namespace) -> JsonDict:
    if not is_dev_model(MODEL_DIR):
        make_dev_model(MODEL_DIR, "tiny")
    os.environ.setdefault(KEY_ENV, "reliability-" + os.urandom(8).hex())
    work = Path(tempfile.mkdtemp(prefix="gpupool-reliability-"))
    load = faults.Load(
        streams=args.streams,
        queued=args.queued,
        later=args.later,
        max_tokens=args.max_tokens,
        slots=args.slots,
        plain=args.plain,
    )
    engines = LocalEngines(args.engine_port, work / "engines", args.engine_max_num_seqs)
    setup = faults.Setup(engines, work, MODEL_DIR, KEY_ENV, say=_say)
    results: list[JsonDict] = []
    started = time.time()
    await engines.start()
    try:
        for n in range(1, args.rounds + 1):
            setup = faults.Setup(engines, work / f"round-{n}", MODEL_DIR, KEY_ENV, say=_say)
            await _scenario(results, "engine_kill", faults.engine_kill(setup, load))
            await _scenario(
                results,
                "engine_freeze",
                faults.engine_freeze(setup, load, deadline_s=args.deadline_s),
            )
            await _scenario(
                results,
                "slow_metrics",
                faults.slow_metrics(setup, clients=args.slow_clients),
            )
            await _scenario(
                results,
                "router_kill",
                faults.router_kill(setup, clients=args.streams, load_s=args.router_load_s),
            )
            await _scenario(
                results, "graceful_stop", faults.graceful_stop(setup, load, mode="serve")
            )
    finally:
        await engines.aclose()
    if not args.skip_up:
        await _scenario(
            results,
            "graceful_stop",
            faults.graceful_stop(setup, load, mode="up", engine_count=3),
        )
    report: JsonDict = {
        "benchmark": "reliability",
        "command": "python -m benchmarks.reliability.run " + " ".join(sys.argv[1:]),
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "setup": {
            "engines": "3 CPU vLLM engines, tiny dev model, 64 MiB KV cache each, "
            f"--max-num-seqs {args.engine_max_num_seqs}, started by gpupool's LocalLauncher",
            "router": "gpupool serve (static URLs) per scenario; gpupool up for the last one",
            "load": asdict(load),
            "deadline_s": args.deadline_s,
            "rounds": args.rounds,
        },
        "results": results,
    }
    return report


def _write(out: Path, report: JsonDict) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(markdown(report))
    print((out / "report.md").read_text())
    results: list[JsonDict] = report["results"]
    held = all(c["held"] for r in results for c in r.get("checks", [{"held": False}]))
    return 0 if held else 1


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------


def _kinds(tally: JsonDict) -> str:
    kinds = tally.get("failed_by_kind") or {}
    return ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) or "none"


def _row(*cells: object) -> str:
    return "| " + " | ".join("–" if c is None else str(c) for c in cells) + " |"


def markdown(report: JsonDict) -> str:
    setup = report["setup"]
    load = setup["load"]
    results: list[JsonDict] = report["results"]
    by: dict[str, list[JsonDict]] = {}
    for r in results:
        by.setdefault(r["scenario"], []).append(r)
    lines = [
        "# Reliability: faults on real CPU engines under load",
        "",
        f"Command: `{report['command']}` (started {report['started_at']}; "
        f"{report['machine']['cpus']} CPUs, {report['machine']['platform']}).",
        "",
        f"{setup['engines']}. {setup['router']}. Load per engine-fault scenario: "
        f"{load['streams']} concurrent streams, then {load['plain']} non-streaming requests, "
        f"fill the normal pool (the router admits {load['slots']} per engine on its two "
        f"engines), {load['queued']} more streams wait in its queue, {load['later']} more "
        f"arrive after the fault; each an `ignore_eos` chat completion of "
        f"{load['max_tokens']} tokens. {setup['rounds']} round(s).",
        "",
        "## Checks",
        "",
        "| scenario | round | check | held |",
        "| --- | --- | --- | --- |",
    ]
    for name, rs in by.items():
        for n, r in enumerate(rs, 1):
            label = name + (f" ({r['mode']})" if "mode" in r else "")
            if "error" in r:
                lines.append(_row(label, n, f"scenario failed: {r['error']}", "no"))
                continue
            for c in r["checks"]:
                lines.append(_row(label, n, c["check"], "yes" if c["held"] else "**NO**"))
    lines += ["", "## kill -9 of an engine", ""]
    lines += [
        "| round | sent | streams on it | their errors | not started on it | lost / 429 | "
        "retried elsewhere (non-streaming) | engine back (s) | router healthy (s) | "
        "serves again (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n, r in enumerate(by.get("engine_kill", []), 1):
        if "error" in r:
            continue
        f, s, t = r["in_flight_on_victim"], r["not_started_on_victim"], r["seconds"]
        lines.append(
            _row(
                n,
                r["all"]["sent"],
                f["sent"],
                _kinds(f),
                s["sent"],
                f"{s['lost']} / {s['refused_429']}",
                f"{r['retried_on_another_engine']['served']}/"
                f"{r['retried_on_another_engine']['requests']} served "
                f"({r['retried_on_another_engine']['non_streaming']})",
                t["kill_to_engine_healthy"],
                t["kill_to_router_healthy"],
                t["kill_to_first_request_served_by_it"],
            )
        )
    lines += [
        "",
        "Streams on the killed engine cannot be saved (the client already has part of the "
        'answer); each ends with an OpenAI-shaped `data: {"error": ...}` event and '
        "`data: [DONE]`. A request that had sent no byte to its client is retried on another "
        "engine: non-streaming requests cut mid-generation, and queued requests dispatched to "
        "the dead engine before the router saw it die (reset or refused connections).",
        "",
        "## SIGSTOP of an engine",
        "",
        "| round | sent | on the frozen engine | ended after deadline (s, min–max) | "
        "elsewhere: sent / lost / 429 | out of rotation (s) | sent after / to it | "
        "back after SIGCONT (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n, r in enumerate(by.get("engine_freeze", []), 1):
        if "error" in r:
            continue
        f, t = r["on_frozen_engine"], r["seconds"]
        late = f["ended_after_deadline_s"]
        lines.append(
            _row(
                n,
                r["all"]["sent"],
                f"{f['sent']} ({_kinds(f)})",
                f"{late['min']}–{late['max']}",
                f"{r['elsewhere']['sent']} / {r['elsewhere']['lost']} / "
                f"{r['elsewhere']['refused_429']}",
                t["stop_to_out_of_rotation"],
                f"{r['sent_after_it_left_rotation']['sent']} / "
                f"{r['sent_after_it_left_rotation']['dispatched_to_it']}",
                t["cont_to_first_request_served_by_it"],
            )
        )
    lines += [
        "",
        f"Every request carried `x-gpupool-deadline-ms: {int(setup['deadline_s'] * 1000)}`. "
        "A frozen engine still accepts TCP connections, so what was on it waits for the "
        "deadline (measured from the client's send, so it includes the router's accept delay "
        "under load); the scrapes time out and it is marked unhealthy. With half the pool "
        "frozen, admission may refuse requests whose deadline it predicts cannot be met "
        "(429 `deadline_unmeetable`, retryable): counted apart from 'lost'.",
        "",
        "## Slow /metrics (stale counts as full)",
        "",
        "| round | requests / failed | delay (s) | stale after (s) | its time stale | "
        "dispatches to it: before / while slow / after | while stale | "
        "other engines' max telemetry age (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n, r in enumerate(by.get("slow_metrics", []), 1):
        if "error" in r:
            continue
        d = r["dispatches_to_slow_engine"]
        others = [a["max"] for i, a in r["telemetry_age_s_while_slow"].items() if i != r["victim"]]
        lines.append(
            _row(
                n,
                f"{r['all']['sent']} / {r['all']['failed']}",
                r["metrics_delay_s"],
                r["stale_after_s"],
                f"{r['slow_engine_share_of_time_stale']:.0%}",
                f"{d['before']} / {d['while_slow']} / {d['after']}",
                d["while_its_telemetry_was_stale"],
                max(others, default=None),
            )
        )
    lines += [
        "",
        "A TCP proxy in front of each engine holds one engine's `GET /metrics` for the delay "
        "(under the scrape timeout, so scrapes succeed and the engine stays healthy). A "
        "dispatch counts as 'while stale' when it reached the proxy more than `stale_after_s` "
        "+ 0.35 s after the last /metrics answer began flowing back.",
        "",
        "## kill -9 of the router",
        "",
        "| round | served before the kill | cut at the kill | ledger rows | records lost | "
        "oldest lost ended before the kill (s) | flush interval (s) | restart ready (s) | "
        "run steps: last stored → next |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n, r in enumerate(by.get("router_kill", []), 1):
        if "error" in r:
            continue
        led, rs = r["ledger"], r["restart"]
        lines.append(
            _row(
                n,
                r["served_before_kill"],
                r["in_flight_at_kill"],
                led["rows"],
                led["records_lost"],
                led["lost_ended_s_before_kill_max"],
                r["ledger_flush_interval_s"],
                rs["ready_s"],
                f"{rs['run_last_stored_step']} → {rs['run_next_step']}",
            )
        )
    lines += [
        "",
        "Closed-loop streaming clients on the normal pool plus one agent run stepping on the "
        "agent pool. 'Records lost': requests the client was served in full whose row is "
        "not in the ledger after the kill.",
        "",
        "## Graceful SIGTERM",
        "",
        "| round | mode | sent / failed | in flight at SIGTERM (streaming) | new connections "
        "tried / answered | last stream ended (s) | exit (s) | exit code | records lost | "
        "engines alive after |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n, r in enumerate(by.get("graceful_stop", []), 1):
        if "error" in r:
            continue
        new = r["new_connections_while_draining"]
        lines.append(
            _row(
                n,
                r["mode"],
                f"{r['all']['sent']} / {r['all']['failed']}",
                f"{r['in_flight_at_sigterm']} ({r['streaming_at_sigterm']})",
                f"{new['tried']} / {new['answered']}",
                r["last_stream_ended_s_after_sigterm"],
                r["exit_s_after_sigterm"],
                r["exit_code"],
                r["ledger"]["records_lost"],
                r.get("engines", {}).get("alive_after_exit"),
            )
        )
    lines += [
        "",
        f"Grace period: {results[-1].get('grace_s', 10) if results else 10} s (uvicorn's "
        "`timeout_graceful_shutdown` in `router/cli/stack.py`).",
        "",
        "## Commands",
        "",
        "```",
        "# this report (waits for other heavy runs on a shared machine)",
        f"flock /tmp/gpupool-heavy.lock .venv/bin/{report['command']}",
        "# re-render report.md from report.json (and the notes)",
        f".venv/bin/python -m benchmarks.reliability.run --out {report.get('out', 'DIR')} "
        f"--render --notes {report.get('out', 'DIR')}/notes.md",
        "# the same scenarios, smaller, as tests (part of `make test`)",
        "GPUPOOL_TEST_ENGINE_BASE_PORT=8550 .venv/bin/pytest -q "
        "tests/integration/test_faults_real.py",
        "```",
        "",
    ]
    if report.get("notes"):
        lines += [report["notes"].rstrip(), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=40)
    parser.add_argument("--plain", type=int, default=8, help="non-streaming requests")
    parser.add_argument("--queued", type=int, default=40)
    parser.add_argument("--later", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--slots", type=int, default=24, help="sequences the router admits")
    parser.add_argument("--engine-max-num-seqs", type=int, default=32)
    parser.add_argument("--deadline-s", type=float, default=20.0)
    parser.add_argument("--slow-clients", type=int, default=24)
    parser.add_argument("--router-load-s", type=float, default=6.0)
    parser.add_argument("--engine-port", type=int, default=8560)
    parser.add_argument("--skip-up", action="store_true", help="no `gpupool up` scenario")
    parser.add_argument("--notes", help="a markdown file appended to the report")
    parser.add_argument(
        "--render", action="store_true", help="only re-render report.md from report.json"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.render:
        report = json.loads((out / "report.json").read_text())
        report.setdefault("out", str(out))
    else:
        report = asyncio.run(_main(args))
        report["out"] = str(out)
    if args.notes:
        report["notes"] = Path(args.notes).read_text()
    return _write(out, report)


if __name__ == "__main__":
    raise SystemExit(main())
