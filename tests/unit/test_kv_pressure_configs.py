"""`benchmarks.admission.kv_pressure`'s configurations: every one names an engine file that
loads as a gpupool config, the engines' ports do not collide (they run side by side), and the
slice engines carry the slice their configs' names promise."""

from __future__ import annotations

from benchmarks.admission.kv_pressure import CONFIGS, ENGINE_FILES
from pools.config import load_config


def test_every_config_names_a_loadable_engine_with_its_own_ports() -> None:
    assert {spec.engine for spec in CONFIGS.values()} <= set(ENGINE_FILES)
    configs = {key: load_config(path) for key, path in ENGINE_FILES.items()}
    engine_ports = [c.engines.local.base_port for c in configs.values()]
    router_ports = [c.router.port for c in configs.values()]
    run_dirs = [c.engines.local.run_dir for c in configs.values()]
    for values in (engine_ports, router_ports, run_dirs):
        assert len(set(values)) == len(values)
    assert configs["slice"].admission.prefill_slice_tokens == 256
    assert configs["slice128"].admission.prefill_slice_tokens == 128
    assert configs["slice512"].admission.prefill_slice_tokens == 512
    assert configs["fcfs"].admission.prefill_slice_tokens is None
