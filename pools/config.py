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
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from pools.rebalance import Bounds, RebalanceSettings, ScheduleWindow, bounds_at

__all__ = [
    "ClassConfig",
    "ClassificationConfig",
    "Config",
    "ConfigError",
    "EnginesConfig",
    "KubernetesEnginesConfig",
    "KubernetesServiceConfig",
    "LocalEnginesConfig",
    "ModelConfig",
    "PoolConfig",
    "RayEnginesConfig",
    "RebalancerConfig",
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


class KubernetesServiceSchema(_Strict):
    name: str = Field(min_length=1, max_length=63)  # a headless Service of one engine group
    port: int = Field(default=8000, ge=1, le=65535)  # the engines' HTTP port
    gpus_per_instance: int = Field(default=1, ge=1, le=16)  # a CPU engine counts as 1


class KubernetesEnginesSchema(_Strict):
    """Engines found in Kubernetes (the Helm chart's engine groups): every ready endpoint of
    the listed headless Services is an instance; one that goes away drains, then leaves."""

    services: list[KubernetesServiceSchema] = Field(default_factory=list)
    namespace: str | None = None  # None: the router pod's own (its service account's)
    # api: EndpointSlices through the API server (read-only RBAC; instance ids are pod names);
    # dns: the headless Service's A records (no RBAC; instance ids follow pod IPs)
    discovery: Literal["api", "dns"] = "api"
    poll_interval_s: float = Field(default=2.0, gt=0)
    drain_timeout_s: float = Field(default=600.0, ge=0)  # a leaving engine's in-flight work
    cluster_domain: str = "cluster.local"  # dns discovery: <service>.<namespace>.svc.<domain>
    api_key_env: str | None = None  # env var holding the engines' key (VLLM_API_KEY)


class RayEnginesSchema(_Strict):
    """Engines as Ray actors, one per instance, each holding `gpus_per_instance` GPUs (0: a
    CPU engine holding `cpus_per_instance` CPUs); Ray restarts a dead one."""

    address: str | None = None  # None: start a local Ray cluster; "auto" or "host:port": join
    count: int = Field(default=1, ge=1, le=256)
    gpus_per_instance: int = Field(default=1, ge=0, le=16)
    cpus_per_instance: float = Field(default=1.0, gt=0)
    kv_cache_bytes: int | None = Field(default=None, gt=0)  # None: engine default
    vllm_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    max_restarts: int = Field(default=-1, ge=-1)  # Ray's max_restarts per actor; -1: forever
    startup_timeout_s: float = Field(default=600.0, gt=0)
    poll_interval_s: float = Field(default=2.0, gt=0)  # addresses re-read this often
    drain_timeout_s: float = Field(default=600.0, ge=0)
    namespace: str = "gpupool"  # Ray namespace of the engine actors
    api_key_env: str | None = None  # None: a random key per launch
    # the ports an engine may listen on, [first, last], the first free one taken on its node;
    # None: any free port the node gives
    port_range: tuple[int, int] | None = None

    @model_validator(mode="after")
    def _no_forbidden_flags(self) -> RayEnginesSchema:
        if self.port_range is not None and not 1024 <= self.port_range[0] <= self.port_range[1]:
            raise ValueError("port_range: needs [first, last] with 1024 <= first <= last")
        if "--disable-log-stats" in self.vllm_args:
            raise ValueError(
                "vllm_args: --disable-log-stats removes every vllm:* metric gpupool's telemetry"
                " and admission need; remove it"
            )
        return self


class EnginesSchema(_Strict):
    launcher: Literal["local", "static", "ray", "kubernetes"] = "local"
    local: LocalEnginesSchema = Field(default_factory=LocalEnginesSchema)
    static: StaticEnginesSchema = Field(default_factory=StaticEnginesSchema)
    kubernetes: KubernetesEnginesSchema = Field(default_factory=KubernetesEnginesSchema)
    ray: RayEnginesSchema = Field(default_factory=RayEnginesSchema)

    @model_validator(mode="after")
    def _static_has_urls(self) -> EnginesSchema:
        if self.launcher == "static" and not self.static.urls:
            raise ValueError("launcher 'static' needs at least one URL in engines.static.urls")
        if self.launcher == "kubernetes" and not self.kubernetes.services:
            raise ValueError(
                "launcher 'kubernetes' needs at least one headless Service in"
                " engines.kubernetes.services"
            )
        names = [s.name for s in self.kubernetes.services]
        if len(set(names)) != len(names):
            raise ValueError("engines.kubernetes.services: a Service is listed twice")
        return self


def _minute_of_day(value: str) -> int:
    """Minutes after midnight of a time of day "HH:MM" (UTC). Raises `ValueError`."""
    hours, sep, minutes = value.partition(":")
    if not sep or not hours.isdigit() or not minutes.isdigit() or len(minutes) != 2:
        raise ValueError(f"expected a time of day as HH:MM (UTC), got {value!r}")
    h, m = int(hours), int(minutes)
    if not (0 <= h <= 24 and 0 <= m < 60) or h * 60 + m > 1440:
        raise ValueError(f"time of day {value!r} is out of range (00:00 to 24:00)")
    return h * 60 + m


class ShareWindowSchema(_Strict):
    """Bounds that apply between two times of day (UTC); `end` before `start` wraps past
    midnight (night: start 20:00, end 08:00)."""

    start: str  # "HH:MM", UTC
    end: str
    floor_frac: float = Field(default=0.0, ge=0.0, le=1.0)
    ceiling_frac: float = Field(default=1.0, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _valid(self) -> ShareWindowSchema:
        if _minute_of_day(self.start) == _minute_of_day(self.end):
            raise ValueError(f"schedule window {self.start} to {self.end} is empty")
        if self.floor_frac > self.ceiling_frac:
            raise ValueError(
                f"schedule window {self.start} to {self.end}: floor_frac {self.floor_frac} is"
                f" above ceiling_frac {self.ceiling_frac}"
            )
        return self


class ShareSchema(_Strict):
    initial_frac: float = Field(ge=0.0, le=1.0)
    floor_frac: float = Field(default=0.0, ge=0.0, le=1.0)
    ceiling_frac: float = Field(default=1.0, ge=0.0, le=1.0)
    # time-of-day bounds for the rebalancer (the first window covering the time wins; outside
    # every window floor_frac / ceiling_frac apply)
    schedule: list[ShareWindowSchema] = Field(default_factory=list)

    @model_validator(mode="after")
    def _ordered(self) -> ShareSchema:
        if not self.floor_frac <= self.initial_frac <= self.ceiling_frac:
            raise ValueError(
                f"needs floor_frac <= initial_frac <= ceiling_frac, got {self.floor_frac} / "
                f"{self.initial_frac} / {self.ceiling_frac}"
            )
        return self


class RebalancerSchema(_Strict):
    """The loop that moves the pool ratio with demand (pools/rebalance.py)."""

    enabled: bool = False  # off: the ratio stays where initial_frac and the SREs put it
    interval_s: float = Field(default=30.0, gt=0)  # one decision (at most one step) per interval
    hysteresis_frac: float = Field(default=0.2, ge=0)  # pressure gap below which nothing moves
    cooldown_s: float = Field(default=60.0, ge=0)  # after a move, none for this long
    smoothing_window_s: float = Field(default=90.0, gt=0)  # pressure averaged over this window
    max_step_frac: float = Field(default=0.1, gt=0, le=1.0)  # largest share moved per step
    # a pool keeps one instance's worth until this long after its last request
    traffic_memory_s: float = Field(default=600.0, ge=0)
    # a whole instance moving pools joins its new pool when its old sequences finish, or after
    # this long (they then finish where they are)
    drain_timeout_s: float = Field(default=60.0, ge=0)
    # a pool's overflow may use up to this fraction of another pool's instance while that pool
    # has nothing waiting (0: no borrowing)
    borrow_max_frac: float = Field(default=0.0, ge=0.0, le=1.0)
    # SQLite, one row per decision and per SRE change; None: decisions.sqlite beside
    # router.state_path
    decision_log_path: str | None = None
    decision_log_retention_days: float = Field(default=30.0, gt=0)


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
    # run_las only: attained GPU-seconds count up to this; runs past it keep their arrival
    # order among themselves (None: no cap, pure least attained service)
    run_las_max_attained_gpu_s: float | None = Field(default=None, gt=0)
    # run_las only: a step is due (goes first on its tenant's turn) once its queue position,
    # summed over its run's steps, reaches this times what FIFO would have given it (None: off)
    run_las_max_slowdown: float | None = Field(default=1.3, ge=1)

    @model_validator(mode="after")
    def _run_las_fields(self) -> QueueSchema:
        las_fields = {
            "run_las_aging_s",
            "run_las_idle_decay_s",
            "run_las_max_attained_gpu_s",
            "run_las_max_slowdown",
        } & self.model_fields_set
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
    # instance ids (engine-0, ...) that always belong to this pool, whole: placed here first
    # and never moved by the rebalancer
    pinned_instances: list[str] = Field(default_factory=list)
    # where a run's next step goes: always_affinity (the default: wait for the instance
    # holding its prefix while it is healthy), affinity_or_move (stay there unless another
    # instance has spare room and waiting costs more than the whole move there), least_loaded
    # (ignore affinity); router/picking.py, docs/run_scheduling.md
    placement: Literal["affinity_or_move", "always_affinity", "least_loaded"] = "always_affinity"
    # vLLM request `priority` sent with this pool's requests (lower is scheduled first inside
    # the engine); None sends none. Needs engines started with `--scheduling-policy priority`
    # (the local launcher adds it when any pool sets this).
    engine_priority: int | None = None


class RunGuardsSchema(_Strict):
    """Limits on one agent run (an explicit run id, or one task of a session: a user message
    and the tool steps after it); null: no limit. A stopped run's next step gets 403 with code
    run_steps / run_tokens / run_gpu_seconds / run_duration / run_loop and the setting to raise
    (router/governance/guards.py); ending the run releases its id.

    The defaults stop runaways, not work: a coding agent's task (Claude Code, Codex) takes
    a few hundred tool steps and may stay busy for an hour, so the step limit is 500 (the 501st
    dispatched step is refused; refused and failed attempts do not count) and the duration is
    one hour of active time (pauses longer than governance.run_idle_timeout_s do not count).
    Loop detection (loop_repeats) catches an agent stuck on one call long before either."""

    max_steps: int | None = Field(default=500, gt=0)  # steps dispatched to an engine
    max_tokens: int | None = Field(default=None, gt=0)  # prompt + completion, settled
    max_gpu_seconds: float | None = Field(default=None, gt=0)
    max_duration_s: float | None = Field(default=3600.0, gt=0)  # active time
    loop_repeats: int = Field(default=3, ge=0)  # same tool call + arguments N times; 0: off


class TierSchema(_Strict):
    """A concurrency tier (tenants pick one with `tier`)."""

    max_concurrent_runs: int = Field(gt=0)  # active agent runs at once
    max_concurrent_requests: int = Field(gt=0)  # requests in flight at once
    queue_weight: float = Field(default=1.0, gt=0)  # multiplies the tenant's WFQ weight


DEFAULT_TIERS: dict[str, dict[str, float]] = {
    "free": {"max_concurrent_runs": 1, "max_concurrent_requests": 2, "queue_weight": 1.0},
    "paid": {"max_concurrent_runs": 3, "max_concurrent_requests": 8, "queue_weight": 2.0},
    "enterprise": {"max_concurrent_runs": 10, "max_concurrent_requests": 32, "queue_weight": 4.0},
}
DEFAULT_TASK_TYPES_S: dict[str, float] = {"short": 180.0, "standard": 600.0, "long": 1800.0}


class GovernanceSchema(_Strict):
    # merged over DEFAULT_TIERS (a tier given here replaces the default of that name)
    tiers: dict[str, TierSchema] = Field(default_factory=dict)
    # a run with no step for this long is no longer active (frees its concurrency slot)
    run_idle_timeout_s: float = Field(default=120.0, gt=0)
    # x-gpupool-task-type (or the tenant's task_type) -> the run's max_duration_s; merged over
    # DEFAULT_TASK_TYPES_S
    task_types_s: dict[str, float] = Field(default_factory=dict)
    cost_alert_frac: float = Field(default=0.8, gt=0, le=1)  # of the hourly cost cap
    # a daily budget scales the tenant's token and request rates by (1 - spent fraction),
    # never below this fraction of them
    daily_min_rate_frac: float = Field(default=0.1, gt=0, le=1)

    @field_validator("task_types_s")
    @classmethod
    def _positive_durations(cls, value: dict[str, float]) -> dict[str, float]:
        for name, seconds in value.items():
            if not seconds > 0:
                raise ValueError(f"task type {name!r}: duration must be > 0 seconds")
        return value


class ClassSchema(_Strict):
    timeout_s: float = Field(default=300.0, gt=0)  # whole request, queue wait included
    expected_output_tokens: int = Field(default=256, gt=0)  # used before p95 is observed
    default_priority: int = 0
    run_guards: RunGuardsSchema = Field(default_factory=RunGuardsSchema)


class TenantSchema(_Strict):
    name: str = Field(min_length=1)
    # The key, given one way at most (none: the tenant has no key; see router/identity.py):
    api_key_env: str | None = None  # name of the env var holding the key
    api_key: str | None = Field(default=None, repr=False)  # literal key: warns at load
    api_key_sha256: str | None = None  # hex SHA-256 of the key: the config holds no secret
    weight: float = Field(default=1.0, gt=0)
    tokens_per_minute: int | None = Field(default=None, gt=0)  # prompt + completion
    requests_per_minute: int | None = Field(default=None, gt=0)
    tier: str | None = None  # a governance tier (free / paid / enterprise or one configured)
    max_concurrent_runs: int | None = Field(default=None, gt=0)  # overrides the tier's
    cost_cap_gpu_seconds_per_hour: float | None = Field(default=None, gt=0)
    daily_budget_gpu_seconds: float | None = Field(default=None, gt=0)
    borrow_max_frac: float | None = Field(default=None, ge=0, le=1)
    task_type: str | None = None  # default x-gpupool-task-type of its runs
    # overrides of its classes' run guards (only the fields given)
    run_guards: RunGuardsSchema | None = None
    default_class: str | None = None
    may_set_class: bool = True
    # the best queue priority its requests may ask for (x-gpupool-priority; higher goes
    # first): a higher one is clamped to it (or to the class's default_priority when that is
    # higher). The body's vLLM `priority` (lower goes first) is clamped to no better than
    # the pool's engine_priority (0 when unset) minus this.
    max_priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
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
    # each request's record is committed before its response's final bytes (false: batched)
    ledger_durable: StrictBool = True
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
    # sequences at once on an engine whose /metrics lacks vllm:cache_config_info (its KV
    # capacity unknown: no KV headroom check there); its operating point may lower it further
    unknown_kv_max_concurrency: int = Field(default=16, ge=1)
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
    governance: GovernanceSchema = Field(default_factory=GovernanceSchema)
    rebalancer: RebalancerSchema = Field(default_factory=RebalancerSchema)

    @model_validator(mode="after")
    def _pins_are_unique(self) -> ConfigSchema:
        owner: dict[str, str] = {}
        for name, pool in self.pools.items():
            for instance_id in pool.pinned_instances:
                if instance_id in owner:
                    raise ValueError(
                        f"instance {instance_id!r} is pinned to two pools ({owner[instance_id]!r}"
                        f" and {name!r})"
                    )
                owner[instance_id] = name
        return self

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
            tiers = {**DEFAULT_TIERS, **self.governance.tiers}
            if tenant.tier is not None and tenant.tier not in tiers:
                raise ValueError(
                    f"tenant {tenant.name!r}: tier {tenant.tier!r} is not a governance tier"
                    f" (known: {', '.join(sorted(tiers))})"
                )
            task_types = {**DEFAULT_TASK_TYPES_S, **self.governance.task_types_s}
            if tenant.task_type is not None and tenant.task_type not in task_types:
                raise ValueError(
                    f"tenant {tenant.name!r}: task_type {tenant.task_type!r} is not in"
                    f" governance.task_types_s (known: {', '.join(sorted(task_types))})"
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
class KubernetesServiceConfig:
    name: str
    port: int
    gpus_per_instance: int


@dataclass(frozen=True, slots=True)
class KubernetesEnginesConfig:
    services: tuple[KubernetesServiceConfig, ...] = ()
    namespace: str | None = None
    discovery: str = "api"
    poll_interval_s: float = 2.0
    drain_timeout_s: float = 600.0
    cluster_domain: str = "cluster.local"
    api_key: str | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class RayEnginesConfig:
    address: str | None = None
    count: int = 1
    gpus_per_instance: int = 1  # 0: CPU engines
    cpus_per_instance: float = 1.0
    kv_cache_bytes: int | None = None
    vllm_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    max_restarts: int = -1
    startup_timeout_s: float = 600.0
    poll_interval_s: float = 2.0
    drain_timeout_s: float = 600.0
    namespace: str = "gpupool"
    api_key: str | None = field(default=None, repr=False)  # None: a random key per launch
    secret_env: frozenset[str] = frozenset()  # env vars never passed to engines
    port_range: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class EnginesConfig:
    launcher: str
    local: LocalEnginesConfig
    static: StaticEnginesConfig
    kubernetes: KubernetesEnginesConfig = KubernetesEnginesConfig()
    ray: RayEnginesConfig = RayEnginesConfig()

    @property
    def instance_count(self) -> int:
        """Instances the config names; 0 for kubernetes (they are discovered at run time)."""
        if self.launcher == "static":
            return len(self.static.urls)
        if self.launcher == "ray":
            return self.ray.count
        if self.launcher == "kubernetes":
            return 0
        return self.local.count

    @property
    def gpus_per_instance(self) -> int:
        if self.launcher == "static":
            return self.static.gpus_per_instance
        if self.launcher == "ray":
            return max(1, self.ray.gpus_per_instance)
        if self.launcher == "kubernetes":
            return max(s.gpus_per_instance for s in self.kubernetes.services)
        return self.local.gpus_per_instance

    @property
    def vllm_args(self) -> tuple[str, ...]:
        """The engines' extra vLLM arguments where gpupool starts them (local, ray)."""
        return self.ray.vllm_args if self.launcher == "ray" else self.local.vllm_args


@dataclass(frozen=True, slots=True)
class ShareConfig:
    initial_frac: float
    floor_frac: float
    ceiling_frac: float
    schedule: tuple[ScheduleWindow, ...] = ()

    @property
    def bounds(self) -> Bounds:
        return Bounds(self.floor_frac, self.ceiling_frac)


@dataclass(frozen=True, slots=True)
class RebalancerConfig:
    enabled: bool = False
    interval_s: float = 30.0
    hysteresis_frac: float = 0.2
    cooldown_s: float = 60.0
    smoothing_window_s: float = 90.0
    max_step_frac: float = 0.1
    traffic_memory_s: float = 600.0
    drain_timeout_s: float = 60.0
    borrow_max_frac: float = 0.0
    decision_log_path: Path = Path("./.gpupool/decisions.sqlite")
    decision_log_retention_days: float = 30.0

    @property
    def settings(self) -> RebalanceSettings:
        return RebalanceSettings(
            interval_s=self.interval_s,
            hysteresis_frac=self.hysteresis_frac,
            cooldown_s=self.cooldown_s,
            smoothing_window_s=self.smoothing_window_s,
            max_step_frac=self.max_step_frac,
            traffic_memory_s=self.traffic_memory_s,
        )


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
    run_las_max_attained_gpu_s: float | None = None
    run_las_max_slowdown: float | None = 1.3


@dataclass(frozen=True, slots=True)
class PoolConfig:
    name: str
    classes: tuple[str, ...]
    share: ShareConfig
    slo: SloConfig
    queue: QueueConfig
    engine_priority: int | None = None
    pinned_instances: tuple[str, ...] = ()
    placement: str = "always_affinity"


@dataclass(frozen=True, slots=True)
class RunGuardsConfig:
    max_steps: int | None = 500
    max_tokens: int | None = None
    max_gpu_seconds: float | None = None
    max_duration_s: float | None = 3600.0
    loop_repeats: int = 3


@dataclass(frozen=True, slots=True)
class TierConfig:
    name: str
    max_concurrent_runs: int
    max_concurrent_requests: int
    queue_weight: float = 1.0


@dataclass(frozen=True, slots=True)
class GovernanceConfig:
    tiers: tuple[TierConfig, ...] = tuple(
        TierConfig(name, int(t["max_concurrent_runs"]), int(t["max_concurrent_requests"]),
                   t["queue_weight"])
        for name, t in DEFAULT_TIERS.items()
    )  # fmt: skip
    run_idle_timeout_s: float = 120.0
    task_types_s: tuple[tuple[str, float], ...] = tuple(DEFAULT_TASK_TYPES_S.items())
    cost_alert_frac: float = 0.8
    daily_min_rate_frac: float = 0.1

    def tier(self, name: str | None) -> TierConfig | None:
        return next((t for t in self.tiers if t.name == name), None)


@dataclass(frozen=True, slots=True)
class ClassConfig:
    name: str
    timeout_s: float
    expected_output_tokens: int
    default_priority: int
    run_guards: RunGuardsConfig = RunGuardsConfig()


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
    requests_per_minute: int | None = None
    tier: str | None = None
    cost_cap_gpu_seconds_per_hour: float | None = None
    daily_budget_gpu_seconds: float | None = None
    borrow_max_frac: float | None = None
    task_type: str | None = None
    max_priority: int = 0
    # the run guard fields the tenant overrides, as (field, value) pairs
    run_guards: tuple[tuple[str, float | int | None], ...] = ()


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
    ledger_durable: bool
    state_path: Path
    log_level: str
    admission: str = "on"
    kv_margin_frac: float = 0.05
    unknown_kv_max_concurrency: int = 16
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
    governance: GovernanceConfig = GovernanceConfig()
    rebalancer: RebalancerConfig = RebalancerConfig()

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
                requests_per_minute=t.requests_per_minute,
                tier=t.tier,
                cost_cap_gpu_seconds_per_hour=t.cost_cap_gpu_seconds_per_hour,
                daily_budget_gpu_seconds=t.daily_budget_gpu_seconds,
                borrow_max_frac=t.borrow_max_frac,
                task_type=t.task_type,
                max_priority=t.max_priority,
                run_guards=(
                    ()
                    if t.run_guards is None
                    else tuple(
                        (k, getattr(t.run_guards, k)) for k in sorted(t.run_guards.model_fields_set)
                    )
                ),
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
    local_key, static_key, kubernetes_key, ray_key = (
        _env_key(var, f"engines.{which}.api_key_env", problems) if var else None
        for which, var in (
            ("local", schema.engines.local.api_key_env),
            ("static", schema.engines.static.api_key_env),
            ("kubernetes", schema.engines.kubernetes.api_key_env),
            ("ray", schema.engines.ray.api_key_env),
        )
    )
    if problems:
        raise ConfigError(problems, source)
    local = schema.engines.local
    pools = tuple(
        PoolConfig(
            name=name,
            classes=tuple(p.classes),
            share=ShareConfig(
                p.share.initial_frac,
                p.share.floor_frac,
                p.share.ceiling_frac,
                tuple(
                    ScheduleWindow(
                        _minute_of_day(w.start),
                        _minute_of_day(w.end),
                        Bounds(w.floor_frac, w.ceiling_frac),
                    )
                    for w in p.share.schedule
                ),
            ),
            slo=SloConfig(p.slo.ttft_p95_ms, p.slo.tpot_p95_ms),
            queue=QueueConfig(
                p.queue.max_depth,
                p.queue.max_wait_s,
                p.queue.order,
                p.queue.run_las_aging_s,
                p.queue.run_las_idle_decay_s,
                p.queue.run_las_max_attained_gpu_s,
                p.queue.run_las_max_slowdown,
            ),
            engine_priority=p.engine_priority,
            pinned_instances=tuple(p.pinned_instances),
            placement=p.placement,
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
            run_guards=_freeze_run_guards(
                schema.classes[c].run_guards if c in schema.classes else RunGuardsSchema()
            ),
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
            kubernetes=_freeze_kubernetes(schema.engines.kubernetes, kubernetes_key),
            ray=_freeze_ray(schema.engines.ray, ray_key, _secret_env_names(schema)),
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
            ledger_durable=r.ledger_durable,
            state_path=_resolve(base, r.state_path),
            log_level=r.log_level,
            admission=r.admission,
            kv_margin_frac=r.kv_margin_frac,
            unknown_kv_max_concurrency=r.unknown_kv_max_concurrency,
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
        governance=_freeze_governance(schema.governance),
        rebalancer=_freeze_rebalancer(schema.rebalancer, base, _resolve(base, r.state_path)),
    )


def _freeze_rebalancer(r: RebalancerSchema, base: Path, state_path: Path) -> RebalancerConfig:
    return RebalancerConfig(
        enabled=r.enabled,
        interval_s=r.interval_s,
        hysteresis_frac=r.hysteresis_frac,
        cooldown_s=r.cooldown_s,
        smoothing_window_s=r.smoothing_window_s,
        max_step_frac=r.max_step_frac,
        traffic_memory_s=r.traffic_memory_s,
        drain_timeout_s=r.drain_timeout_s,
        borrow_max_frac=r.borrow_max_frac,
        decision_log_path=(
            state_path.with_name("decisions.sqlite")
            if r.decision_log_path is None
            else _resolve(base, r.decision_log_path)
        ),
        decision_log_retention_days=r.decision_log_retention_days,
    )


def _freeze_kubernetes(k: KubernetesEnginesSchema, key: str | None) -> KubernetesEnginesConfig:
    return KubernetesEnginesConfig(
        services=tuple(
            KubernetesServiceConfig(s.name, s.port, s.gpus_per_instance) for s in k.services
        ),
        namespace=k.namespace,
        discovery=k.discovery,
        poll_interval_s=k.poll_interval_s,
        drain_timeout_s=k.drain_timeout_s,
        cluster_domain=k.cluster_domain,
        api_key=key,
    )


def _freeze_ray(
    r: RayEnginesSchema, key: str | None, secret_env: frozenset[str]
) -> RayEnginesConfig:
    return RayEnginesConfig(
        address=r.address,
        count=r.count,
        gpus_per_instance=r.gpus_per_instance,
        cpus_per_instance=r.cpus_per_instance,
        kv_cache_bytes=r.kv_cache_bytes,
        vllm_args=tuple(r.vllm_args),
        env=tuple(sorted(r.env.items())),
        max_restarts=r.max_restarts,
        startup_timeout_s=r.startup_timeout_s,
        poll_interval_s=r.poll_interval_s,
        drain_timeout_s=r.drain_timeout_s,
        namespace=r.namespace,
        api_key=key,
        secret_env=secret_env,
        port_range=r.port_range,
    )


def _freeze_run_guards(g: RunGuardsSchema) -> RunGuardsConfig:
    return RunGuardsConfig(
        g.max_steps, g.max_tokens, g.max_gpu_seconds, g.max_duration_s, g.loop_repeats
    )


def _freeze_governance(g: GovernanceSchema) -> GovernanceConfig:
    tiers = {
        **{name: TierSchema.model_validate(t) for name, t in DEFAULT_TIERS.items()},
        **g.tiers,
    }
    return GovernanceConfig(
        tiers=tuple(
            TierConfig(name, t.max_concurrent_runs, t.max_concurrent_requests, t.queue_weight)
            for name, t in tiers.items()
        ),
        run_idle_timeout_s=g.run_idle_timeout_s,
        task_types_s=tuple({**DEFAULT_TASK_TYPES_S, **g.task_types_s}.items()),
        cost_alert_frac=g.cost_alert_frac,
        daily_min_rate_frac=g.daily_min_rate_frac,
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
    """Settings that are validated but do not steer anything in this config (printed by
    check-config): with `rebalancer.enabled: false` the ratio moves only when an SRE moves it
    (`gpupool pools move` / `pin`), so the bounds bind only those moves."""
    notes = []
    if not config.rebalancer.enabled:
        bounded = [
            p.name
            for p in config.pools
            if p.share.floor_frac > 0 or p.share.ceiling_frac < 1 or p.share.schedule
        ]
        if bounded:
            notes.append(
                f"pools {', '.join(bounded)}: share bounds and schedules bind only SRE moves:"
                " rebalancer.enabled is false, so the ratio does not follow demand"
            )
    if config.rebalancer.borrow_max_frac > 0 and config.router.admission == "off":
        notes.append(
            "rebalancer.borrow_max_frac: no borrowing with router.admission off (every request"
            " goes to its own pool's instances at once)"
        )
    return notes


def _rebalancer_problems(config: Config) -> list[str]:
    """Schedules keep floors summing to at most 1 and ceilings to at least 1 at every minute
    of the day; pinned instances exist (static and local launchers name them engine-N)."""
    problems: list[str] = []
    eps = 1e-6
    edges = sorted({0} | {w.start_min for p in config.pools for w in p.share.schedule})
    edges += sorted({w.end_min for p in config.pools for w in p.share.schedule})
    for minute in sorted(set(edges)):
        at = {p.name: bounds_at(p.share.bounds, p.share.schedule, minute) for p in config.pools}
        floors = sum(b.floor_frac for b in at.values())
        ceilings = sum(b.ceiling_frac for b in at.values())
        if floors > 1 + eps or ceilings < 1 - eps:
            problems.append(
                f"pools: at {minute // 60:02d}:{minute % 60:02d} UTC the scheduled floors sum to"
                f" {floors:.3f} and ceilings to {ceilings:.3f} (floors must sum to at most 1,"
                " ceilings to at least 1)"
            )
            break
    if config.engines.launcher in ("local", "static"):
        known = {f"engine-{i}" for i in range(config.engines.instance_count)}
        for pool in config.pools:
            for instance_id in pool.pinned_instances:
                if instance_id not in known:
                    problems.append(
                        f"pools.{pool.name}.pinned_instances: no instance {instance_id!r} (the"
                        f" {config.engines.launcher} launcher names engine-0 to"
                        f" engine-{config.engines.instance_count - 1})"
                    )
    return problems


def _governance_problems(config: Config, tenant: TenantConfig) -> list[str]:
    """A tenant's limits that do not fit together, or that the engines cannot honour."""
    problems = []
    if tenant.borrow_max_frac and tenant.tokens_per_minute is None:
        problems.append(
            f"tenants.{tenant.name}.borrow_max_frac: borrowing extends a token budget; set"
            " tokens_per_minute too (it is the base quota the fraction is of)"
        )
    tier = config.governance.tier(tenant.tier)
    args = config.engines.local.vllm_args
    seqs = next((int(args[i + 1]) for i, a in enumerate(args[:-1]) if a == "--max-num-seqs"), 256)
    engine_seqs = seqs * config.engines.instance_count
    if tier is not None and engine_seqs and tier.max_concurrent_requests > engine_seqs:
        problems.append(
            f"tenants.{tenant.name}.tier: tier {tier.name!r} allows"
            f" {tier.max_concurrent_requests} requests in flight, more than the engines run at"
            f" once ({engine_seqs}: --max-num-seqs x instances)"
        )
    return problems


def contract_problems(config: Config) -> list[str]:
    """Checks the numbers fit together. Returns human-readable problems; empty means consistent.

    - pool floors sum to at most 1 and ceilings to at least 1, initial shares sum to 1;
    - for every class: its pool's max queue wait + expected execution (TTFT target plus the
      expected output tokens at the TPOT target) fits the class timeout;
    - each pool can hold at least one instance's worth of capacity (ceiling >= 1/instances)
      when there is more than one instance;
    - a tenant's `borrow_max_frac` has a `tokens_per_minute` to be a fraction of;
    - a class's run guard `max_duration_s` is not shorter than one request of it may take
      (`timeout_s`); a tenant's tier allows no more requests in flight than the engines run.
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
        problems.extend(_governance_problems(config, tenant))
    for cls in config.classes:
        guard_s = cls.run_guards.max_duration_s
        if guard_s is not None and guard_s < cls.timeout_s:
            problems.append(
                f"classes.{cls.name}.run_guards.max_duration_s: {guard_s:g} s is shorter than"
                f" one request's timeout_s {cls.timeout_s:g}: a single step could outlive its"
                " run"
            )
    problems.extend(_rebalancer_problems(config))
    affinity = config.engines.local.cpu_affinity
    if config.engines.launcher == "local" and affinity is not None and len(affinity) != n:
        problems.append(
            f"engines.local.cpu_affinity: {len(affinity)} CPU lists for {n} engines"
            f" (engines.local.count); give one list per engine, e.g."
            f" {[[i] for i in range(n)]}"
        )
    return problems
