"""Readers for request traces to replay: the Azure LLM inference trace CSV
(`TIMESTAMP,ContextTokens,GeneratedTokens`, TIMESTAMP an ISO date-time such as
`2023-11-16 18:15:46.6805900` or plain seconds) and Mooncake-style JSONL (one object a line
with `timestamp` in ms, `input_length`, `output_length`; other keys such as `hash_ids` are
ignored). Both give `TraceRow`s with times relative to the first row, sorted.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

__all__ = ["TraceError", "TraceRow", "load_azure_csv", "load_mooncake_jsonl", "load_trace"]


class TraceError(ValueError):
    """A trace file is malformed; the message names the file and line."""


@dataclass(frozen=True)
class TraceRow:
    t_s: float
    prompt_tokens: int
    output_tokens: int


def _parse_timestamp_s(text: str) -> float:
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    # Azure writes 7 fractional digits; datetime takes at most 6, so split the fraction off.
    base, _, frac = text.partition(".")
    seconds = datetime.fromisoformat(base).timestamp()
    return seconds + (float("0." + frac) if frac else 0.0)


def _relative(rows: list[TraceRow]) -> tuple[TraceRow, ...]:
    rows.sort(key=lambda r: r.t_s)
    if not rows:
        return ()
    t0 = rows[0].t_s
    return tuple(TraceRow(r.t_s - t0, r.prompt_tokens, r.output_tokens) for r in rows)


def load_azure_csv(path: str | Path) -> tuple[TraceRow, ...]:
    rows: list[TraceRow] = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or [])
        if missing:
            raise TraceError(f"{path}: missing columns {sorted(missing)}")
        for line_no, rec in enumerate(reader, start=2):
            try:
                rows.append(
                    TraceRow(
                        _parse_timestamp_s(rec["TIMESTAMP"]),
                        int(rec["ContextTokens"]),
                        int(rec["GeneratedTokens"]),
                    )
                )
            except (TypeError, ValueError) as err:
                raise TraceError(f"{path}:{line_no}: {err}") from err
    return _relative(rows)


def load_mooncake_jsonl(path: str | Path) -> tuple[TraceRow, ...]:
    rows: list[TraceRow] = []
    with open(path) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                rows.append(
                    TraceRow(
                        float(rec["timestamp"]) / 1000.0,
                        int(rec["input_length"]),
                        int(rec["output_length"]),
                    )
                )
            except (KeyError, TypeError, ValueError) as err:
                raise TraceError(f"{path}:{line_no}: {err!r}") from err
    return _relative(rows)


def load_trace(path: str | Path, fmt: str) -> tuple[TraceRow, ...]:
    """`fmt` is `azure` (CSV) or `mooncake` (JSONL)."""
    if fmt == "azure":
        return load_azure_csv(path)
    if fmt == "mooncake":
        return load_mooncake_jsonl(path)
    raise TraceError(f"unknown trace format {fmt!r} (azure | mooncake)")
