"""Where a process's CPU goes at the native level: `perf record -e cpu-clock` (a plain timer, no
ptrace stops, so no bias toward system calls) folded by shared object: the CPython interpreter,
the kernel (system calls, TCP), libc, and each C extension (uvloop, httptools, aiohttp's parser,
orjson, sqlite3). Python-level attribution comes from py-spy (profile.py); this says how much
of the time is interpreting Python at all.

Needs `perf` on PATH and permission to sample the process; without it the step says why.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["dso_label", "fold_report", "perf_binary", "record", "report"]

_LINE = re.compile(r"^\s*(?P<pct>\d+(?:\.\d+)?)%\s+(?P<rest>\S.*?)\s*$")

# (substring of the shared object's name, what it is), first match wins.
_DSOS: tuple[tuple[str, str], ...] = (
    ("libpython", "CPython interpreter (bytecode, objects, GC)"),
    ("python3", "CPython interpreter (bytecode, objects, GC)"),
    ("kernel", "kernel (system calls, TCP/IP, scheduling)"),
    ("vdso", "kernel (system calls, TCP/IP, scheduling)"),
    ("libc.so", "libc (malloc, memcpy, syscall wrappers)"),
    ("loop.cpython", "uvloop (C event loop)"),
    ("libuv", "uvloop (C event loop)"),
    ("_asyncio", "asyncio C accelerator (tasks, futures)"),
    ("_http_parser", "aiohttp C HTTP parser (upstream responses)"),
    ("parser.cpython", "httptools (client requests, server side)"),
    ("orjson", "orjson (JSON)"),
    ("sqlite", "sqlite3 (ledger)"),
    ("_multidict", "aiohttp C helpers (multidict, writer, yarl)"),
    ("_http_writer", "aiohttp C helpers (multidict, writer, yarl)"),
    ("url_parser", "aiohttp C helpers (multidict, writer, yarl)"),
    ("_helpers_c", "aiohttp C helpers (multidict, writer, yarl)"),
    ("_quoting", "aiohttp C helpers (multidict, writer, yarl)"),
)


def perf_binary() -> str | None:
    return shutil.which("perf")


def dso_label(dso: str) -> str:
    for needle, label in _DSOS:
        if needle in dso:
            return label
    return f"other ({dso})"


def fold_report(by_dso: str, by_symbol: str, top_n: int = 12) -> dict[str, Any]:
    """`perf report --sort dso` and `--sort dso,sym` text into shares by component and the top
    symbols; shares are fractions of all samples of the process."""
    comps: dict[str, float] = {}
    for line in by_dso.splitlines():
        m = _LINE.match(line)
        if m is None or line.lstrip().startswith("#"):
            continue
        label = dso_label(m.group("rest"))
        comps[label] = comps.get(label, 0.0) + float(m.group("pct")) / 100
    symbols = []
    for line in by_symbol.splitlines():
        m = _LINE.match(line)
        if m is None or line.lstrip().startswith("#"):
            continue
        parts = m.group("rest").split()
        name = " ".join(parts[2:]) if len(parts) >= 3 else m.group("rest")
        symbols.append((f"{name} ({parts[0]})", round(float(m.group("pct")) / 100, 4)))
        if len(symbols) >= top_n:
            break
    ordered = sorted(comps.items(), key=lambda kv: -kv[1])
    return {"components": [(k, round(v, 4)) for k, v in ordered], "top_symbols": symbols}


async def record(pid: int, duration_s: float, out: Path) -> tuple[int | None, str]:
    """Sample `pid` on a 999 Hz CPU clock for `duration_s`; returns (exit code, output)."""
    perf = perf_binary()
    if perf is None:
        return None, "perf is not installed (apt-get install linux-perf)"
    proc = await asyncio.create_subprocess_exec(
        perf, "record", "-e", "cpu-clock", "-F", "999", "-p", str(pid), "-o", str(out),
        "--", "sleep", str(duration_s),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    stdout, _ = await proc.communicate()
    return proc.returncode, stdout.decode(errors="replace")


def report(out: Path, returncode: int | None, output: str) -> dict[str, Any]:
    """Fold a recording made by `record`, or say why there is none."""
    if returncode != 0 or not out.exists():
        return {"skipped": f"perf record failed ({returncode}): {output[-300:]}"}
    base = ["perf", "report", "-i", str(out), "--no-children", "--stdio", "-g", "none"]
    try:
        by_dso = subprocess.run([*base, "--sort", "dso"], capture_output=True, text=True,
                                timeout=60, check=False).stdout  # fmt: skip
        by_sym = subprocess.run([*base, "--sort", "dso,sym"], capture_output=True, text=True,
                                timeout=60, check=False).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"skipped": f"perf report failed: {err}"}
    return fold_report(by_dso, by_sym)
