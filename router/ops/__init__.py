"""What operators read: `routes` (/openapi.json, /metrics, /admin/pools, /admin/history,
/admin/gpus, and the status page `ui/` at /ui), `pools_view` (the pools, instances and queues
as /admin/pools shows them, and the gauges /metrics exports), `history` (the last hour for the
status page's plots), `openapi` (the OpenAPI document, built once from the config).

Reads the other features; changes nothing. Must not import `router.gateway`, `router.cli`,
`router.core`, `router.simulate` nor `benchmarks` (tests/unit/test_layering.py).
"""
