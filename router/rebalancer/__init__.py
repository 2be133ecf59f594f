"""The rebalancer: the shell (`rebalancer`) around the pure decision `pools.rebalance.decide`
and placement `pools.allocation.plan_moves`, the loop that moves the pool ratio with demand,
drains, and the decision log; `store` (pins, bounds, freezes and the audit that survive a
restart) and `routes` (the SREs' HTTP controls, /admin/pools/* and /admin/decisions).

Must not import `router.gateway`, `router.cli`, `router.core`, `router.simulate` nor
`benchmarks` (tests/unit/test_layering.py).
"""
