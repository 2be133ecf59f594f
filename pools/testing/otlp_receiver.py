"""A real OTLP/HTTP trace receiver for tests: an HTTP server on a free local port that takes
`POST /v1/traces` (protobuf `ExportTraceServiceRequest`, gzip or not), decodes it with
`opentelemetry-proto` and keeps every span, flattened to `ReceivedSpan`.

    with OtlpReceiver() as receiver:
        ... observability: {otlp_endpoint: receiver.url} ...
        spans = receiver.wait_for(lambda spans: len(spans) >= 5, timeout_s=30)

It runs in a thread of its own (the router under test may run in this process, on a loop the
receiver must not block, or in a subprocess); `close` stops it and joins the thread.
`fail_next` answers the next N exports with a 400 (refused: the exporter's error path,
without its retries, which are for 429/502/503/504).
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

__all__ = ["OtlpReceiver", "ReceivedSpan"]

SERVER, CLIENT = 2, 3  # Span.SpanKind values in the protocol


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return None if kind is None else getattr(v, kind)


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str
    links: list[tuple[str, str]]  # (trace id, span id)
    resource: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self.headers: list[dict[str, str]] = []  # each export's HTTP headers
        self.fail_next = 0
        self._changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                body = self.rfile.read(length)
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                status = receiver._receive(self.path, dict(self.headers), body)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(status)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="otlp-receiver", daemon=True
        )
        self._thread.start()

    def _receive(self, path: str, headers: dict[str, str], body: bytes) -> int:
        with self._changed:
            self.requests += 1
            self.headers.append({k.lower(): v for k, v in headers.items()})
            if path != "/v1/traces":
                return 404
            if self.fail_next > 0:
                self.fail_next -= 1
                return 400
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            status_code=s.status.code,
                            status_message=s.status.message,
                            links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                            resource=resource,
                        )
                    )
        with self._changed:
            self.spans.extend(received)
            self._changed.notify_all()
        return 200

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 30.0
    ) -> list[ReceivedSpan]:
        """The spans received so far, once `predicate` holds of them (else AssertionError)."""
        with self._changed:
            if not self._changed.wait_for(lambda: predicate(list(self.spans)), timeout_s):
                raise AssertionError(
                    f"the receiver's {len(self.spans)} span(s) never satisfied the test: "
                    f"{sorted({s.name for s in self.spans})}"
                )
            return list(self.spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._changed:
            return [s for s in self.spans if s.trace_id == trace_id]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> OtlpReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
