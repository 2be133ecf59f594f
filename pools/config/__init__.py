"""gpupool's configuration: every setting declared once (`schema`), read from YAML and the
environment (`load`), and checked for numbers that do not fit together (`checks`).

Each YAML section is one frozen pydantic dataclass whose fields carry their unit in their
name (`_s`, `_ms`, `_tokens`, `_frac`, `_bytes`), their default and their bounds; the program
reads those same objects (`dataclasses.replace` on them validates again). `load_config`
returns a `Config`; `ConfigError` carries messages that name the offending field.
This package imports nothing of gpupool but `pools.rebalance` (the rebalancer's settings and
schedule types); everything else imports it.
"""

from pools.config.checks import contract_problems, not_yet_in_effect
from pools.config.load import (
    DEFAULT_CPU_CONFIG,
    ConfigError,
    default_config,
    load_config,
    parse_config,
    validation_problems,
)
from pools.config.schema import (
    VLLM_MAX_NUM_SEQS,
    AdmissionConfig,
    ClassConfig,
    ClassificationConfig,
    Config,
    EnginesConfig,
    GovernanceConfig,
    KubernetesEnginesConfig,
    KubernetesKvEventsConfig,
    KubernetesServiceConfig,
    LocalEnginesConfig,
    ModelConfig,
    ObservabilityConfig,
    PoolConfig,
    QueueConfig,
    RayEnginesConfig,
    RebalancerConfig,
    RouterConfig,
    RunGuardsConfig,
    ShareConfig,
    ShareWindow,
    SloConfig,
    StaticEnginesConfig,
    StaticKvEventsConfig,
    StoreConfig,
    TenantConfig,
    TierConfig,
    default_of,
    max_num_seqs,
)

__all__ = [
    "DEFAULT_CPU_CONFIG",
    "VLLM_MAX_NUM_SEQS",
    "AdmissionConfig",
    "ClassConfig",
    "ClassificationConfig",
    "Config",
    "ConfigError",
    "EnginesConfig",
    "GovernanceConfig",
    "KubernetesEnginesConfig",
    "KubernetesKvEventsConfig",
    "KubernetesServiceConfig",
    "LocalEnginesConfig",
    "ModelConfig",
    "ObservabilityConfig",
    "PoolConfig",
    "QueueConfig",
    "RayEnginesConfig",
    "RebalancerConfig",
    "RouterConfig",
    "RunGuardsConfig",
    "ShareConfig",
    "ShareWindow",
    "SloConfig",
    "StaticEnginesConfig",
    "StaticKvEventsConfig",
    "StoreConfig",
    "TenantConfig",
    "TierConfig",
    "contract_problems",
    "default_config",
    "default_of",
    "load_config",
    "max_num_seqs",
    "not_yet_in_effect",
    "parse_config",
    "validation_problems",
]
