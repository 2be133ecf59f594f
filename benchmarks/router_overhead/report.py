"""The results as Markdown: the side-by-side table, absolute latencies, gpupool against its
targets, the profile, the real-engine check, and how it was measured."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["RUST_CPU_RATIO_LIMIT", "against_rust", "check_gpupool", "render"]

# gpupool's targets (issue 5): added p50 at c=1, CPU per request, CPU per forwarded chunk.
TARGET_ADDED_P50_MS = 1.0
TARGET_CPU_US_PER_REQUEST = 1000.0
TARGET_CPU_US_PER_CHUNK = 30.0

# Issue 28, against vllm-project's Rust router in the same run: added p50 at c=1 (absolute),
# CPU per non-streaming request at c=64 and CPU per streamed chunk (ratios to the Rust router's).
# `--check` fails on the first ratio, the one the issue keeps won.
RUST_ADDED_P50_LIMIT_MS = 0.5
RUST_CPU_RATIO_LIMIT = 2.5
RUST_CHUNK_RATIO_LIMIT = 1.5


def _f(x: Any, digits: int = 2) -> str:
    if not isinstance(x, int | float) or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:,.{digits}f}"


def _get(entry: dict[str, Any], phase: str, key: str) -> Any:
    return entry.get(phase, {}).get(key)


def check_gpupool(targets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each of gpupool's targets with its measured value, met or not, and the margin."""
    gp = next((t for t in targets if t["name"] == "gpupool" and t["status"] == "ok"), None)
    if gp is None:
        return []
    rows = [
        ("added p50 latency at c=1", _get(gp, "c1", "added_p50_ms"), TARGET_ADDED_P50_MS, "ms"),
        (
            "CPU per non-streaming request (c=64)",
            _get(gp, "hi", "cpu_us_per_unit"),
            TARGET_CPU_US_PER_REQUEST,
            "µs",
        ),
        (
            "CPU per non-streaming request (c=1)",
            _get(gp, "c1", "cpu_us_per_unit"),
            TARGET_CPU_US_PER_REQUEST,
            "µs",
        ),
        (
            "CPU per non-streaming request (c=1, net of CPU at rest)",
            _get(gp, "c1", "cpu_us_per_unit_net_of_idle"),
            TARGET_CPU_US_PER_REQUEST,
            "µs",
        ),
        (
            "CPU per forwarded chunk (c=16)",
            _get(gp, "stream", "cpu_us_per_unit"),
            TARGET_CPU_US_PER_CHUNK,
            "µs",
        ),
    ]
    out = []
    for name, value, limit, unit in rows:
        ok = isinstance(value, float) and not math.isnan(value) and value <= limit
        out.append(
            {
                "target": name,
                "value": value,
                "limit": limit,
                "unit": unit,
                "met": ok,
                "headroom_frac": (limit - value) / limit if isinstance(value, float) else None,
            }
        )
    return out


def against_rust(targets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """gpupool beside vllm-router in the same run (issue 28's bars): each row with gpupool's
    value, the Rust router's, the ratio where the bar is one, the limit and whether it is met.
    Empty when either did not run."""
    ok = {t["name"]: t for t in targets if t["status"] == "ok"}
    gp, vr = ok.get("gpupool"), ok.get("vllm-router")
    if gp is None or vr is None:
        return []

    def row(name: str, phase: str, key: str, limit: float, unit: str, ratio: bool) -> Any:
        mine, rust = _get(gp, phase, key), _get(vr, phase, key)
        usable = all(isinstance(x, float) and not math.isnan(x) for x in (mine, rust))
        value = (mine / rust if rust else math.nan) if ratio and usable else mine
        met = usable and value <= limit
        return {
            "bar": name,
            "gpupool": mine,
            "vllm_router": rust,
            "unit": unit,
            "ratio": value if ratio else None,
            "limit": limit,
            "limit_is_ratio": ratio,
            "met": bool(met),
        }

    return [
        row("added p50 at c=1", "c1", "added_p50_ms", RUST_ADDED_P50_LIMIT_MS, "ms", False),
        row(
            "CPU per non-streaming request at c=64",
            "hi",
            "cpu_us_per_unit",
            RUST_CPU_RATIO_LIMIT,
            "µs",
            True,
        ),
        row(
            "CPU per streamed chunk",
            "stream",
            "cpu_us_per_unit",
            RUST_CHUNK_RATIO_LIMIT,
            "µs",
            True,
        ),
    ]


def _rust_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "## gpupool against the Rust router (issue 28; `--check` fails on the c=64 CPU ratio)",
        "",
        "| bar | gpupool | vllm-router | gpupool / vllm-router | limit | met |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        limit = f"{r['limit']:g} ×" if r["limit_is_ratio"] else f"{r['limit']:g} {r['unit']}"
        out.append(
            f"| {r['bar']} | {_f(r['gpupool'])} {r['unit']} | {_f(r['vllm_router'])} {r['unit']} "
            f"| {_f(r['ratio']) + ' ×' if r['ratio'] is not None else '—'} | {limit} "
            f"| {'yes' if r['met'] else '**no**'} |"
        )
    return [*out, ""]


def _main_table(targets: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| target | added p50 / p99, c=1 (ms) | added p50 / p99, c=64 (ms) | req/s, c=64 "
        "| chunks/s, c=16 | CPU-s / 1000 req (c=1 ; c=64) | CPU-s / 1000 chunks |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for t in targets:
        name = t["name"]
        if t["status"] != "ok":
            lines.append(f"| {name} | {t['status']}: see below | | | | | |")
            continue
        if name == "direct":
            lines.append(
                f"| direct (engine, the limit) | 0 (p50 {_f(_get(t, 'c1', 'latency')['p50_ms'], 3)}"
                f" ms) | 0 (p50 {_f(_get(t, 'hi', 'latency')['p50_ms'], 2)} ms) "
                f"| {_f(_get(t, 'hi', 'rate_per_s'), 0)} | {_f(_get(t, 'stream', 'rate_per_s'), 0)}"
                " | (no proxy) | (no proxy) |"
            )
            continue
        c1_cpu = _get(t, "c1", "cpu_us_per_unit")
        hi_cpu = _get(t, "hi", "cpu_us_per_unit")
        st_cpu = _get(t, "stream", "cpu_us_per_unit")
        lines.append(
            f"| {name} | {_f(_get(t, 'c1', 'added_p50_ms'), 3)} / "
            f"{_f(_get(t, 'c1', 'added_p99_ms'), 3)} "
            f"| {_f(_get(t, 'hi', 'added_p50_ms'), 2)} / {_f(_get(t, 'hi', 'added_p99_ms'), 2)} "
            f"| {_f(_get(t, 'hi', 'rate_per_s'), 0)} | {_f(_get(t, 'stream', 'rate_per_s'), 0)} "
            f"| {_f(c1_cpu / 1e3 if c1_cpu else None, 3)} ; "
            f"{_f(hi_cpu / 1e3 if hi_cpu else None, 3)}"
            f" | {_f(st_cpu / 1e3 if st_cpu else None, 4)} ({_f(st_cpu, 1)} µs/chunk) |"
        )
    return lines


def _latency_table(targets: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| target | c=1 p50 / p99 (ms) | c=64 p50 / p99 (ms) | added p50 at c=1, per round "
        "(ms) | errors | engine CPU µs / req (c=64) | proxy CPU at rest (ms/s) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for t in targets:
        if t["status"] != "ok":
            continue
        c1 = _get(t, "c1", "latency") or {}
        hi = _get(t, "hi", "latency") or {}
        rounds = _get(t, "c1", "added_p50_ms_rounds")
        errors = sum(int(t.get(p, {}).get("errors") or 0) for p in ("c1", "hi", "stream"))
        lines.append(
            f"| {t['name']} | {_f(c1.get('p50_ms'), 3)} / {_f(c1.get('p99_ms'), 3)} "
            f"| {_f(hi.get('p50_ms'), 2)} / {_f(hi.get('p99_ms'), 2)} "
            f"| {', '.join(_f(x, 3) for x in rounds) if rounds else '—'} | {errors} "
            f"| {_f(_get(t, 'hi', 'engine_cpu_us_per_unit'), 0)} "
            f"| {_f(t.get('idle_cpu_ms_per_s'), 1)} |"
        )
    return lines


def _profile(
    prof: dict[str, Any], title: str, cpu_us: float | None = None, rate_hz: int = 250
) -> list[str]:
    """One profile's tables; `cpu_us`: the phase's CPU per unit, to put µs beside the parts;
    `rate_hz`: py-spy's samples per second."""
    if not prof:
        return []
    if "skipped" in prof:
        return [f"**{title}**: skipped: {prof['skipped']}", ""]
    native = prof.get("native") or {}
    lines = [f"**{title}**", ""]
    if "components" in native:
        lines += [
            "| native (perf, cpu-clock) | share | | Python (py-spy, innermost frame) | share |",
            "| --- | --- | --- | --- | --- |",
        ]
        left = [(name, frac) for name, frac in native["components"] if frac >= 0.005]
        right = [(name, frac) for name, _, frac in prof["components"] if frac >= 0.005]
        for i in range(max(len(left), len(right))):
            ln, lf = left[i] if i < len(left) else ("", None)
            rn, rf = right[i] if i < len(right) else ("", None)
            lines.append(
                f"| {ln} | {'' if lf is None else f'{lf:.1%}'} | "
                f"| {rn} | {'' if rf is None else f'{rf:.1%}'} |"
            )
    else:
        if native.get("skipped"):
            lines += [f"Native split skipped: {native['skipped']}", ""]
        lines += ["| Python (py-spy, innermost frame) | share |", "| --- | --- |"]
        lines += [f"| {name} | {frac:.1%} |" for name, _, frac in prof["components"]]
    lines += [
        "",
        f"| top Python lines ({prof['busy_samples']} busy samples at {rate_hz} Hz; C they call "
        "counts for them) | share |",
        "| --- | --- |",
    ]
    lines += [f"| `{name}` | {frac:.1%} |" for name, _, frac in prof.get("top_python", [])[:10]]
    if native.get("top_symbols"):
        lines += [
            "",
            "Top native symbols: "
            + "; ".join(f"`{name}` {frac:.1%}" for name, frac in native["top_symbols"][:8]),
        ]
    if prof.get("inclusive"):
        lines += [
            "",
            "Inclusive: " + "; ".join(f"{name} {frac:.0%}" for name, _, frac in prof["inclusive"]),
        ]
    if prof.get("parts"):
        lines += [
            "",
            "| by part of gpupool (innermost frame) | share | µs of CPU per unit |",
            "| --- | --- | --- |",
        ]
        for name, _, frac in prof["parts"]:
            us = "—" if cpu_us is None else f"{frac * cpu_us:.0f}"
            lines.append(f"| {name} | {frac:.1%} | {us} |")
    return [*lines, ""]


def _real(real: dict[str, Any]) -> list[str]:
    if not real:
        return ["Not run (`--quick` or `--no-real-vllm`).", ""]
    if real.get("status") != "ok":
        return [f"Could not run: {real.get('reason')}", ""]
    lines = [
        f"One CPU vLLM engine, started with `{real['command']}` "
        f"(ready after {real['engine_start_s']} s). {real['rounds']} rounds × "
        f"{real['requests_per_round']} non-streaming requests per target, concurrency 1, "
        f"max_tokens {real['max_tokens']}.",
        "",
        "| target | p50 / p99 (ms) | added p50 / p99 (ms) | added p50 per round (ms) "
        "| proxy CPU ms / req (net of its CPU at rest) | CPU at rest (ms/s) | errors |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for t in real["targets"]:
        c1 = t.get("c1", {})
        lat = c1.get("latency", {})
        rounds = c1.get("added_p50_ms_rounds")
        cpu = c1.get("cpu_us_per_unit")
        net = c1.get("cpu_us_per_unit_net_of_idle")
        lines.append(
            f"| {t['name']} | {_f(lat.get('p50_ms'))} / {_f(lat.get('p99_ms'))} "
            f"| {_f(c1.get('added_p50_ms'), 3)} / {_f(c1.get('added_p99_ms'), 3)} "
            f"| {', '.join(_f(x, 2) for x in rounds) if rounds else '—'} "
            f"| {_f(cpu / 1e3 if cpu else None, 3)} ({_f(net / 1e3 if net else None, 3)}) "
            f"| {_f(t.get('idle_cpu_ms_per_s'), 1)} | {c1.get('errors', '—')} |"
        )
    return [*lines, ""]


def render(res: dict[str, Any]) -> str:
    m = res["machine"]
    plan = res["plan"]
    targets = res["targets"]
    out = [
        "# Router overhead: gpupool, vllm-router, production-stack and LiteLLM side by side",
        "",
        f"Command: `{res['command']}`  ",
        f"Date: {res['date']}, {res['elapsed_s']:.0f} s",
        "",
        f"Machine: {m['cpu']}, {m['cpus']} CPUs, {m['memory_gib']} GiB, Linux {m['kernel']}, "
        f"no GPU; shared with other jobs (load average {m['load_average_at_start']} at start, "
        f"{res['load_average_at_end']} at end).  ",
        f"Placement: {res['placement']}.  ",
        "Versions: " + "; ".join(f"{k} {v}" for k, v in res["versions"].items()) + ".",
        "",
        "## Results (all targets in front of the same fake engine)",
        "",
        *_main_table(targets),
        "",
        "Added latency = the target's percentile minus the direct engine's, over all rounds of "
        "the same run. CPU is the on-CPU time of every thread of the proxy's process tree "
        "(/proc schedstat; psutil's user + system agree within 0.2 %) over its measurement "
        "windows, the other proxies paused (SIGSTOP) meanwhile; CPU-s per 1000 requests equals "
        "ms per request.",
        "",
        *_latency_table(targets),
        "",
    ]
    bad = [t for t in targets if t["status"] != "ok"]
    if bad:
        out += ["Targets that did not run:", ""]
        out += [f"- **{t['name']}** ({t['status']}): {t['reason']}" for t in bad]
        out.append("")
    checks = res.get("gpupool_targets") or []
    if checks:
        out += [
            "## gpupool against its targets",
            "",
            "| target | measured | limit | met | headroom |",
            "| --- | --- | --- | --- | --- |",
        ]
        for c in checks:
            head = c["headroom_frac"]
            out.append(
                f"| {c['target']} | {_f(c['value'], 1)} {c['unit']} "
                f"| {c['limit']:g} {c['unit']} | {'yes' if c['met'] else '**no**'} "
                f"| {_f(head * 100 if head is not None else None, 0)} % |"
            )
        out.append("")
    if res.get("against_rust"):
        out += _rust_table(res["against_rust"])
    if res.get("analysis"):
        out += ["## Analysis (benchmarks/router_overhead/notes.md)", "", res["analysis"], ""]
    out += [
        "## Profiles of gpupool (the router process under load: perf for the native split, "
        "py-spy for the Python frames, same window)",
        "",
    ]
    prof = res.get("profile") or {}
    cpu = {
        phase: _get(t, phase, "cpu_us_per_unit")
        for t in res.get("targets", [])
        if t.get("name") == "gpupool" and t.get("status") == "ok"
        for phase in ("c1", "hi", "stream")
    }
    hz = plan.get("profile_rate_hz", 250)  # runs before it was a setting: 250
    out += _profile(prof.get("c1", {}), "non-streaming, c=1", cpu.get("c1"), hz)
    hi_title = f"non-streaming, c={plan['hi_concurrency']}"
    out += _profile(prof.get("hi", {}), hi_title, cpu.get("hi"), hz)
    out += _profile(
        prof.get("stream", {}), f"streaming, c={plan['stream_concurrency']}", cpu.get("stream"), hz
    )
    out += ["## gpupool in front of a real CPU vLLM engine", "", *_real(res.get("real_vllm", {}))]
    out += [
        "## How it was measured",
        "",
        f"- The fake engine (`pools.testing.fake_engine`, raw ASGI on uvicorn/httptools/uvloop) "
        f"answers at once; between streamed tokens it waits {plan['engine_itl_ms']} ms so each "
        "SSE event reaches a proxy as its own write, as a real engine's do.",
        f"- c=1: {plan['c1_rounds']} rounds × {plan['c1_requests']} sequential non-streaming "
        f"requests per target (max_tokens {plan['max_tokens']}), after "
        f"{plan['warmup_requests']} warm-up requests each.",
        f"- c={plan['hi_concurrency']}: {plan['hi_rounds']} rounds × {plan['hi_window_s']} s "
        "closed-loop windows per target; req/s is the median round's requests ended in its "
        "window; "
        "requests still in flight then finish and count for latency only.",
        f"- streaming: {plan['stream_rounds']} rounds × {plan['stream_window_s']} s windows, "
        f"c={plan['stream_concurrency']}, max_tokens {plan['stream_tokens']}; chunks are the "
        "SSE events the client received in the window, median round (LiteLLM adds one per "
        "stream, gpupool drops the usage event it asked for); streams still open at the end "
        "are cancelled.",
        "- Rounds visit every target in turn and the order rotates each round, so drift and "
        "other jobs' load hit all targets alike. One load generator (aiohttp on uvloop) for all.",
        "- Every proxy runs one worker process with request logging off or at warning level; "
        "production-stack gets uvloop + httptools installed (as its image has through vLLM); "
        "LiteLLM runs without a database or master key.",
    ]
    return "\n".join(out) + "\n"
