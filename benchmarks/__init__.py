"""The gpupool benchmark harness: workloads from YAML scenarios (chat and agent classes,
arrival processes, trace replay), an open-loop streaming runner, metrics in vLLM's definitions
(TTFT, TPOT, ITL, E2EL, SLO goodput, GPU-seconds per agent run), and side-by-side reports of
several targets. Entry points: `gpupool-bench` and `python -m benchmarks`; see README.md.

Modules: client (one streamed request), runner (one target), metrics, report, plots, compare,
cli. The workload model (scenario schema, distributions, arrivals, traces, prompts, the plan)
lives in the product, `router.simulate`, which `gpupool simulate` replays too: the harness
imports the product, never the reverse.
"""
