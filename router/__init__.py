"""The router: one OpenAI-compatible endpoint over the engines `pools` runs (README, "Where
things live"). One package per feature, a pure core beside its shell:

    gateway/     the ASGI request path and the composition root (`create_app`)
    admission/   may this request go now, where, or must it wait: decision, queues, picking
    governance/  tenants' budgets, tiers, run guards, cost caps
    rebalancer/  the pool ratio following demand, and the SREs' controls over it
    accounting/  GPU-seconds, the durable ledger, the runs API
    ops/         what operators read: /metrics, /admin/pools, history, OpenAPI, the status page
    simulate/    the what-if simulator on the router's own dispatch core
    cli/         the `gpupool` command and the one-process runtime

Shared modules directly here: `errors` (the one error hierarchy; status codes chosen there),
`request` (the per-request contracts), `identity` (keys, tenants, operator access),
`query_params`, `metrics` (the router's Prometheus registry), `runtable` (what is kept per
run), `settlement` (a request's end after dispatch: meter, governance, ledger, learners) and
`core` (`build_core`: the decision components wired once, for the gateway and the simulator).

Must not import `benchmarks`. Layering, enforced by tests/unit/test_layering.py: only `cli`
imports `gateway` (nothing imports `cli`); the features and the shared modules import neither
`gateway`, `cli`, `core` nor `simulate`.
"""

from router._compiled import install as _install_compiled

_install_compiled()  # the mypyc build of the hot modules, when current (router/_compiled.py)
