"""Admission benchmarks (issue 9, "Show it"): real CPU vLLM engines started with gpupool's local
launcher, gpupool routers in front of them, the harness in `benchmarks` driving the load.

- `kv_pressure`: one engine split between the agent and normal pools, Poisson chat plus K=6
  growing agent runs that overflow its KV cache; chat alone, admission off, admission on and
  admission on with vLLM's priority scheduling, interleaved over rounds.
"""
