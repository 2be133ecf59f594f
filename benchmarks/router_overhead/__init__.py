"""Router overhead, side by side: the same load through the fake engine directly (the limit),
gpupool, vllm-project's Rust router, vLLM production-stack's Python router and LiteLLM's proxy,
all in front of one fast fake engine, in interleaved rounds; plus gpupool in front of a real CPU
vLLM engine and a py-spy profile of gpupool under load.

    python -m benchmarks.router_overhead [--quick] --out benchmarks/results

Peers are installed outside the project's venv (git-ignored; `setup_peers.sh` beside this file).
Results: benchmarks/results/router_overhead.md and .json.
"""
