"""Test doubles and rigs that ship with gpupool (as httpx ships its MockTransport), used by the
tests and the benchmarks alike:

- `fake_engine` (with `fake_protocols`): a fast fake vLLM engine, scripted through its state;
- `serve`: any ASGI app over real HTTP on a free local port;
- `config`: the configuration a test starts from (`config_for_test`, `even_pools`, `one_pool`);
- `gateway`: a router in front of fake engines, with an in-process client
  (`gateway_over_fakes`);
- `router_process`: `gpupool serve` as a child process, ready on a free port and stopped after
  (`start_router_process`, `async_router_process`).

Imports nothing of `benchmarks` or `tests`; `gateway` imports `router` when called.
"""
