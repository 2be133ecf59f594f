"""gpupool's configuration: the YAML schema (pydantic, validated once at the edge) and the
frozen dataclasses the rest of the program reads.

Every field carries its unit in its name (`_s`, `_ms`, `_tokens`, `_frac`, `_bytes`) and its
default beside it. `load_config` returns a `Config`; `ConfigError` carries messages that name
the offending field. `contract_problems` is the consistency check behind `gpupool check-config`.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

__all__ = [
    "ClassConfig",
    "ClassificationConfig",
    "Config",
    "ConfigError",
    "EnginesConfig",
    "LocalEnginesConfig",
    "ModelConfig",
    "PoolConfig",
    "RouterConfig",
    "ShareConfig",
    "SloConfig",
    "StaticEnginesConfig",
    "TenantConfig",
    "contract_problems",
    "default_config",
    "load_config",
    "not_yet_in_effect",
]


_log = logging.getLogger(__name__)


class ConfigError(Exception):
    """The configuration is invalid. `problems` lists one message per offending field."""

    def __init__(self, problems: list[str], source: str = "config") -> None:
        self.problems = problems
        self.source = source
        super().__init__(f"{source}: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------
# The external schema (pydantic). Unknown keys are errors: a typo must not pass silently.
# ---------------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSchema(_Strict):
    name: str = "tiny"  # served model name clients send as "model"
    path: str = "./.gpupool/models/tiny"  # HF-style folder: config.json, tokenizer
    max_model_len_tokens: int | None = Field(default=None, gt=0)  # None: the engine's default
    load_format: Literal["auto", "dummy"] = "dummy"  # dummy: random weights (dev model)
    # auto: on a CPU engine float32, or bfloat16 where the CPU has avx512_bf16 or amx_bf16
    # (without them bfloat16 prefill runs ~4x slower); on a GPU vLLM's own auto (the
    # checkpoint's dtype). Any other value is passed to vLLM's --dtype as given.
    dtype: str = "auto"


class LocalEnginesSchema(_Strict):
    count: int = Field(default=3, ge=1, le=64)
    gpus_per_instance: int = Field(default=1, ge=1, le=16)
    host: str = "127.0.0.1"
    base_port: int = Field(default=8100, ge=1024, le=65000)  # instance i listens on base_port + i
    kv_cache_bytes: int | None = Field(default=None, gt=0)  # None: engine default
    vllm_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    cpu_affinity: list[list[int]] | None = None  # per instance, e.g. [[0], [1], [1]]; CPU only
    startup_timeout_s: float = Field(default=600.0, gt=0)
    restart_backoff_s: float = Field(default=2.0, gt=0)  # doubles per consecutive crash
    restart_backoff_max_s: float = Field(default=60.0, gt=0)
    stop_grace_s: float = Field(default=15.0, gt=0)
    run_dir: str = "./.gpupool/run"
    # The key every engine requires (vLLM's VLLM_API_KEY; the router sends it): the name of an
    # env var holding it. None: a random key per engine and launch, held only by this process.
    api_key_env: str | None = None

    @model_validator(mode="after")
    def _no_forbidden_flags(self) -> LocalEnginesSchema:
        if "--disable-log-stats" in self.vllm_args:
            raise ValueError(
                "vllm_args: --disable-log-stats removes every vllm:* metric gpupool's telemetry"
                " and admission need; remove it"
            )
        if self.cpu_affinity is not None and any(not cpus for cpus in self.cpu_affinity):
            raise ValueError("cpu_affinity: every instance needs at least one CPU")
        return self


class StaticEnginesSchema(_Strict):
    urls: list[str] = Field(default_factory=list)
    gpus_per_instance: int = Field(default=1, ge=1, le=16)
    api_key_env: str | None = None  # env var holding the engines' key (vLLM --api-key); None: none

    @model_validator(mode="after")
    def _urls_are_http(self) -> StaticEnginesSchema:
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"url {url!r} must start with http:// or https://")
        return self


class EnginesSchema(_Strict):
    launcher: Literal["local", "static", "ray"] = "local"  # ray: refused until it exists
    local: LocalEnginesSchema = Field(default_factory=LocalEnginesSchema)
    static: StaticEnginesSchema = Field(default_factory=StaticEnginesSchema)

    @field_validator("launcher")
    @classmethod
    def _launcher_available(cls, value: str) -> str:
        if value == "ray":
            raise ValueError(
                "'ray' is not available yet in this version of gpupool; use 'local', or start"
                " the engines with Ray yourself and list their URLs in engines.static.urls"
                " (launcher: static)"
            )
        return value

    @model_validator(mode="after")
    def _static_has_urls(self) -> EnginesSchema:
        if self.launcher == "static" and not self.static.urls:
            raise ValueError("launcher 'static' needs at least one URL in engines.static.urls")
        return self


class ShareSchema(_Strict):
    initial_frac: float = Field(ge=0.0, le=1.0)
    floor_frac: float = Field(default=0.0, ge=0.0, le=1.0)
    ceiling_frac: float = Field(default=1.0, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _ordered(self) -> ShareSchema:
        if not self.floor_frac <= self.initial_frac <= self.ceiling_frac:
            raise ValueError(
                f"needs floor_frac <= initial_frac <= ceiling_frac, got {self.floor_frac} / "
                f"{self.initial_frac} / {self.ceiling_frac}"
            )
        return self


class SloSchema(_Strict):
    ttft_p95_ms: float = Field(default=2000.0, gt=0)
    tpot_p95_ms: float = Field(default=100.0, gt=0)


class QueueSchema(_Strict):
    max_depth: int = Field(default=256, ge=0)  # waiting requests; 0: no queue, refuse at once
    max_wait_s: float = Field(default=10.0, ge=0)  # longest wait before a 429 queue_timeout
    # fifo: priority bands, then arrival; wfq: priority bands, then weighted fair queuing across
    # tenants by estimated token cost (tenant `weight`), then arrival; run_las: priority bands,
    # tenant turns as in wfq, then the step whose run has received the fewest GPU-seconds
    order: Literal["fifo", "wfq", "run_las"] = "wfq"
    # run_las only: a step that has waited this long goes ahead of its tenant's other steps
    # (oldest first), so long runs are never starved; must be below max_wait_s
    run_las_aging_s: float = Field(default=5.0, gt=0)
    # run_las only: a run idle (no step in flight) longer than this has its attained
    # GPU-seconds halved per further run_las_idle_decay_s of idleness
    run_las_idle_decay_s: float = Field(default=60.0, gt=0)

    @model_validator(mode="after")
    def _run_las_fields(self) -> QueueSchema:
        las_fields = {"run_las_aging_s", "run_las_idle_decay_s"} & self.model_fields_set
        if self.order != "run_las" and las_fields:
            raise ValueError(
                f"{', '.join(sorted(las_fields))} only apply with order: run_las"
                f" (order is {self.order})"
            )
        if self.order == "run_las" and self.max_wait_s and self.run_las_aging_s >= self.max_wait_s:
            raise ValueError(
                f"run_las_aging_s ({self.run_las_aging_s:g} s) must be below max_wait_s"
                f" ({self.max_wait_s:g} s): a step would time out before it ages"
            )
        return self


class PoolSchema(_Strict):
    classes: list[str] = Field(min_length=1)
    share: ShareSchema
    slo: SloSchema = Field(default_factory=SloSchema)
    queue: QueueSchema = Field(default_factory=QueueSchema)
    # vLLM request `priority` sent with this pool's requests (lower is scheduled first inside
    # the engine); None sends none. Needs engines started with `--scheduling-policy priority`
    # (the local launcher adds it when any pool sets this).
    engine_priority: int | None = None


class ClassSchema(_Strict):
    timeout_s: float = Field(default=300.0, gt=0)  # whole request, queue wait included
    expected_output_tokens: int = Field(default=256, gt=0)  # used before p95 is observed
    default_priority: int = 0


class TenantSchema(_Strict):
    name: str = Field(min_length=1)
    # The key, given one way at most (none: the tenant has no key; see router/identity.py):
    api_key_env: str | None = None  # name of the env var holding the key
    api_key: str | None = Field(default=None, repr=False)  # literal key: warns at load
    api_key_sha256: str | None = None  # hex SHA-256 of the key: the config holds no secret
    weight: float = Field(default=1.0, gt=0)
    tokens_per_minute: int | None = Field(default=None, gt=0)
    max_concurrent_runs: int | None = Field(default=None, gt=0)
    default_class: str | None = None
    may_set_class: bool = True
    admin: bool = False  # may read /admin/* and /metrics (router.admin_api_key_env may too)

    @field_validator("api_key_sha256")
    @classmethod
    def _hex_digest(cls, value: str | None) -> str | None:
        return None if value is None else _sha256_hex(value)

    @model_validator(mode="after")
    def _one_key_source(self) -> TenantSchema:
        given = [k for k in ("api_key_env", "api_key", "api_key_sha256") if getattr(self, k)]
        if len(given) > 1:
            raise ValueError(
                f"tenant {self.name!r}: give only one of api_key_env, api_key, api_key_sha256"
                f" (got {', '.join(given)})"
            )
        return self


def _sha256_hex(value: str) -> str:
    """`value` as a lower-case SHA-256 hex digest. Raises `ValueError` (never echoing it)."""
    digest = value.strip().lower()
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError("must be a SHA-256 digest: 64 hex characters (sha256sum of the key)")
    return digest


RuleName = Literal["header", "tenant_default", "tools", "run_id"]
RULES: tuple[RuleName, ...] = ("header", "tenant_default", "tools", "run_id")


class ClassificationSchema(_Strict):
    # Rules tried in order, first match wins; the default class applies when none matches.
    rules: list[RuleName] = Field(default_factory=lambda: list(RULES))
    tools_class: str = "agent"  # class of a request whose body has `tools`
    run_class: str = "agent"  # class of a request that carries a run identity
    default_class: str = "normal"


class RouterSchema(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    scrape_interval_s: float = Field(default=1.0, gt=0)
    scrape_timeout_s: float = Field(default=2.0, gt=0)
    stale_after_s: float = Field(default=5.0, gt=0)  # older telemetry counts as full
    unhealthy_after_failures: int = Field(default=2, ge=1)
    connect_timeout_s: float = Field(default=2.0, gt=0)
    upstream_timeout_s: float = Field(default=600.0, gt=0)
    max_connect_retries: int = Field(default=2, ge=0)
    ledger_path: str = "./.gpupool/ledger.sqlite"
    ledger_flush_interval_s: float = Field(default=0.5, gt=0)
    ledger_retention_days: float = Field(default=30.0, gt=0)
    state_path: str = "./.gpupool/state.json"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0)  # larger bodies: 413
    body_read_timeout_s: float = Field(default=30.0, gt=0)  # a slower upload: 408
    head_timeout_s: float = Field(default=10.0, gt=0)  # request line + headers slower: 408
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)  # larger request heads: 431
    # concurrent client connections (uvicorn limit_concurrency; it counts the arriving one, so N
    # admits N - 1 others); beyond it uvicorn answers a plain-text 503
    max_connections: int = Field(default=4096, ge=2)
    # on SIGTERM / Ctrl-C: new requests get 503, in-flight ones have this long to finish
    shutdown_grace_s: float = Field(default=10.0, gt=0)
    # on: KV-headroom and operating-point admission with per-pool queues; off: every request is
    # forwarded at once (the behaviour before admission, kept for comparison)
    admission: Literal["on", "off"] = "on"
    kv_margin_frac: float = Field(default=0.05, ge=0.0, lt=1.0)  # KV kept free on every instance
    # The operators' credential for /admin/* and /metrics, apart from any tenant's: the name of
    # an env var holding the key, or the key's hex SHA-256. With no admin credential (no such key
    # and no `admin: true` tenant) /admin/* answers 403, except on an open router (no keys at
    # all) listening on a loopback host (local development). See router/identity.py.
    admin_api_key_env: str | None = None
    admin_api_key_sha256: str | None = None
    # A read-only credential for Prometheus scrapers: reads /metrics, nothing else.
    metrics_api_key_env: str | None = None
    metrics_api_key_sha256: str | None = None

    @field_validator("admission", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `on` / `off` as a boolean
        if isinstance(value, bool):
            return "on" if value else "off"
        return value

    @field_validator("admin_api_key_sha256", "metrics_api_key_sha256")
    @classmethod
    def _hex_digest(cls, value: str | None) -> str | None:
        return None if value is None else _sha256_hex(value)

    @model_validator(mode="after")
    def _one_key_source(self) -> RouterSchema:
        for who in ("admin", "metrics"):
            if getattr(self, f"{who}_api_key_env") and getattr(self, f"{who}_api_key_sha256"):
                raise ValueError(f"give only one of {who}_api_key_env and {who}_api_key_sha256")
        return self


class ConfigSchema(_Strict):
    model: ModelSchema = Field(default_factory=ModelSchema)
    engines: EnginesSchema = Field(default_factory=EnginesSchema)
    pools: dict[str, PoolSchema]
    classes: dict[str, ClassSchema] = Field(default_factory=dict)
    tenants: list[TenantSchema] = Field(default_factory=list)
    classification: ClassificationSchema = Field(default_factory=ClassificationSchema)
    router: RouterSchema = Field(default_factory=RouterSchema)

    @model_validator(mode="after")
    def _engine_priority_needs_the_policy(self) -> ConfigSchema:
        wanted = [name for name, p in self.pools.items() if p.engine_priority is not None]
        args = self.engines.local.vllm_args
        has_policy = (
            any(
                a == "--scheduling-policy" and i + 1 < len(args) and args[i + 1] == "priority"
                for i, a in enumerate(args)
            )
            or "--scheduling-policy=priority" in args
        )
        if wanted and self.engines.launcher == "local" and not has_policy:
            raise ValueError(
                f"pools {', '.join(wanted)} set engine_priority, which vLLM refuses unless its"
                " engines run with `--scheduling-policy priority`: add it to"
                " engines.local.vllm_args"
            )
        return self

    @model_validator(mode="after")
    def _references(self) -> ConfigSchema:
        if not self.pools:
            raise ValueError("at least one pool is needed")
        owners: dict[str, str] = {}
        for pool_name, pool in self.pools.items():
            for cls in pool.classes:
                if cls in owners:
                    raise ValueError(
                        f"class {cls!r} is served by two pools ({owners[cls]!r} and {pool_name!r})"
                    )
                owners[cls] = pool_name
        for cls in self.classes:
            if cls not in owners:
                raise ValueError(f"classes.{cls} is not served by any pool")
        seen: set[str] = set()
        for tenant in self.tenants:
            if tenant.name in seen:
                raise ValueError(f"tenant {tenant.name!r} appears twice")
            seen.add(tenant.name)
            if tenant.default_class is not None and tenant.default_class not in owners:
                raise ValueError(
                    f"tenant {tenant.name!r}: default_class {tenant.default_class!r} is not served"
                    " by any pool"
                )
        c = self.classification
        for what, cls in (
            ("tools_class", c.tools_class),
            ("run_class", c.run_class),
            ("default_class", c.default_class),
        ):
            if cls not in owners:
                raise ValueError(
                    f"classification.{what}: class {cls!r} is not served by any pool (pools serve"
                    f" {', '.join(sorted(owners))})"
                )
        return self


# ---------------------------------------------------------------------------------------------
# The internal, frozen view the program reads.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    path: Path
    max_model_len_tokens: int | None
    load_format: str
    dtype: str


@dataclass(frozen=True, slots=True)
class LocalEnginesConfig:
    count: int
    gpus_per_instance: int
    host: str
    base_port: int
    kv_cache_bytes: int | None
    vllm_args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    cpu_affinity: tuple[tuple[int, ...], ...] | None
    startup_timeout_s: float
    restart_backoff_s: float
    restart_backoff_max_s: float
    stop_grace_s: float
    run_dir: Path
    api_key: str | None = field(default=None, repr=False)  # None: a random key per launch
    # env vars never passed to engines: every `*api_key_env` the config names (tenant, admin,
    # metrics and engine keys)
    secret_env: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class StaticEnginesConfig:
    urls: tuple[str, ...]
    gpus_per_instance: int
    api_key: str | None = field(default=None, repr=False)  # the engines' key; None: none


@dataclass(frozen=True, slots=True)
class EnginesConfig:
    launcher: str
    local: LocalEnginesConfig
    static: StaticEnginesConfig

    @property
    def instance_count(self) -> int:
        return len(self.static.urls) if self.launcher == "static" else self.local.count

    @property
    def gpus_per_instance(self) -> int:
        if self.launcher == "static":
            return self.static.gpus_per_instance
        return self.local.gpus_per_instance


@dataclass(frozen=True, slots=True)
class ShareConfig:
    initial_frac: float
    floor_frac: float
    ceiling_frac: float


@dataclass(frozen=True, slots=True)
class SloConfig:
    ttft_p95_ms: float
    tpot_p95_ms: float


@dataclass(frozen=True, slots=True)
class QueueConfig:
    max_depth: int
    max_wait_s: float
    order: str = "wfq"
    run_las_aging_s: float = 5.0
    run_las_idle_decay_s: float = 60.0


@dataclass(frozen=True, slots=True)
class PoolConfig:
    name: str
    classes: tuple[str, ...]
    share: ShareConfig
    slo: SloConfig
    queue: QueueConfig
    engine_priority: int | None = None


@dataclass(frozen=True, slots=True)
class ClassConfig:
    name: str
    timeout_s: float
    expected_output_tokens: int
    default_priority: int


@dataclass(frozen=True, slots=True)
class TenantConfig:
    name: str
    api_key: str | None = field(repr=False)  # None when given as a hash, or no key
    weight: float
    tokens_per_minute: int | None
    max_concurrent_runs: int | None
    default_class: str | None
    may_set_class: bool
    admin: bool = False
    api_key_sha256: str | None = None  # hex SHA-256 of the key however given; None: no key


@dataclass(frozen=True, slots=True)
class ClassificationConfig:
    rules: tuple[str, ...]
    tools_class: str
    run_class: str
    default_class: str


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str
    port: int
    scrape_interval_s: float
    scrape_timeout_s: float
    stale_after_s: float
    unhealthy_after_failures: int
    connect_timeout_s: float
    upstream_timeout_s: float
    max_connect_retries: int
    ledger_path: Path
    ledger_flush_interval_s: float
    ledger_retention_days: float
    state_path: Path
    log_level: str
    admission: str = "on"
    kv_margin_frac: float = 0.05
    max_body_bytes: int = 16 * 1024 * 1024
    body_read_timeout_s: float = 30.0
    head_timeout_s: float = 10.0
    max_header_bytes: int = 64 * 1024
    max_connections: int = 4096
    shutdown_grace_s: float = 10.0
    admin_api_key_sha256: str | None = None  # hex SHA-256 of the admin key; None: none set
    metrics_api_key_sha256: str | None = None  # hex SHA-256 of the scrape key; None: none set


@dataclass(frozen=True, slots=True)
class Config:
    model: ModelConfig
    engines: EnginesConfig
    pools: tuple[PoolConfig, ...]
    classes: tuple[ClassConfig, ...]
    tenants: tuple[TenantConfig, ...]
    classification: ClassificationConfig
    router: RouterConfig
    source: str = field(default="<default>")

    def pool(self, name: str) -> PoolConfig:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(name)

    def pool_for_class(self, class_name: str) -> PoolConfig | None:
        for pool in self.pools:
            if class_name in pool.classes:
                return pool
        return None

    def class_config(self, name: str) -> ClassConfig:
        for cls in self.classes:
            if cls.name == name:
                return cls
        return ClassConfig(
            name=name, timeout_s=300.0, expected_output_tokens=256, default_priority=0
        )

    @property
    def class_names(self) -> tuple[str, ...]:
        return tuple(c for pool in self.pools for c in pool.classes)


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def _format_validation_error(err: ValidationError) -> list[str]:
    problems = []
    for item in err.errors():
        where = ".".join(str(p) for p in item["loc"]) or "(top level)"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown field (check the spelling)"
        elif message.startswith("Value error, "):
            message = message[len("Value error, ") :]
        problems.append(f"{where}: {message}")
    return problems


def _resolve(base: Path, value: str) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else (base / path)


def _env_key(var: str, where: str, problems: list[str]) -> str | None:
    key = os.environ.get(var)
    if not key:
        problems.append(f"{where}: environment variable {var!r} is not set or empty")
    return key or None


def _key_sha256(key: str | None) -> str | None:
    return None if key is None else hashlib.sha256(key.encode()).hexdigest()


def _freeze_keys(
    schema: ConfigSchema, source: str, problems: list[str]
) -> tuple[list[TenantConfig], str | None, str | None]:
    """The tenants with their keys resolved and hashed, and the admin and metrics keys' hashes.

    Appends to `problems`: an unset env var, one key shared by two tenants (or by a tenant and
    the admin or metrics key). Warns about literal keys. Messages name tenants and variables,
    never a key or its hash.
    """
    tenants = []
    holder: dict[str, str] = {}  # key digest -> who holds it, as a message names it
    for t in schema.tenants:
        key = t.api_key
        if t.api_key_env is not None:
            key = _env_key(t.api_key_env, f"tenants.{t.name}.api_key_env", problems)
        elif key is not None:
            _log.warning(
                "%s: tenant %r has a literal api_key; prefer api_key_env (the name of an"
                " environment variable holding the key) or api_key_sha256 (the key's hash)",
                source,
                t.name,
            )
        digest = t.api_key_sha256 or _key_sha256(key)
        if digest is not None:
            if digest in holder:
                problems.append(
                    f"tenants: {holder[digest]} and tenant {t.name!r} have the same API key;"
                    " every tenant needs its own"
                )
            holder.setdefault(digest, f"tenant {t.name!r}")
        tenants.append(
            TenantConfig(
                name=t.name,
                api_key=key,
                weight=t.weight,
                tokens_per_minute=t.tokens_per_minute,
                max_concurrent_runs=t.max_concurrent_runs,
                default_class=t.default_class,
                may_set_class=t.may_set_class,
                admin=t.admin,
                api_key_sha256=digest,
            )
        )
    r = schema.router
    operators: list[str | None] = []
    for who in ("admin", "metrics"):
        var: str | None = getattr(r, f"{who}_api_key_env")
        operator_digest: str | None = getattr(r, f"{who}_api_key_sha256")
        where = f"router.{who}_api_key_sha256"
        if var is not None:
            where = f"router.{who}_api_key_env"
            operator_digest = _key_sha256(_env_key(var, where, problems))
        if operator_digest is not None:
            if operator_digest in holder:
                problems.append(
                    f"{where}: the same key as {holder[operator_digest]}; the admin and metrics"
                    " keys must differ from every other key"
                )
            holder.setdefault(operator_digest, where)
        operators.append(operator_digest)
    return tenants, operators[0], operators[1]


def _secret_env_names(node: Any) -> frozenset[str]:
    """Every env var name the config gives in a field called `api_key_env` or `*_api_key_env`,
    anywhere in the schema tree: the variables engines must not inherit."""
    names: set[str] = set()
    if isinstance(node, BaseModel):
        for name in type(node).model_fields:
            value = getattr(node, name)
            if name.endswith("api_key_env") and isinstance(value, str):
                names.add(value)
            else:
                names |= _secret_env_names(value)
    elif isinstance(node, list | tuple):
        for item in node:
            names |= _secret_env_names(item)
    elif isinstance(node, dict):
        for item in node.values():
            names |= _secret_env_names(item)
    return frozenset(names)


def _freeze(schema: ConfigSchema, base: Path, source: str) -> Config:
    problems: list[str] = []
    tenants, admin_sha256, metrics_sha256 = _freeze_keys(schema, source, problems)
    local_key, static_key = (
        _env_key(var, f"engines.{which}.api_key_env", problems) if var else None
        for which, var in (
            ("local", schema.engines.local.api_key_env),
            ("static", schema.engines.static.api_key_env),
        )
    )
    if problems:
        raise ConfigError(problems, source)
    local = schema.engines.local
    pools = tuple(
        PoolConfig(
            name=name,
            classes=tuple(p.classes),
            share=ShareConfig(p.share.initial_frac, p.share.floor_frac, p.share.ceiling_frac),
            slo=SloConfig(p.slo.ttft_p95_ms, p.slo.tpot_p95_ms),
            queue=QueueConfig(
                p.queue.max_depth,
                p.queue.max_wait_s,
                p.queue.order,
                p.queue.run_las_aging_s,
                p.queue.run_las_idle_decay_s,
            ),
            engine_priority=p.engine_priority,
        )
        for name, p in schema.pools.items()
    )
    class_names = [c for p in pools for c in p.classes]
    classes = tuple(
        ClassConfig(
            name=c,
            timeout_s=schema.classes[c].timeout_s if c in schema.classes else 300.0,
            expected_output_tokens=(
                schema.classes[c].expected_output_tokens if c in schema.classes else 256
            ),
            default_priority=schema.classes[c].default_priority if c in schema.classes else 0,
        )
        for c in class_names
    )
    r = schema.router
    return Config(
        model=ModelConfig(
            name=schema.model.name,
            path=_resolve(base, schema.model.path),
            max_model_len_tokens=schema.model.max_model_len_tokens,
            load_format=schema.model.load_format,
            dtype=schema.model.dtype,
        ),
        engines=EnginesConfig(
            launcher=schema.engines.launcher,
            local=LocalEnginesConfig(
                count=local.count,
                gpus_per_instance=local.gpus_per_instance,
                host=local.host,
                base_port=local.base_port,
                kv_cache_bytes=local.kv_cache_bytes,
                vllm_args=tuple(local.vllm_args),
                env=tuple(sorted(local.env.items())),
                cpu_affinity=(
                    tuple(tuple(c) for c in local.cpu_affinity) if local.cpu_affinity else None
                ),
                startup_timeout_s=local.startup_timeout_s,
                restart_backoff_s=local.restart_backoff_s,
                restart_backoff_max_s=local.restart_backoff_max_s,
                stop_grace_s=local.stop_grace_s,
                run_dir=_resolve(base, local.run_dir),
                api_key=local_key,
                secret_env=_secret_env_names(schema),
            ),
            static=StaticEnginesConfig(
                urls=tuple(u.rstrip("/") for u in schema.engines.static.urls),
                gpus_per_instance=schema.engines.static.gpus_per_instance,
                api_key=static_key,
            ),
        ),
        pools=pools,
        classes=classes,
        tenants=tuple(tenants),
        classification=ClassificationConfig(
            rules=tuple(schema.classification.rules),
            tools_class=schema.classification.tools_class,
            run_class=schema.classification.run_class,
            default_class=schema.classification.default_class,
        ),
        router=RouterConfig(
            host=r.host,
            port=r.port,
            scrape_interval_s=r.scrape_interval_s,
            scrape_timeout_s=r.scrape_timeout_s,
            stale_after_s=r.stale_after_s,
            unhealthy_after_failures=r.unhealthy_after_failures,
            connect_timeout_s=r.connect_timeout_s,
            upstream_timeout_s=r.upstream_timeout_s,
            max_connect_retries=r.max_connect_retries,
            ledger_path=_resolve(base, r.ledger_path),
            ledger_flush_interval_s=r.ledger_flush_interval_s,
            ledger_retention_days=r.ledger_retention_days,
            state_path=_resolve(base, r.state_path),
            log_level=r.log_level,
            admission=r.admission,
            kv_margin_frac=r.kv_margin_frac,
            max_body_bytes=r.max_body_bytes,
            body_read_timeout_s=r.body_read_timeout_s,
            head_timeout_s=r.head_timeout_s,
            max_header_bytes=r.max_header_bytes,
            max_connections=r.max_connections,
            shutdown_grace_s=r.shutdown_grace_s,
            admin_api_key_sha256=admin_sha256,
            metrics_api_key_sha256=metrics_sha256,
        ),
        source=source,
    )


def parse_config(data: Any, *, base_dir: Path | None = None, source: str = "config") -> Config:
    """Validate a parsed YAML document and freeze it. Raises `ConfigError`."""
    if not isinstance(data, dict):
        raise ConfigError(["(top level): expected a mapping of sections"], source)
    try:
        schema = ConfigSchema.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err), source) from None
    return _freeze(schema, base_dir or Path.cwd(), source)


def load_config(path: str | Path | None = None) -> Config:
    """Load `path`, or the built-in default when `path` is None. Raises `ConfigError`.

    Relative paths inside the file resolve against the current directory, as the CLI runs
    from the repository root.
    """
    if path is None:
        return default_config()
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError([f"cannot read the file: {err.strerror}"], str(path)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError([f"not valid YAML: {err}"], str(path)) from None
    return parse_config(data, base_dir=Path.cwd(), source=str(path))


DEFAULT_CPU_CONFIG: dict[str, Any] = {
    "model": {"name": "tiny", "path": "./.gpupool/models/tiny", "max_model_len_tokens": 4096},
    "engines": {
        "launcher": "local",
        "local": {
            "count": 3,
            "gpus_per_instance": 1,
            # 64 MiB of KV: with the tiny model that is a few thousand blocks' worth of tokens,
            # small enough that admission matters and an engine fits in ~2.5 GiB of RAM.
            "kv_cache_bytes": 64 * 1024 * 1024,
            "vllm_args": ["--max-num-seqs", "64"],
        },
    },
    "pools": {
        "agent": {
            "classes": ["agent"],
            "share": {"initial_frac": 0.34, "floor_frac": 0.2, "ceiling_frac": 0.67},
            "slo": {"ttft_p95_ms": 3000, "tpot_p95_ms": 150},
            "queue": {"max_depth": 256, "max_wait_s": 30},
        },
        "normal": {
            "classes": ["normal"],
            "share": {"initial_frac": 0.66, "floor_frac": 0.33, "ceiling_frac": 0.8},
            "slo": {"ttft_p95_ms": 800, "tpot_p95_ms": 80},
            "queue": {"max_depth": 256, "max_wait_s": 5},
        },
    },
    "classes": {
        "agent": {"timeout_s": 600, "expected_output_tokens": 256},
        "normal": {"timeout_s": 120, "expected_output_tokens": 128},
    },
}


def default_config() -> Config:
    """The embedded default: three local engines serving the tiny dev model, one for the agent
    pool and two for the normal pool."""
    return parse_config(DEFAULT_CPU_CONFIG, base_dir=Path.cwd(), source="<built-in default>")


# ---------------------------------------------------------------------------------------------
# Contract consistency (gpupool check-config)
# ---------------------------------------------------------------------------------------------


def not_yet_in_effect(config: Config) -> list[str]:
    """Settings that are validated but do not steer anything yet (printed by check-config).

    The pool ratio stays at `initial_frac` until the rebalancer exists: `floor_frac` and
    `ceiling_frac` are checked for consistency only, and nothing reads `router.state_path`.
    """
    notes = []
    bounded = [p.name for p in config.pools if p.share.floor_frac > 0 or p.share.ceiling_frac < 1]
    if bounded:
        notes.append(
            f"pools {', '.join(bounded)}: share.floor_frac / share.ceiling_frac are checked for"
            " consistency but not used yet: the ratio stays at initial_frac (no rebalancer yet)"
        )
    notes.append("router.state_path: not used yet (it will hold the rebalancer's SRE settings)")
    return notes


def contract_problems(config: Config) -> list[str]:
    """Checks the numbers fit together. Returns human-readable problems; empty means consistent.

    - pool floors sum to at most 1 and ceilings to at least 1, initial shares sum to 1;
    - for every class: its pool's max queue wait + expected execution (TTFT target plus the
      expected output tokens at the TPOT target) fits the class timeout;
    - each pool can hold at least one instance's worth of capacity (ceiling >= 1/instances)
      when there is more than one instance;
    - no tenant sets a limit that is not enforced yet (`tokens_per_minute`,
      `max_concurrent_runs`).
    """
    problems: list[str] = []
    eps = 1e-6
    floors = sum(p.share.floor_frac for p in config.pools)
    ceilings = sum(p.share.ceiling_frac for p in config.pools)
    initial = sum(p.share.initial_frac for p in config.pools)
    if floors > 1 + eps:
        problems.append(f"pools: floor_frac values sum to {floors:.3f}, more than 1")
    if ceilings < 1 - eps:
        problems.append(f"pools: ceiling_frac values sum to {ceilings:.3f}, less than 1")
    if abs(initial - 1) > 0.02:
        problems.append(f"pools: initial_frac values sum to {initial:.3f}, must sum to 1")
    for pool in config.pools:
        for cls_name in pool.classes:
            cls = config.class_config(cls_name)
            exec_s = (
                pool.slo.ttft_p95_ms + cls.expected_output_tokens * pool.slo.tpot_p95_ms
            ) / 1e3
            need_s = pool.queue.max_wait_s + exec_s
            if need_s > cls.timeout_s + eps:
                problems.append(
                    f"classes.{cls_name}: queue wait {pool.queue.max_wait_s:g} s + expected "
                    f"execution {exec_s:.1f} s (ttft {pool.slo.ttft_p95_ms:g} ms + "
                    f"{cls.expected_output_tokens} tokens x {pool.slo.tpot_p95_ms:g} ms) = "
                    f"{need_s:.1f} s exceeds timeout_s {cls.timeout_s:g}"
                )
    n = config.engines.instance_count
    if n > 1:
        for pool in config.pools:
            if pool.share.ceiling_frac * n < 1 - eps:
                problems.append(
                    f"pools.{pool.name}.share.ceiling_frac: {pool.share.ceiling_frac:g} of {n}"
                    f" instances is less than one instance ({1 / n:.3f})"
                )
    for tenant in config.tenants:
        for name in ("tokens_per_minute", "max_concurrent_runs"):
            if getattr(tenant, name) is not None:
                problems.append(
                    f"tenants.{tenant.name}.{name}: not enforced yet (tenant token budgets and"
                    " run limits are a later issue); remove it rather than rely on it"
                )
    affinity = config.engines.local.cpu_affinity
    if config.engines.launcher == "local" and affinity is not None and len(affinity) != n:
        problems.append(
            f"engines.local.cpu_affinity: {len(affinity)} CPU lists for {n} engines"
            f" (engines.local.count); give one list per engine, e.g."
            f" {[[i] for i in range(n)]}"
        )
    return problems
