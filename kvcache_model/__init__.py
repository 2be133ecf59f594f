"""Pure KV-cache and latency arithmetic: model geometry from a HF `config.json`, KV bytes per
token and per block, blocks a sequence needs, an engine's capacity, and roofline TTFT/TPOT
priors for a GPU spec. numpy-free, I/O-free except reading one config file.

The router's entry points:

- `blocks_for_tokens(n_tokens, block_size_tokens)`: blocks a sequence needs (ceil);
- `instance_capacity(num_gpu_blocks=..., block_size=..., predicted=plan)`: capacity from what
  an engine reports (engine wins over prediction);
- `LatencyPrior(geometry, gpu_spec("H100")).max_batch_for_tpot(target_s, context_tokens)`:
  the operating-point prior.

Must not import `pools`, `router`, `gpu_probe` nor `benchmarks` (tests/unit/test_layering.py).
"""

from kvcache_model.capacity import (
    CapacityPlan,
    capacity_from_kv_cache_bytes,
    estimate_overhead_bytes,
    plan_capacity,
)
from kvcache_model.dtypes import dtype_bytes, kv_cache_dtype_bytes
from kvcache_model.engine_view import InstanceCapacity, instance_capacity
from kvcache_model.errors import (
    InvalidInputError,
    KVCacheModelError,
    ModelConfigError,
    UnknownGPUError,
    UnknownModelError,
)
from kvcache_model.geometry import LayerKind, MlaDims, ModelGeometry, blocks_for_tokens
from kvcache_model.gpus import GPU_SPECS, GpuSpec, gpu_spec, gpu_spec_for_device_name
from kvcache_model.hf_config import SUPPORTED_MODEL_TYPES
from kvcache_model.known import known_model_names, load_geometry
from kvcache_model.latency import LatencyPrior

__all__ = [
    "GPU_SPECS",
    "SUPPORTED_MODEL_TYPES",
    "CapacityPlan",
    "GpuSpec",
    "InstanceCapacity",
    "InvalidInputError",
    "KVCacheModelError",
    "LatencyPrior",
    "LayerKind",
    "MlaDims",
    "ModelConfigError",
    "ModelGeometry",
    "UnknownGPUError",
    "UnknownModelError",
    "blocks_for_tokens",
    "capacity_from_kv_cache_bytes",
    "dtype_bytes",
    "estimate_overhead_bytes",
    "gpu_spec",
    "gpu_spec_for_device_name",
    "instance_capacity",
    "known_model_names",
    "kv_cache_dtype_bytes",
    "load_geometry",
    "plan_capacity",
]
