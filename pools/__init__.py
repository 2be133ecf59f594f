"""What the router stands on: the config (`config/`: schema, load, contract checks), the
engines (`launchers/`, `discovery/`), the fleet and its telemetry, the pool map
(`allocation`), the rebalancer's pure decision (`rebalance`), the operating point, the
periodic-loop helper, the dev model; `testing/` holds the fakes and the test rig.

Must not import `router` (except `testing/`, whose rig builds a gateway over fake engines) nor
`benchmarks` (tests/unit/test_layering.py).
"""
