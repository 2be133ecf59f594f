"""Where gpupool's CPU goes under load: py-spy samples of the router process (Python frames,
taken without stopping it) while the load generator drives one window, folded into components
by the innermost frame (event loop, ASGI server, aiohttp client, gpupool's own code, ledger; C
called from Python counts for its caller), plus perf's native split (perf_native.py).

py-spy lives in its own venv (`.venv-peers/pyspy`); without it this step reports why it was
skipped.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Awaitable, Iterable
from pathlib import Path
from typing import Any

from benchmarks.router_overhead import perf_native

__all__ = ["fold", "load_samples", "missing", "parse_raw", "record"]

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<where>[^()]*)\)$")

_LOOP_ASYNCIO = "event loop (asyncio: tasks, callbacks, transports)"
_LOOP_UVLOOP = "event loop (uvloop/libuv: tasks, callbacks, transports)"
_AIOHTTP = "upstream client (aiohttp, multidict, yarl)"
_SYSCALL = "socket syscalls (read/write/send/recv, in the kernel)"

# (substring of a frame's location, component); the innermost frame with a match decides,
# and within one frame the first match in this order. Native frames are named by their C file.
_COMPONENTS: tuple[tuple[str, str], ...] = (
    ("asyncio/runners.py", "event loop internals (uvloop's C loop: polling, dispatch, socket I/O)"),
    (
        "router/accounting/ledger.py",
        "ledger (router/accounting/ledger.py + sqlite3, its worker thread)",
    ),
    ("orjson", "JSON (orjson)"),
    ("(parser.c", "HTTP parsing, server side (httptools)"),
    ("(llhttp.c", "HTTP parsing, server side (httptools)"),
    ("httptools/parser", "HTTP parsing, server side (httptools)"),
    ("_http_parser", "HTTP parsing, client side (aiohttp's C parser)"),
    ("uvicorn/", "ASGI server (uvicorn)"),
    ("router/gateway/server.py", "HTTP server (router/gateway/server.py)"),
    ("aiohttp/", _AIOHTTP),
    ("_http_writer.c", _AIOHTTP),
    ("_helpers_c.c", _AIOHTTP),
    ("multidict", _AIOHTTP),
    ("yarl", _AIOHTTP),
    ("url_parser.c", _AIOHTTP),
    ("prometheus_client/", "metrics (prometheus_client)"),
    ("router/", "gpupool (router/)"),
    ("pools/", "gpupool (pools/)"),
    ("fastapi/", "FastAPI/Starlette (non-hot-path routes)"),
    ("starlette/", "FastAPI/Starlette (non-hot-path routes)"),
    ("sqlite", "ledger (sqlite3)"),
    ("(cursor.c", "ledger (sqlite3)"),
    ("(connection.c", "ledger (sqlite3)"),
    ("asyncio/", _LOOP_ASYNCIO),
    ("_asynciomodule", _LOOP_ASYNCIO),
    ("selectors.py", _LOOP_ASYNCIO),
    ("selectmodule.c", _LOOP_ASYNCIO),
    ("socketmodule.c", _LOOP_ASYNCIO),
    ("_heapqmodule", _LOOP_ASYNCIO),
    ("uvloop", _LOOP_UVLOOP),
    ("(loop.c", _LOOP_UVLOOP),
    ("(loop-watcher.c", _LOOP_UVLOOP),
    ("(core.c", _LOOP_UVLOOP),
    ("(stream.c", _LOOP_UVLOOP),
    ("(linux.c", _LOOP_UVLOOP),
    ("(timer.c", _LOOP_UVLOOP),
    ("(queue.h", _LOOP_UVLOOP),
    ("(heap-inl.h", _LOOP_UVLOOP),
)
# The parts of gpupool a busy sample belongs to: the innermost frame whose file matches, within
# one frame the first match in this order (a sample under none of them: "outside gpupool").
# The request path's own frames hold what the C they call costs, and the resumes of the await
# chain at their `await` lines.
_PARTS: tuple[tuple[str, str], ...] = (
    ("router/admission/estimate.py", "estimation"),
    ("router/admission/", "admission (router/admission, pools/)"),
    ("pools/", "admission (router/admission, pools/)"),
    ("router/gateway/upstream.py", "engine client (its socket writes included)"),
    ("router/gateway/http_protocol.py", "client link (its socket writes included)"),
    ("router/gateway/server.py", "HTTP server (its socket writes included)"),
    ("router/gateway/classify.py", "classify"),
    ("router/gateway/", "request path (router/gateway)"),
    ("router/accounting/", "ledger and accounting (router/accounting, router/store)"),
    ("router/store/", "ledger and accounting (router/accounting, router/store)"),
    ("router/settlement.py", "settlement and rebalancer signals"),
    ("router/rebalancer/", "settlement and rebalancer signals"),
    ("router/governance/", "governance"),
    ("router/metrics.py", "metrics (router/metrics, prometheus_client)"),
    ("prometheus_client/", "metrics (router/metrics, prometheus_client)"),
    ("uvicorn/", "uvicorn"),
    ("router/cli/", "event loop (uvloop's C loop under the CLI's run)"),
    ("router/", "other gpupool"),
)
_SYSCALLS = re.compile(
    r"^(__libc_)?(read|write|writev|send|sendmsg|sendto|recv|recvfrom|recvmsg) \(libc"
)
_IDLE = (
    "epoll_wait",
    "epoll_pwait",
    "PyThread_acquire_lock_timed",
    "select (selectors.py",
    "_queue_SimpleQueue_get",
    "sem_timedwait",
    "pthread_cond_timedwait",
)
# Frames that say nothing about who is working: inlined refcounting, the interpreter, libc
# internals without a symbol, the entry point.
_OPAQUE = ("object.h", "libpython", "(0x", "pycore_", "abstract.h", "<frozen", "unicodeobject.h")


def parse_raw(text: str) -> list[tuple[list[str], int]]:
    """py-spy `--format raw` lines (`frame;frame;... count`, root first) into (frames, count)."""
    out = []
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        out.append((stack.split(";"), int(count)))
    return out


def _is_idle(frames: list[str]) -> bool:
    tail = ";".join(frames[-4:])
    return any(marker in tail for marker in _IDLE)


def _component(frames: list[str]) -> str:
    if frames and _SYSCALLS.match(frames[-1]):
        return _SYSCALL
    for frame in reversed(frames):
        m = _FRAME.match(frame)
        where = f"({m.group('where')}" if m else frame
        for needle, name in _COMPONENTS:
            if needle in where:
                return name
    return "other"


def _part(frames: list[str]) -> str:
    for frame in reversed(frames):
        for needle, name in _PARTS:
            if needle in frame:
                return name
    return "outside gpupool"


def _innermost_python(frames: list[str]) -> str:
    for frame in reversed(frames):
        m = _FRAME.match(frame)
        if m and ".py:" in m.group("where"):
            return frame
    return frames[-1] if frames else "?"


def _self_frame(frames: list[str]) -> str:
    """The innermost frame that names real work (native line numbers dropped, so a C function
    counts once)."""
    for frame in reversed(frames):
        m = _FRAME.match(frame)
        if frame.startswith("0x") and m and "lib" not in m.group("where"):
            return f"(unnamed) ({m.group('where')})"  # a stripped extension: orjson, ...
        if any(marker in frame for marker in _OPAQUE) or frame.startswith("0x"):
            continue
        if m and ".py:" not in m.group("where"):
            return f"{m.group('func')} ({m.group('where').split(':')[0]})"
        return frame
    return frames[-1] if frames else "?"


def fold(samples: Iterable[tuple[list[str], int]], top_n: int = 15) -> dict[str, Any]:
    """Busy samples by component (innermost matching frame), by part of gpupool (`_PARTS`), by
    self frame (native or Python), by innermost Python function, and inclusively for a few
    layers. Idle waits (epoll, locks) are dropped."""
    busy = 0
    idle = 0
    comps: Counter[str] = Counter()
    parts: Counter[str] = Counter()
    funcs: Counter[str] = Counter()
    selfs: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    layers = {
        "uvicorn/": "ASGI server (uvicorn) incl. the app it calls",
        "router/gateway/server.py": "gpupool's HTTP server incl. the app it calls",
        "router/gateway/proxy.py": (
            "gpupool's request path (router/gateway/proxy.py) incl. what it calls"
        ),
        "aiohttp/": "aiohttp client incl. what it calls",
    }
    for frames, n in samples:
        if _is_idle(frames):
            idle += n
            continue
        busy += n
        comps[_component(frames)] += n
        parts[_part(frames)] += n
        funcs[_innermost_python(frames)] += n
        selfs[_self_frame(frames)] += n
        joined = ";".join(frames)
        for needle, name in layers.items():
            if needle in joined:
                incl[name] += n

    def frac(c: Counter[str], k: int | None = None) -> list[tuple[str, int, float]]:
        return [(name, n, round(n / busy, 4) if busy else 0.0) for name, n in c.most_common(k)]

    return {
        "busy_samples": busy,
        "idle_samples": idle,
        "components": frac(comps),
        "parts": frac(parts),
        "top_self": frac(selfs, top_n),
        "top_python": frac(funcs, top_n),
        "inclusive": frac(incl),
    }


async def record(
    pyspy: Path, pid: int, duration_s: float, out: Path, load: Awaitable[Any], rate_hz: int = 250
) -> dict[str, Any]:
    """Sample `pid` for `duration_s` while `load` runs, with py-spy (Python frames, without
    stopping the process: ptrace stops would land on system-call exits and inflate them) and,
    alongside, perf (native split, see perf_native). Returns `fold` of the py-spy samples plus
    {"native": ...}, or {"skipped": reason}. `pyspy` must exist (see `missing`)."""
    proc = await asyncio.create_subprocess_exec(
        str(pyspy), "record", "--pid", str(pid), "--duration", str(int(duration_s)),
        "--rate", str(rate_hz), "--format", "raw", "--nonblocking", "--output", str(out),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    await asyncio.sleep(0.5)
    native_out = out.with_suffix(".perf.data")
    native = asyncio.ensure_future(perf_native.record(pid, duration_s - 1.0, native_out))
    await load
    native_rc, native_output = await native
    stdout, _ = await proc.communicate()
    folded = load_samples(out, proc.returncode, stdout.decode(errors="replace"))
    folded["native"] = perf_native.report(native_out, native_rc, native_output)
    return folded


def missing(pyspy: Path) -> dict[str, Any] | None:
    """{"skipped": why} when py-spy is not installed, else None."""
    if pyspy.exists():
        return None
    return {"skipped": f"py-spy not installed at {pyspy} (pip install py-spy into that venv)"}


def load_samples(out: Path, returncode: int | None, output: str) -> dict[str, Any]:
    if returncode != 0 or not out.exists():
        return {"skipped": f"py-spy failed ({returncode}): {output[-400:]}"}
    return fold(parse_raw(out.read_text()))
