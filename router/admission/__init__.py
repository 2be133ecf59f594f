"""Admission: may a request go now, to which instance, or must it wait. `decision` is the pure
core (`decide`: grant, wait or reject from the instances' views), `admitter` its shell (the
pools' queues, the leases, the synchronous dispatch core the simulator runs too), `queueing`
(per-pool bounded fair queues), `picking` (which instance of a grant; run affinity), `estimate`
(a request's tokens before the engine counts them), `membership` (engines joining and
draining).

Must not import `router.gateway`, `router.cli`, `router.core`, `router.simulate` nor
`benchmarks` (tests/unit/test_layering.py).
"""
