"""`router.log_format`: text (`time level logger: message`) or json, one object per line:

    {"ts": "2026-12-02T01:23:45.678Z", "level": "info", "logger": "router.gateway.proxy",
     "message": "...", "trace_id": "4bf9...", "span_id": "00f0..."}

`trace_id`/`span_id` are the current span's (a traced request's server span, from the moment
it is classified), absent outside one; `exception` holds a traceback when there is one.
Only the formatted message goes out, never the record's other attributes: gpupool's messages
name requests, tenants and instances, never a prompt, a completion, a header or a key, and a
JSON line carries nothing more than the text line would.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
from opentelemetry.trace import get_current_span

__all__ = ["JsonFormatter", "configure_logging", "json_logs_on"]


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module's docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        span_context = get_current_span().get_span_context()
        if span_context.is_valid:
            entry["trace_id"] = f"{span_context.trace_id:032x}"
            entry["span_id"] = f"{span_context.span_id:016x}"
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


def json_logs_on() -> bool:
    """Whether the root logger writes JSON lines (then they name the current trace)."""
    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)


def configure_logging(log_format: str, level: str) -> None:
    """The root logger at `level`, its handlers writing `log_format` (text: as the CLI set
    them up; json: `JsonFormatter`). A root without handlers gets one on stderr."""
    root = logging.getLogger()
    root.setLevel(level.upper())
    if log_format != "json":
        return
    if not root.handlers:
        root.addHandler(logging.StreamHandler())
    for handler in root.handlers:
        handler.setFormatter(JsonFormatter())
