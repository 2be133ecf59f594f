"""The ASGI request path: `app` (`create_app`, the `Gateway`: the composition root that builds
every component, starts and closes them, and collects each feature's routes), `proxy` (the
generation endpoints through admission to an engine and back), `engine_calls` (engine calls
without admission: count_tokens, GET and cancel of a stored response), `protocols/` (one adapter
per API: chat, completions, responses, messages), `classify` (tenant, class, pool, priority,
deadline, run of a request), `wait_comments` (SSE comments while a stream waits),
`response_placement` (which engine stored a response), `server` (gpupool's HTTP/1.1 server,
with the slow-client guards), `http_protocol` (each request's `ClientLink`, what the request
path sees of the server), `upstream` (the proxy's pooled HTTP/1.1 client to the engines).

The top of the router: it may import every feature. Must not import `router.cli` (which runs
it) nor `benchmarks`; no feature imports it (tests/unit/test_layering.py).
"""
