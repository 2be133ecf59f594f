"""Accounting: `accountant` (GPU-seconds by processor sharing, pure arithmetic with `now_s`
passed in), `observer` (a request's metering and record), `metrics` (the conservation
gauges), `ledger` and `ledger_queries` (the durable SQLite ledger and its reads), `routes`
(/v1/runs, /v1/runs/{id}, /admin/accounting).

Must not import `router.gateway`, `router.cli`, `router.core`, `router.simulate` nor
`benchmarks` (tests/unit/test_layering.py); governance's session view reaches `routes` as a
callable, not an import.
"""
