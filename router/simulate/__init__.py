"""The what-if simulator and the workload model it replays.

`sim.simulate(config, plan, latency, ...)` runs a scenario in simulated time through the
router's own decision components (`router.core.build_core`: fleet, admission with its dispatch
core, picking, rebalancer) over modelled engines (`model`, latencies fitted from a real run's
records by `fit`). The workload: a scenario (`scenario`: classes with arrival processes from
`arrivals`, size distributions from `distributions`, recorded traces from `traces`) drawn into
a time-ordered plan (`workload.build_plan`, prompts from `prompts`). The benchmark harness
(`benchmarks/`) sends the same plans to real endpoints.

Lives in the product because `gpupool simulate` runs it. Must not import the request path
(`router.gateway`), `router.ops` nor `router.cli`; the benchmark harness uses this package,
never the reverse (tests/unit/test_layering.py).
"""
