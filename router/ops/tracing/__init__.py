"""OpenTelemetry traces of the request path, and logs that name them.

- `tracer.Tracing`: the component the gateway starts when `observability.otlp_endpoint` is
  set: a tracer whose sampler is parent-based with `sample_ratio`, and an exporter that sends
  batches over OTLP/HTTP (protobuf) from a task of its own, never from the request path;
- `request_trace.RequestTrace`: one request's span tree, built from the times the request path
  records anyway (`router.request.RequestOutcome`) plus a few marks; `TraceObserver` hands it
  the request's dispatch and end through `router.settlement.Settlement`;
- `export.LoopBatchProcessor`: the batching span processor on the event loop;
- `logs`: `router.log_format: json`, one JSON object per line naming the current trace.

With tracing off the gateway builds none of these (nor imports the SDK: ~0.1 s), and the
request path pays one `is None` check per hook. Import the modules themselves: this package
imports nothing, so `logs` comes without the SDK. Reads the request path's contracts
(`router.request`, `router.runtable`); imports nothing of `router.gateway`.
"""
