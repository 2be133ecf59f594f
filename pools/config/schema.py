"""Every gpupool setting, declared once: one frozen pydantic dataclass per YAML section.

A field carries its unit in its name (`_s`, `_ms`, `_tokens`, `_frac`, `_bytes`), its default
and its bounds beside it. The same classes are the program's frozen view: `load.parse_config`
validates a YAML document into them (`TypeAdapter(Config)`), and `dataclasses.replace` on them
validates again. Where the document's shape differs from the view (a mapping of named
sections becomes a tuple of them; times of day become minutes; relative paths resolve against
the config's directory), a validator converts it; values derived from settings are fields
computed in `__post_init__` (plain attributes, nothing is recomputed per read). Fields the
document may not set (keys read from the environment, derived values) refuse it as unknown.

Checks that span sections live in `Config`'s validators; checks of whether the numbers fit
together (a warning, not a refusal) live in `checks.py`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import SplitResult, parse_qs, urlsplit

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass
from pydantic_core import PydanticKnownError

from pools.rebalance import Bounds, RebalanceSettings, ScheduleWindow

__all__ = [
    "VLLM_MAX_NUM_SEQS",
    "ClassConfig",
    "ClassificationConfig",
    "Config",
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
    "default_of",
    "max_num_seqs",
]

# Unknown keys are errors (a typo must not pass silently); sections are immutable.
_STRICT = ConfigDict(extra="forbid")

VLLM_MAX_NUM_SEQS = 256  # vLLM's --max-num-seqs when its arguments do not set it (on a GPU)


def max_num_seqs(vllm_args: Sequence[str], default: int = VLLM_MAX_NUM_SEQS) -> int:
    """The `--max-num-seqs` an engine started with `vllm_args` runs (`--max-num-seqs N` or
    `--max-num-seqs=N`; the last one wins, as in vLLM's own parser), else `default`. A value
    that is not a positive integer counts as not set (vLLM itself refuses to start on it)."""
    value: str | None = None
    for i, arg in enumerate(vllm_args):
        if arg == "--max-num-seqs" and i + 1 < len(vllm_args):
            value = vllm_args[i + 1]
        elif arg.startswith("--max-num-seqs="):
            value = arg.split("=", 1)[1]
    if value is None or not value.strip().isdigit() or int(value) <= 0:
        return default
    return int(value)


def default_of(section: type[Any], name: str) -> Any:
    """The declared default of setting `name` in `section` (for code outside the config that
    takes the setting as a parameter and must not write its default a second time)."""
    return section.__pydantic_fields__[name].get_default(call_default_factory=True)


# ---------------------------------------------------------------------------------------------
# Conversions from the document's shape
# ---------------------------------------------------------------------------------------------


def _unknown(loc: tuple[str | int, ...], value: Any, title: str) -> ValidationError:
    """An "unknown field" error at `loc` (below the section being validated)."""
    return ValidationError.from_exception_data(
        title, [{"type": "unexpected_keyword_argument", "loc": loc, "input": value}]
    )


def _refuse_derived(data: Any, names: tuple[str, ...]) -> Any:
    """A document (a mapping) may not set the fields `names`: they are read from the
    environment or computed at load. (Keyword construction and `dataclasses.replace` may.)"""
    if isinstance(data, Mapping):
        for name in names:
            if name in data:
                raise _unknown((name,), data[name], "section")
    return data


def _resolved(value: Path, info: ValidationInfo) -> Path:
    """A relative path against the document's directory (`base_dir` in the validation
    context); as given when there is none (direct construction)."""
    base = (info.context or {}).get("base_dir")
    if base is None:
        return value
    path = value.expanduser()
    return path if path.is_absolute() else Path(base) / path


def _in_document(info: ValidationInfo) -> bool:
    """Whether a document is being validated (`load.parse_config` gives a `base_dir`), not
    a section constructed in code or by `dataclasses.replace`."""
    return info.context is not None and "base_dir" in info.context


def _mapping_in_document(value: Any, info: ValidationInfo) -> bool:
    """Whether `value` is a document's mapping; anything else a document gives is refused."""
    if isinstance(value, Mapping):
        return True
    if _in_document(info):
        raise PydanticKnownError("dict_type")
    return False


def _path_in_document(value: Any, info: ValidationInfo) -> Any:
    if _in_document(info) and not isinstance(value, str | Path):
        raise PydanticKnownError("string_type")
    return value


def _not_empty(value: tuple[str, ...]) -> tuple[str, ...]:
    if not value:
        raise PydanticKnownError(
            "too_short", {"field_type": "List", "min_length": 1, "actual_length": 0}
        )
    return value


def _named(value: Any, adapter: TypeAdapter[Any], info: ValidationInfo) -> Any:
    """A document's mapping of name -> section as the tuple of sections, each given its key
    as `name` (in the document's order); a tuple of sections passes unchanged."""
    if not _mapping_in_document(value, info):
        return value
    bodies: dict[Any, Any] = {}
    for key, body in value.items():
        if isinstance(body, Mapping):
            if "name" in body:
                raise _unknown((key, "name"), body["name"], "named section")
            body = {"name": key, **body}
        bodies[key] = body
    return tuple(adapter.validate_python(bodies, context=info.context).values())


def _sorted_pairs(value: Any, adapter: TypeAdapter[Any], info: ValidationInfo) -> Any:
    """A document's mapping as sorted (key, value) pairs (hashable, order-free)."""
    if not _mapping_in_document(value, info):
        return value
    return tuple(sorted(adapter.validate_python(value, context=info.context).items()))


def _sha256_hex(value: str) -> str:
    """`value` as a lower-case SHA-256 hex digest. Raises `ValueError` (never echoing it)."""
    digest = value.strip().lower()
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError("must be a SHA-256 digest: 64 hex characters (sha256sum of the key)")
    return digest


def _no_log_stats(vllm_args: Sequence[str]) -> None:
    if "--disable-log-stats" in vllm_args:
        raise ValueError(
            "vllm_args: --disable-log-stats removes every vllm:* metric gpupool's telemetry"
            " and admission need; remove it"
        )


def _minute_of_day(value: str) -> int:
    """Minutes after midnight of a time of day "HH:MM" (UTC). Raises `ValueError`."""
    hours, sep, minutes = value.partition(":")
    if not sep or not hours.isdigit() or not minutes.isdigit() or len(minutes) != 2:
        raise ValueError(f"expected a time of day as HH:MM (UTC), got {value!r}")
    h, m = int(hours), int(minutes)
    if not (0 <= h <= 24 and 0 <= m < 60) or h * 60 + m > 1440:
        raise ValueError(f"time of day {value!r} is out of range (00:00 to 24:00)")
    return h * 60 + m


_STR_MAP: TypeAdapter[dict[str, str]] = TypeAdapter(dict[str, str])

# a path: relative ones resolve against the document's directory
_Path = Annotated[
    Path,
    BeforeValidator(_path_in_document),
    AfterValidator(_resolved),
    Field(validate_default=True),
]
# environment variables: the document gives a mapping
_EnvPairs = Annotated[
    tuple[tuple[str, str], ...],
    WrapValidator(lambda value, handler, info: handler(_sorted_pairs(value, _STR_MAP, info))),
]


def _sections_given(data: Any, names: tuple[str, ...]) -> Any:
    """A document's absent sections as empty ones, so their defaults are validated (and their
    paths resolved) as given ones are."""
    if isinstance(data, Mapping):
        return {**{name: {} for name in names}, **data}
    return data


# ---------------------------------------------------------------------------------------------
# model, engines
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, config=_STRICT)
class ModelConfig:
    name: str = "tiny"  # served model name clients send as "model"
    path: _Path = Path("./.gpupool/models/tiny")  # HF-style folder: config.json, tokenizer
    max_model_len_tokens: int | None = Field(default=None, gt=0)  # None: the engine's default
    load_format: Literal["auto", "dummy"] = "dummy"  # dummy: random weights (dev model)
    # auto: on a CPU engine float32, or bfloat16 where the CPU has avx512_bf16 or amx_bf16
    # (without them bfloat16 prefill runs ~4x slower); on a GPU vLLM's own auto (the
    # checkpoint's dtype). Any other value is passed to vLLM's --dtype as given.
    dtype: str = "auto"


@dataclass(frozen=True, slots=True, config=_STRICT)
class LocalEnginesConfig:
    count: int = Field(default=3, ge=1, le=64)
    gpus_per_instance: int = Field(default=1, ge=1, le=16)
    host: str = "127.0.0.1"
    base_port: int = Field(default=8100, ge=1024, le=65000)  # instance i listens on base_port + i
    kv_cache_bytes: int | None = Field(default=None, gt=0)  # None: engine default
    vllm_args: tuple[str, ...] = ()
    env: _EnvPairs = ()
    # per instance, e.g. [[0], [1], [1]]; CPU engines only
    cpu_affinity: tuple[tuple[int, ...], ...] | None = None
    startup_timeout_s: float = Field(default=600.0, gt=0)
    restart_backoff_s: float = Field(default=2.0, gt=0)  # doubles per consecutive crash
    restart_backoff_max_s: float = Field(default=60.0, gt=0)
    stop_grace_s: float = Field(default=15.0, gt=0)
    run_dir: _Path = Path("./.gpupool/run")
    # The key every engine requires (vLLM's VLLM_API_KEY; the router sends it): the name of an
    # env var holding it. None: a random key per engine and launch, held only by this process.
    api_key_env: str | None = None
    api_key: str | None = Field(default=None, repr=False)  # read from api_key_env at load
    # env vars never passed to engines: every `*api_key_env` the config names (tenant, admin,
    # metrics and engine keys); set at load
    secret_env: frozenset[str] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _document(cls, data: Any) -> Any:
        return _refuse_derived(data, ("api_key", "secret_env"))

    @field_validator("cpu_affinity")
    @classmethod
    def _no_empty_affinity(
        cls, value: tuple[tuple[int, ...], ...] | None
    ) -> tuple[tuple[int, ...], ...] | None:
        return value or None  # an empty list: no pinning

    @model_validator(mode="after")
    def _no_forbidden_flags(self) -> LocalEnginesConfig:
        _no_log_stats(self.vllm_args)
        if self.cpu_affinity is not None and any(not cpus for cpus in self.cpu_affinity):
            raise ValueError("cpu_affinity: every instance needs at least one CPU")
        return self


def _kv_endpoint(endpoint: str, where: str) -> str:
    """A ZMQ endpoint the router connects to: tcp://<host>:<port> (not a wildcard: that is
    what the engine binds) or ipc://<path> (an engine on this machine)."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return endpoint
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not endpoint.startswith("tcp://") or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{where}: {endpoint!r} is not tcp://<host>:<port> or ipc://<path>")
    if host in ("", "*", "0.0.0.0", "[::]"):
        raise ValueError(
            f"{where}: {endpoint!r} names no host: give the address the router reaches the"
            " engine at (the engine itself binds tcp://*:<port>)"
        )
    return endpoint


@dataclass(frozen=True, slots=True, config=_STRICT)
class StaticKvEventsConfig:
    """Where one static engine publishes its KV cache events: the engine was started with
    `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
    "tcp://*:<port>", "replay_endpoint": "tcp://*:<replay port>"}' --prefix-caching-hash-algo
    sha256_cbor` (docs/prefix_cache.md). The block size is read from the events."""

    url: str  # the engine, as listed in engines.static.urls
    endpoint: str  # its PUB socket as the router reaches it: tcp://<host>:<port>
    replay_endpoint: str | None = None  # its replay ROUTER socket; None: none (gaps resync)
    # the engine's PYTHONHASHSEED; None: unset there. (Its --prefix-caching-hash-algo must be
    # sha256_cbor, the chain the router computes: one that is not is left out at run time)
    hash_seed: str | None = None

    @model_validator(mode="after")
    def _endpoints(self) -> StaticKvEventsConfig:
        where = f"engines.static.kv_events[{self.url!r}]"
        _kv_endpoint(self.endpoint, where + ".endpoint")
        if self.replay_endpoint is not None:
            _kv_endpoint(self.replay_endpoint, where + ".replay_endpoint")
        object.__setattr__(self, "url", self.url.rstrip("/"))
        return self


@dataclass(frozen=True, slots=True, config=_STRICT)
class StaticEnginesConfig:
    urls: tuple[str, ...] = ()  # trailing slashes dropped
    gpus_per_instance: int = Field(default=1, ge=1, le=16)
    api_key_env: str | None = None  # env var holding the engines' key (vLLM --api-key); None: none
    api_key: str | None = Field(default=None, repr=False)  # read from api_key_env at load
    # the engines that publish KV cache events, one entry each (opt-in; the rest publish none)
    kv_events: tuple[StaticKvEventsConfig, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _document(cls, data: Any) -> Any:
        return _refuse_derived(data, ("api_key",))

    @model_validator(mode="after")
    def _urls_are_http(self) -> StaticEnginesConfig:
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"url {url!r} must start with http:// or https://")
        object.__setattr__(self, "urls", tuple(u.rstrip("/") for u in self.urls))
        named = [e.url for e in self.kv_events]
        for url in named:
            if url not in self.urls:
                raise ValueError(f"kv_events: {url!r} is not one of engines.static.urls")
        if len(set(named)) != len(named):
            raise ValueError("kv_events: an engine is listed twice")
        return self


@dataclass(frozen=True, slots=True, config=_STRICT)
class KubernetesKvEventsConfig:
    """Where each engine of a Kubernetes group publishes its KV cache events: its pod address
    at these ports (the engine started with `--kv-events-config` binding `tcp://*:<port>`)."""

    port: int = Field(default=5557, ge=1, le=65535)
    replay_port: int | None = Field(default=5558, ge=1, le=65535)  # None: no replay socket
    hash_seed: str | None = None  # the engines' PYTHONHASHSEED; as engines.static.kv_events[]


@dataclass(frozen=True, slots=True, config=_STRICT)
class KubernetesServiceConfig:
    name: str = Field(min_length=1, max_length=63)  # a headless Service of one engine group
    port: int = Field(default=8000, ge=1, le=65535)  # the engines' HTTP port
    gpus_per_instance: int = Field(default=1, ge=1, le=16)  # a CPU engine counts as 1
    # the group's engines publish KV cache events on TCP (opt-in; the chart's groups do):
    # on the Service's ports named kv-events / kv-replay, else these numbers
    kv_events: KubernetesKvEventsConfig | None = None


@dataclass(frozen=True, slots=True, config=_STRICT)
class KubernetesEnginesConfig:
    """Engines found in Kubernetes (the Helm chart's engine groups): every ready endpoint of
    the listed headless Services is an instance; one that goes away drains, then leaves."""

    services: tuple[KubernetesServiceConfig, ...] = ()
    namespace: str | None = None  # None: the router pod's own (its service account's)
    # api: EndpointSlices through the API server (read-only RBAC; instance ids are pod names);
    # dns: the headless Service's A records (no RBAC; instance ids follow pod IPs)
    discovery: Literal["api", "dns"] = "api"
    poll_interval_s: float = Field(default=2.0, gt=0)
    drain_timeout_s: float = Field(default=600.0, ge=0)  # a leaving engine's in-flight work
    cluster_domain: str = "cluster.local"  # dns discovery: <service>.<namespace>.svc.<domain>
    api_key: str | None = Field(default=None, repr=False)  # read from api_key_env at load
    api_key_env: str | None = None  # env var holding the engines' key (VLLM_API_KEY)

    @model_validator(mode="before")
    @classmethod
    def _document(cls, data: Any) -> Any:
        return _refuse_derived(data, ("api_key",))


@dataclass(frozen=True, slots=True, config=_STRICT)
class RayEnginesConfig:
    """Engines as Ray actors, one per instance, each holding `gpus_per_instance` GPUs (0: a
    CPU engine holding `cpus_per_instance` CPUs); Ray restarts a dead one."""

    address: str | None = None  # None: start a local Ray cluster; "auto" or "host:port": join
    count: int = Field(default=1, ge=1, le=256)
    gpus_per_instance: int = Field(default=1, ge=0, le=16)  # 0: CPU engines
    cpus_per_instance: float = Field(default=1.0, gt=0)
    kv_cache_bytes: int | None = Field(default=None, gt=0)  # None: engine default
    vllm_args: tuple[str, ...] = ()
    env: _EnvPairs = ()
    max_restarts: int = Field(default=-1, ge=-1)  # Ray's max_restarts per actor; -1: forever
    startup_timeout_s: float = Field(default=600.0, gt=0)
    poll_interval_s: float = Field(default=2.0, gt=0)  # addresses re-read this often
    drain_timeout_s: float = Field(default=600.0, ge=0)
    namespace: str = "gpupool"  # Ray namespace of the engine actors
    api_key: str | None = Field(default=None, repr=False)  # read from api_key_env at load
    secret_env: frozenset[str] = frozenset()  # env vars never passed to engines; set at load
    # the ports an engine may listen on, [first, last], the first free one taken on its node;
    # None: any free port the node gives
    port_range: tuple[int, int] | None = None
    api_key_env: str | None = None  # None: a random key per launch

    @model_validator(mode="before")
    @classmethod
    def _document(cls, data: Any) -> Any:
        return _refuse_derived(data, ("api_key", "secret_env"))

    @model_validator(mode="after")
    def _no_forbidden_flags(self) -> RayEnginesConfig:
        if self.port_range is not None and not 1024 <= self.port_range[0] <= self.port_range[1]:
            raise ValueError("port_range: needs [first, last] with 1024 <= first <= last")
        _no_log_stats(self.vllm_args)
        return self


@dataclass(frozen=True, slots=True, config=_STRICT)
class EnginesConfig:
    launcher: Literal["local", "static", "ray", "kubernetes"] = "local"
    local: LocalEnginesConfig = Field(default_factory=LocalEnginesConfig)
    static: StaticEnginesConfig = Field(default_factory=StaticEnginesConfig)
    kubernetes: KubernetesEnginesConfig = Field(default_factory=KubernetesEnginesConfig)
    ray: RayEnginesConfig = Field(default_factory=RayEnginesConfig)
    # vLLM's KV cache events (docs/prefix_cache.md): on: every engine gpupool starts
    # publishes the blocks it caches (ZMQ: socket files in run_dir for local, TCP ports for
    # ray; block hashes by sha256_cbor) and the router keeps an index of each engine's prefix
    # cache; static and kubernetes engines publish where their own sections say (opt-in).
    # null: on for local and ray, and for static/kubernetes when an engine opts in; off:
    # none followed
    kv_events: bool | None = None
    # derived from the launcher's section:
    # instances the config names; 0 for kubernetes (they are discovered at run time)
    instance_count: int = dataclasses.field(init=False, repr=False)
    gpus_per_instance: int = dataclasses.field(init=False, repr=False)
    # the engines' extra vLLM arguments where gpupool starts them (local, ray)
    vllm_args: tuple[str, ...] = dataclasses.field(init=False, repr=False)
    max_num_seqs: int = dataclasses.field(init=False, repr=False)  # from vllm_args
    kv_events_on: bool = dataclasses.field(init=False, repr=False)  # kv_events, null resolved

    def __post_init__(self) -> None:
        count, gpus = {
            "static": (len(self.static.urls), self.static.gpus_per_instance),
            "ray": (self.ray.count, max(1, self.ray.gpus_per_instance)),
            "kubernetes": (
                0,
                max((s.gpus_per_instance for s in self.kubernetes.services), default=1),
            ),
        }.get(self.launcher, (self.local.count, self.local.gpus_per_instance))
        args = self.ray.vllm_args if self.launcher == "ray" else self.local.vllm_args
        object.__setattr__(self, "instance_count", count)
        object.__setattr__(self, "gpus_per_instance", gpus)
        object.__setattr__(self, "vllm_args", args)
        object.__setattr__(self, "max_num_seqs", max_num_seqs(args))
        opted_in = {
            "local": True,
            "ray": True,
            "static": bool(self.static.kv_events),
            "kubernetes": any(s.kv_events for s in self.kubernetes.services),
        }[self.launcher]
        on = opted_in if self.kv_events is None else self.kv_events and opted_in
        object.__setattr__(self, "kv_events_on", on)

    @model_validator(mode="before")
    @classmethod
    def _document(cls, data: Any) -> Any:
        return _sections_given(data, ("local", "static", "kubernetes", "ray"))

    @model_validator(mode="after")
    def _static_has_urls(self) -> EnginesConfig:
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
        if self.kv_events and not self.kv_events_on:
            where = {
                "static": "engines.static.kv_events (an entry per engine that publishes)",
                "kubernetes": "engines.kubernetes.services[].kv_events",
            }[self.launcher]
            raise ValueError(
                f"engines.kv_events: on, but no {self.launcher} engine says where it publishes"
                f" its KV events: set {where}, or leave engines.kv_events unset"
            )
        return self


# ---------------------------------------------------------------------------------------------
# pools
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, config=_STRICT)
class ShareWindow:
    """Bounds that apply between two times of day (UTC); `end` before `start` wraps past
    midnight (night: start 20:00, end 08:00). The program reads it as a `ScheduleWindow`."""

    start: str  # "HH:MM", UTC
    end: str
    floor_frac: float = Field(default=0.0, ge=0.0, le=1.0)
    ceiling_frac: float = Field(default=1.0, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _valid(self) -> ShareWindow:
        if _minute_of_day(self.start) == _minute_of_day(self.end):
            raise ValueError(f"schedule window {self.start} to {self.end} is empty")
        if self.floor_frac > self.ceiling_frac:
            raise ValueError(
                f"schedule window {self.start} to {self.end}: floor_frac {self.floor_frac} is"
                f" above ceiling_frac {self.ceiling_frac}"
            )
        return self

    def window(self) -> ScheduleWindow:
        return ScheduleWindow(
            _minute_of_day(self.start),
            _minute_of_day(self.end),
            Bounds(self.floor_frac, self.ceiling_frac),
        )


_WINDOWS: TypeAdapter[list[ShareWindow]] = TypeAdapter(list[ShareWindow])


@dataclass(frozen=True, slots=True, config=_STRICT)
class ShareConfig:
    initial_frac: float = Field(ge=0.0, le=1.0)
    floor_frac: float = Field(default=0.0, ge=0.0, le=1.0)
    ceiling_frac: float = Field(default=1.0, ge=0.0, le=1.0)
    # time-of-day bounds for the rebalancer (the first window covering the time wins; outside
    # every window floor_frac / ceiling_frac apply); the document gives `ShareWindow`s
    schedule: tuple[ScheduleWindow, ...] = ()
    bounds: Bounds = dataclasses.field(init=False, repr=False)  # floor_frac, ceiling_frac

    def __post_init__(self) -> None:
        object.__setattr__(self, "bounds", Bounds(self.floor_frac, self.ceiling_frac))

    @field_validator("schedule", mode="wrap")
    @classmethod
    def _windows(
        cls, value: Any, handler: Callable[[Any], tuple[ScheduleWindow, ...]], info: ValidationInfo
    ) -> tuple[ScheduleWindow, ...]:
        if isinstance(value, list | tuple) and not all(
            isinstance(w, ScheduleWindow) for w in value
        ):
            value = tuple(w.window() for w in _WINDOWS.validate_python(value, context=info.context))
        return handler(value)

    @model_validator(mode="after")
    def _ordered(self) -> ShareConfig:
        if not self.floor_frac <= self.initial_frac <= self.ceiling_frac:
            raise ValueError(
                f"needs floor_frac <= initial_frac <= ceiling_frac, got {self.floor_frac} / "
                f"{self.initial_frac} / {self.ceiling_frac}"
            )
        return self


@dataclass(frozen=True, slots=True, config=_STRICT)
class SloConfig:
    ttft_p95_ms: float = Field(default=2000.0, gt=0)
    tpot_p95_ms: float = Field(default=100.0, gt=0)


_RUN_LAS_FIELDS = (
    "run_las_aging_s",
    "run_las_idle_decay_s",
    "run_las_max_attained_gpu_s",
    "run_las_max_slowdown",
)


@dataclass(frozen=True, slots=True, config=_STRICT)
class QueueConfig:
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

    @model_validator(mode="before")
    @classmethod
    def _run_las_fields(cls, data: Any) -> Any:
        # the document may give run_las_* only with order: run_las
        if isinstance(data, Mapping):
            order = data.get("order", "wfq")
            given = sorted(set(_RUN_LAS_FIELDS) & set(data))
            if order != "run_las" and given and order in ("fifo", "wfq"):
                raise ValueError(
                    f"{', '.join(given)} only apply with order: run_las (order is {order})"
                )
        return data

    @model_validator(mode="after")
    def _aging_before_timeout(self) -> QueueConfig:
        if self.order == "run_las" and self.max_wait_s and self.run_las_aging_s >= self.max_wait_s:
            raise ValueError(
                f"run_las_aging_s ({self.run_las_aging_s:g} s) must be below max_wait_s"
                f" ({self.max_wait_s:g} s): a step would time out before it ages"
            )
        return self


@dataclass(frozen=True, slots=True, config=_STRICT)
class PoolConfig:
    name: str  # its key under `pools:`
    classes: Annotated[tuple[str, ...], AfterValidator(_not_empty)]
    share: ShareConfig
    slo: SloConfig = Field(default_factory=SloConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    # vLLM request `priority` sent with this pool's requests (lower is scheduled first inside
    # the engine); None sends none. Needs engines started with `--scheduling-policy priority`
    # (for the local launcher, in engines.local.vllm_args: config load refuses it otherwise).
    engine_priority: int | None = None
    # instance ids (engine-0, ...) that always belong to this pool, whole: placed here first
    # and never moved by the rebalancer
    pinned_instances: tuple[str, ...] = ()
    # where a run's next step goes: always_affinity (the default: wait for the instance
    # holding its prefix while it is healthy), affinity_or_move (stay there unless another
    # instance has spare room and waiting costs more than the whole move there), least_loaded
    # (ignore affinity); router/admission/picking.py, docs/run_scheduling.md
    placement: Literal["affinity_or_move", "always_affinity", "least_loaded"] = "always_affinity"


# ---------------------------------------------------------------------------------------------
# classes, governance, tenants, classification
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, config=_STRICT)
class RunGuardsConfig:
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


_RUN_GUARDS: TypeAdapter[RunGuardsConfig] = TypeAdapter(RunGuardsConfig)


@dataclass(frozen=True, slots=True, config=_STRICT)
class ClassConfig:
    name: str  # its key under `classes:` (a class served by a pool and not listed: defaults)
    timeout_s: float = Field(default=300.0, gt=0)  # whole request, queue wait included
    expected_output_tokens: int = Field(default=256, gt=0)  # used before p95 is observed
    default_priority: int = 0
    run_guards: RunGuardsConfig = Field(default_factory=RunGuardsConfig)


@dataclass(frozen=True, slots=True, config=_STRICT)
class TierConfig:
    """A concurrency tier (tenants pick one with `tier`)."""

    name: str  # its key under `governance.tiers:`
    max_concurrent_runs: int = Field(gt=0)  # active agent runs at once
    max_concurrent_requests: int = Field(gt=0)  # requests in flight at once
    queue_weight: float = Field(default=1.0, gt=0)  # multiplies the tenant's WFQ weight


DEFAULT_TIERS: tuple[TierConfig, ...] = (
    TierConfig("free", max_concurrent_runs=1, max_concurrent_requests=2, queue_weight=1.0),
    TierConfig("paid", max_concurrent_runs=3, max_concurrent_requests=8, queue_weight=2.0),
    TierConfig("enterprise", max_concurrent_runs=10, max_concurrent_requests=32, queue_weight=4.0),
)
DEFAULT_TASK_TYPES_S: tuple[tuple[str, float], ...] = (
    ("short", 180.0),
    ("standard", 600.0),
    ("long", 1800.0),
)
_TIERS: TypeAdapter[dict[str, TierConfig]] = TypeAdapter(dict[str, TierConfig])
_DURATIONS: TypeAdapter[dict[str, float]] = TypeAdapter(dict[str, float])


@dataclass(frozen=True, slots=True, config=_STRICT)
class GovernanceConfig:
    # the document's mapping is merged over DEFAULT_TIERS (a tier given there replaces the
    # default of that name)
    tiers: tuple[TierConfig, ...] = DEFAULT_TIERS
    # a run with no step for this long is no longer active (frees its concurrency slot)
    run_idle_timeout_s: float = Field(default=120.0, gt=0)
    # x-gpupool-task-type (or the tenant's task_type) -> the run's max_duration_s; the
    # document's mapping is merged over DEFAULT_TASK_TYPES_S
    task_types_s: tuple[tuple[str, float], ...] = DEFAULT_TASK_TYPES_S
    cost_alert_frac: float = Field(default=0.8, gt=0, le=1)  # of the hourly cost cap
    # a daily budget scales the tenant's token and request rates by (1 - spent fraction),
    # never below this fraction of them
    daily_min_rate_frac: float = Field(default=0.1, gt=0, le=1)

    @field_validator("tiers", mode="wrap")
    @classmethod
    def _merged_tiers(
        cls, value: Any, handler: Callable[[Any], tuple[TierConfig, ...]], info: ValidationInfo
    ) -> tuple[TierConfig, ...]:
        if _mapping_in_document(value, info):
            given = {t.name: t for t in _named(value, _TIERS, info)}
            value = tuple({**{t.name: t for t in DEFAULT_TIERS}, **given}.values())
        return handler(value)

    @field_validator("task_types_s", mode="wrap")
    @classmethod
    def _merged_task_types(
        cls,
        value: Any,
        handler: Callable[[Any], tuple[tuple[str, float], ...]],
        info: ValidationInfo,
    ) -> tuple[tuple[str, float], ...]:
        if _mapping_in_document(value, info):
            given = _DURATIONS.validate_python(value, context=info.context)
            value = tuple({**dict(DEFAULT_TASK_TYPES_S), **given}.items())
        task_types = handler(value)
        for name, seconds in task_types:
            if not seconds > 0:
                raise ValueError(f"task type {name!r}: duration must be > 0 seconds")
        return task_types

    def tier(self, name: str | None) -> TierConfig | None:
        return next((t for t in self.tiers if t.name == name), None)


@dataclass(frozen=True, slots=True, config=_STRICT)
class TenantConfig:
    name: str = Field(min_length=1)
    # The key, given one way at most (none: the tenant has no key; see router/identity.py):
    api_key: str | None = Field(default=None, repr=False)  # literal key (warns at load)
    weight: float = Field(default=1.0, gt=0)
    tokens_per_minute: int | None = Field(default=None, gt=0)  # prompt + completion
    max_concurrent_runs: int | None = Field(default=None, gt=0)  # overrides the tier's
    default_class: str | None = None
    may_set_class: bool = True
    admin: bool = False  # may read /admin/* and /metrics (router.admin_api_key_env may too)
    # hex SHA-256 of the key: the config holds no secret; at load, the hash of the key
    # however given (None: no key)
    api_key_sha256: str | None = None
    requests_per_minute: int | None = Field(default=None, gt=0)
    tier: str | None = None  # a governance tier (free / paid / enterprise or one configured)
    cost_cap_gpu_seconds_per_hour: float | None = Field(default=None, gt=0)
    daily_budget_gpu_seconds: float | None = Field(default=None, gt=0)
    # the share of its tokens_per_minute it may borrow from idle tenants' budgets
    borrow_max_frac: float | None = Field(default=None, ge=0, le=1)
    task_type: str | None = None  # default x-gpupool-task-type of its runs
    # the best queue priority its requests may ask for (x-gpupool-priority; higher goes
    # first): a higher one is clamped to it (or to the class's default_priority when that is
    # higher). The body's vLLM `priority` (lower goes first) is clamped to no better than
    # the pool's engine_priority (0 when unset) minus this.
    max_priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    # overrides of its classes' run guards, as (field, value) pairs of the fields the
    # document gives (a `RunGuardsConfig` mapping there)
    run_guards: tuple[tuple[str, float | int | None], ...] = ()
    api_key_env: str | None = None  # name of the env var holding the key (read at load)

    @model_validator(mode="before")
    @classmethod
    def _one_key_source(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            given = [k for k in ("api_key_env", "api_key", "api_key_sha256") if data.get(k)]
            if len(given) > 1:
                raise ValueError(
                    f"tenant {data.get('name')!r}: give only one of api_key_env, api_key,"
                    f" api_key_sha256 (got {', '.join(given)})"
                )
        return data

    @field_validator("api_key_sha256")
    @classmethod
    def _hex_digest(cls, value: str | None) -> str | None:
        return None if value is None else _sha256_hex(value)

    @field_validator("run_guards", mode="wrap")
    @classmethod
    def _overrides(
        cls,
        value: Any,
        handler: Callable[[Any], tuple[tuple[str, float | int | None], ...]],
        info: ValidationInfo,
    ) -> tuple[tuple[str, float | int | None], ...]:
        if value is None:
            return ()
        if _mapping_in_document(value, info):
            guards = _RUN_GUARDS.validate_python(value, context=info.context)
            return tuple((k, getattr(guards, k)) for k in sorted(value))
        return handler(value)


RuleName = Literal["header", "tenant_default", "tools", "run_id"]
RULES: tuple[RuleName, ...] = ("header", "tenant_default", "tools", "run_id")


@dataclass(frozen=True, slots=True, config=_STRICT)
class ClassificationConfig:
    # Rules tried in order, first match wins; the default class applies when none matches.
    rules: tuple[RuleName, ...] = RULES
    tools_class: str = "agent"  # class of a request whose body has `tools`
    run_class: str = "agent"  # class of a request that carries a run identity
    default_class: str = "normal"


# ---------------------------------------------------------------------------------------------
# router, rebalancer
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, config=_STRICT)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    scrape_interval_s: float = Field(default=1.0, gt=0)
    scrape_timeout_s: float = Field(default=2.0, gt=0)
    stale_after_s: float = Field(default=5.0, gt=0)  # older telemetry counts as full
    unhealthy_after_failures: int = Field(default=2, ge=1)
    connect_timeout_s: float = Field(default=2.0, gt=0)
    upstream_timeout_s: float = Field(default=600.0, gt=0)
    max_connect_retries: int = Field(default=2, ge=0)
    ledger_path: _Path = Path("./.gpupool/ledger.sqlite")
    ledger_flush_interval_s: float = Field(default=0.5, gt=0)
    ledger_retention_days: float = Field(default=30.0, gt=0)
    # each request's record is committed before its response's final bytes (false: batched)
    ledger_durable: StrictBool = True
    state_path: _Path = Path("./.gpupool/state.json")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # text: `time level logger: message`; json: one JSON object per line (ts, level, logger,
    # message, and trace_id/span_id inside a traced request; router/ops/tracing/logs.py)
    log_format: Literal["text", "json"] = "text"
    # on: KV-headroom and operating-point admission with per-pool queues; off: every request is
    # forwarded at once (the behaviour before admission, kept for comparison)
    admission: Literal["on", "off"] = "on"
    kv_margin_frac: float = Field(default=0.05, ge=0.0, lt=1.0)  # KV kept free on every instance
    # sequences at once on an engine whose /metrics lacks vllm:cache_config_info (its KV
    # capacity unknown: no KV headroom check there); its operating point may lower it further
    unknown_kv_max_concurrency: int = Field(default=16, ge=1)
    max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0)  # larger bodies: 413
    body_read_timeout_s: float = Field(default=30.0, gt=0)  # a slower upload: 408
    head_timeout_s: float = Field(default=10.0, gt=0)  # request line + headers slower: 408
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)  # larger request heads: 431
    # concurrent client connections (uvicorn limit_concurrency; it counts the arriving one, so N
    # admits N - 1 others); beyond it uvicorn answers a plain-text 503
    max_connections: int = Field(default=4096, ge=2)
    # on SIGTERM / Ctrl-C: new requests get 503, in-flight ones have this long to finish
    shutdown_grace_s: float = Field(default=10.0, gt=0)
    # router processes `gpupool up` / `serve` run on router.port (SO_REUSEPORT: the kernel
    # spreads new connections over them); more than 1 needs a PostgreSQL store (store.url)
    replicas: int = Field(default=1, ge=1, le=64)
    # each router process also listens here (router process i of `replicas`: metrics_port + i)
    # for /metrics, /health, /ready, /admin/* and the status page only, so a scraper reads each
    # one on its own; null: none (the shared router.port serves them, one process per scrape)
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    # The operators' credential for /admin/* and /metrics, apart from any tenant's: the name of
    # an env var holding the key, or the key's hex SHA-256. With no admin credential (no such key
    # and no `admin: true` tenant) /admin/* answers 403, except on an open router (no keys at
    # all) listening on a loopback host (local development). See router/identity.py.
    # At load, *_sha256 becomes the hash of the key however given (None: none set).
    admin_api_key_sha256: str | None = None
    # A read-only credential for Prometheus scrapers: reads /metrics, nothing else.
    metrics_api_key_sha256: str | None = None
    admin_api_key_env: str | None = None
    metrics_api_key_env: str | None = None

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

    @model_validator(mode="before")
    @classmethod
    def _one_key_source(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            for who in ("admin", "metrics"):
                if data.get(f"{who}_api_key_env") and data.get(f"{who}_api_key_sha256"):
                    raise ValueError(f"give only one of {who}_api_key_env and {who}_api_key_sha256")
        return data


_TOOL_PAUSE_HOLD = False  # admission.tool_pause_hold's default (its validator reads it too)


@dataclass(frozen=True, slots=True, config=_STRICT)
class AdmissionConfig:
    """How admission shares a split instance between its pools (docs/admission.md, "Forecast
    reserve" and "Prefill hold"; router/admission/forecast.py)."""

    # share: each pool stays within its share of the instance's KV blocks and batch;
    # forecast: a pool may use the other pools' shares too, less what each of them is
    # forecast to need over headroom_horizon_s (at headroom_quantile) and less everything
    # while one has requests waiting. share until the forecast reserve is measured on the
    # issue's benchmark (3 rounds)
    reserve: Literal["share", "forecast"] = "share"
    # forecast only: the forecast covers this long (about a borrowed sequence's lifetime)
    headroom_horizon_s: float = Field(default=10.0, gt=0, le=600)
    # forecast only: the quantile of the owner's need that is kept free
    headroom_quantile: float = Field(default=0.99, ge=0.5, lt=1.0)
    # on an instance shared with a pool of stricter slo.ttft_p95_ms: hold a new request whose
    # uncached prompt is at least this many tokens while a request of that pool is in its
    # prefill there; auto: the tokens the instance prefills (measured rate) in
    # prefill_hold_budget_frac of that pool's TTFT target (null: never hold)
    prefill_hold_min_tokens: int | Literal["auto"] | None = None
    # auto only: the most one step-sharing prefill may add to the stricter pool's TTFT, as a
    # fraction of its slo.ttft_p95_ms (0.025 of 800 ms: 20 ms)
    prefill_hold_budget_frac: float = Field(default=0.025, gt=0, le=1)
    # a held request waits on holds at most this long in all, then goes (router/admission/
    # prefill_hold.py)
    prefill_hold_max_wait_s: float = Field(default=0.5, gt=0, le=60)
    # also hold such a request while another prefill of at least the threshold, of a pool no
    # stricter than its own, is in its prefill on an instance where a stricter pool is
    # allocated: one long prefill at a time beside the stricter pool's (the engine's slice
    # caps each request per step, not the step). Needs prefill_hold_min_tokens
    prefill_hold_serial: bool = False
    # the engines gpupool starts (local, ray) prefill at most this many tokens of one request
    # per step while another request is scheduled (vLLM's --long-prefill-token-threshold), so
    # a chat prompt shares steps with slices of a long agent prefill; null: vLLM's default (no
    # cap). pools/launchers/prefill_slice.py, docs/admission.md section 8
    prefill_slice_tokens: int | None = Field(default=None, ge=64)
    # tool pauses: from an agent step's end until the run's next step arrives (or the pause
    # predicted from the run's earlier pauses, times 1 + tool_pause_margin_frac, passes), the
    # run's context blocks on its home count as used for every other sequence admitted there,
    # so a fuller batch does not evict the paused run's cached context (router/admission/
    # tool_pauses.py, docs/admission.md "Tool pauses"). Off until the quiet agent-flood run:
    # two loaded runs (both orders) had it ahead of the index without it (run completion p50
    # -9 % and -52 %, the agent engine's hit rate +3 and +15 points), but not clearly ahead of
    # the index off
    tool_pause_hold: bool = _TOOL_PAUSE_HOLD
    # the longest pause held (also the prediction before any pause is learned)
    tool_pause_max_s: float = Field(default=10.0, gt=0, le=600)
    # the predicted pause is held this much longer (0.5: 1.5x)
    tool_pause_margin_frac: float = Field(default=0.5, ge=0, le=10)
    # the most held on an instance, as a fraction of its KV blocks
    tool_pause_max_frac: float = Field(default=0.3, gt=0, le=1)
    # what the held blocks count against: all (every other sequence, the later steps of
    # other runs too) or new_runs (only sequences with no home yet: a run's first step, a
    # request outside a run), so new runs wait for room beyond the paused runs' contexts and
    # the runs in progress do not wait for each other's
    tool_pause_hold_against: Literal["all", "new_runs"] = "all"

    @model_validator(mode="before")
    @classmethod
    def _forecast_fields(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("reserve", "share") != "forecast":
            idle = [k for k in ("headroom_horizon_s", "headroom_quantile") if k in data]
            if idle:
                raise ValueError(f"{', '.join(idle)} set without reserve: forecast")
        if isinstance(data, Mapping):
            hold = data.get("prefill_hold_min_tokens")
            if isinstance(hold, bool) or (isinstance(hold, int) and hold < 1):
                raise ValueError("prefill_hold_min_tokens: a whole number >= 1, auto or null")
            if "prefill_hold_budget_frac" in data and hold != "auto":
                raise ValueError(
                    "prefill_hold_budget_frac set without prefill_hold_min_tokens: auto"
                )
            if "prefill_hold_max_wait_s" in data and hold is None:
                raise ValueError("prefill_hold_max_wait_s set without prefill_hold_min_tokens")
            if data.get("prefill_hold_serial") and hold is None:
                raise ValueError("prefill_hold_serial set without prefill_hold_min_tokens")
            pause = [k for k in data if k.startswith("tool_pause_") and k != "tool_pause_hold"]
            if pause and not data.get("tool_pause_hold", _TOOL_PAUSE_HOLD):
                raise ValueError(f"{', '.join(sorted(pause))} set with tool_pause_hold: false")
        return data


@dataclass(frozen=True, slots=True, config=_STRICT)
class RebalancerConfig(RebalanceSettings):
    """The loop that moves the pool ratio with demand (pools/rebalance.py). Its decision
    settings (interval_s, hysteresis_frac, cooldown_s, smoothing_window_s, max_step_frac,
    traffic_memory_s) are declared once, in `RebalanceSettings`, which this extends."""

    enabled: bool = False  # off: the ratio stays where initial_frac and the SREs put it
    # a whole instance moving pools joins its new pool when its old sequences finish, or after
    # this long (they then finish where they are)
    drain_timeout_s: float = Field(default=60.0, ge=0)
    # a pool's overflow may use up to this fraction of another pool's instance while that pool
    # has nothing waiting (0: no borrowing)
    borrow_max_frac: float = Field(default=0.0, ge=0.0, le=1.0)
    # SQLite, one row per decision and per SRE change; None in the document: decisions.sqlite
    # beside router.state_path
    decision_log_path: _Path = default_of(RouterConfig, "state_path").with_name("decisions.sqlite")
    decision_log_retention_days: float = Field(default=30.0, gt=0)
    # the decision settings alone, as the pure core takes them
    settings: RebalanceSettings = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        core = {f.name: getattr(self, f.name) for f in dataclasses.fields(RebalanceSettings)}
        object.__setattr__(self, "settings", RebalanceSettings(**core))


def _refuse_idle(data: Any, switch: str, fields: Sequence[str], why: str) -> None:
    """Refuse a document that sets `fields` while `switch`, the field that turns them on, is
    unset: they would do nothing. `why` finishes "<fields> set without ..."."""
    if not isinstance(data, Mapping) or data.get(switch) is not None:
        return
    idle = [k for k in fields if k in data]
    if idle:
        raise ValueError(f"{', '.join(idle)} set without {why}")


def _split_url(value: str) -> SplitResult:
    """`value` split, with its port checked (urlsplit only raises on `.port`)."""
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError as err:
        raise ValueError(f"not a URL: {err}") from None
    return parts


# ---------------------------------------------------------------------------------------------
# store
# ---------------------------------------------------------------------------------------------

_PG_SCHEMES = ("postgresql", "postgres")


def _url_from_env(data: Any) -> Any:
    """The store section with `url` read from the variable `url_env` names (then checked as
    a `url` given in the document is)."""
    if not isinstance(data, Mapping) or data.get("url_env") is None:
        return data
    name = data["url_env"]
    if data.get("url") is not None:
        raise ValueError("store.url and store.url_env both set: give the URL one way")
    value = os.environ.get(str(name), "").strip()
    if not value:
        raise ValueError(f"store.url_env: environment variable {name!r} is not set or empty")
    return {**data, "url": value}


# the store settings that only a shared (PostgreSQL) store reads
_SHARED_ONLY = (
    "budgets_on_outage",
    "budget_chunk_frac",
    "slot_lease_s",
    "admission_interval_s",
    "run_lease",
)


@dataclass(frozen=True, slots=True, config=_STRICT)
class StoreConfig:
    """Where the state that router replicas must agree on lives: the ledger, governance
    (budgets, runs, sessions), the SRE settings and audit, the rebalancer's decision log.

    `url` None (the default): embedded SQLite files, one machine (router.ledger_path and the
    files beside it, rebalancer.decision_log_path). `postgresql://user@host:5432/dbname`: one
    PostgreSQL database (a unix socket: `postgresql://user@/dbname?host=/run/postgresql`),
    with the password read from the environment variable `password_env` names (never in the
    URL). `url_env` instead of `url`: the URL is read from that environment variable when the
    config is loaded (a Kubernetes Secret's key: the Helm chart's store.existingSecret).
    Schema migrations run at start (`gpupool store migrate` runs them alone)."""

    url: str | None = None
    url_env: str | None = None
    password_env: str | None = None
    # connections each router process keeps open at least / at most
    pool_min_connections: int = Field(default=1, ge=0)
    pool_max_connections: int = Field(default=8, ge=1)
    connect_timeout_s: float = Field(default=5.0, gt=0)  # also the wait for a free connection
    statement_timeout_s: float = Field(default=10.0, gt=0)  # PostgreSQL's statement_timeout
    # on: each commit waits for the database server's WAL fsync (survives its crash); off:
    # survives the router's kill -9 and a clean database restart, as the embedded store does
    # (per request, benchmarks/results/store_overhead.md)
    synchronous_commit: StrictBool = False
    # budgets while the database cannot be reached: `open`, each replica admits against its
    # own in-memory buckets and charges what it spent to the shared ones on reconnect (the
    # budget may be overspent up to once per replica for the outage); `closed`, a request
    # its replica's reserved chunk does not cover is refused with 503 store_unavailable
    budgets_on_outage: Literal["open", "closed"] = "open"
    # what a replica takes from a tenant's shared bucket at once, as a fraction of the
    # bucket (at least the request's own estimate); given back every governance sweep (1 s)
    budget_chunk_frac: float = Field(default=0.05, gt=0, le=0.5)
    # a replica's concurrency slots expire this long after its last renewal (every sweep,
    # 1 s; at least 3 sweeps): a replica that dies gives its slots back after at most this
    slot_lease_s: float = Field(default=30.0, ge=3, le=3600)
    # each replica publishes its KV and batch reservations per engine and reads the others'
    # this often; their admission subtracts them (router/admission/shared_reservations.py). 0:
    # not shared, each replica admits by its own reservations and the engines' measured use
    admission_interval_s: float = Field(default=0.1, ge=0, le=1)
    # a run's numbering under a lease (docs/replicas.md, s48): the replica that numbers a
    # run's step in the database holds the run for 2 governance sweeps, renewed each sweep,
    # and numbers its next steps from memory (no statement per step); a step of it on another
    # replica waits for the hand-over (up to 1 sweep; 2 when the holder died). Off behind a
    # balancer that sends each request to another replica (every step would wait)
    run_lease: StrictBool = True
    # read from `password_env` at load (the document may not set it)
    password: str | None = dataclasses.field(default=None, repr=False)

    @model_validator(mode="before")
    @classmethod
    def _no_password_in_document(cls, data: Any) -> Any:
        _refuse_derived(data, ("password",))
        data = _url_from_env(data)
        _refuse_idle(
            data,
            "url",
            _SHARED_ONLY,
            "store.url: the embedded store serves one router, whose budgets stay in memory"
            " (set a PostgreSQL url, or remove them)",
        )
        return data

    @field_validator("url")
    @classmethod
    def _postgres_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = _split_url(value)
        if parts.scheme not in _PG_SCHEMES:
            raise ValueError(
                "must be a PostgreSQL URL (postgresql://user@host:5432/dbname); leave it out"
                " for the embedded SQLite store"
            )
        if parts.password is not None:
            raise ValueError(
                "holds a password: put it in an environment variable and name that in"
                " store.password_env"
            )
        if not parts.path.strip("/"):
            raise ValueError("names no database (postgresql://user@host:5432/dbname)")
        if not parts.hostname and "host" not in parse_qs(parts.query):
            raise ValueError(
                "names no host (postgresql://user@host:5432/dbname, or ?host=/socket/dir)"
            )
        if parts.port == 0:
            raise ValueError("port 0")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> StoreConfig:
        if self.url is None and self.password_env is not None:
            raise ValueError(
                "store.password_env without store.url: the embedded store has no password"
            )
        if self.pool_min_connections > self.pool_max_connections:
            raise ValueError("store.pool_min_connections exceeds store.pool_max_connections")
        return self


# ---------------------------------------------------------------------------------------------
# observability
# ---------------------------------------------------------------------------------------------

_OTLP_TRACES_PATH = "/v1/traces"


@dataclass(frozen=True, slots=True, config=_STRICT)
class ObservabilityConfig:
    """OpenTelemetry traces (router/ops/tracing): a span tree per request, exported over
    OTLP/HTTP (protobuf) in batches. Off while `otlp_endpoint` is None; the other fields then
    have nothing to steer, so a document that sets them without it is refused."""

    # the collector's OTLP/HTTP base URL (http://tempo:4318: /v1/traces is added) or its full
    # traces URL; None: no traces
    otlp_endpoint: str | None = None
    service_name: str = Field(default="gpupool", min_length=1)  # every span's service.name
    # the share of new traces kept; an incoming traceparent's sampled flag (and an agent
    # run's first step, for its later steps) decides for the requests that have one
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    # the name of an env var holding headers for the collector (OTEL_EXPORTER_OTLP_HEADERS'
    # format: `key=value,key2=value2`, e.g. an authorization token); None: none
    headers_env: str | None = None
    export_interval_s: float = Field(default=1.0, gt=0, le=60)  # at most this long in a batch
    # engines gpupool starts (launcher local or ray) export vLLM's own spans to the same
    # collector (`--otlp-traces-endpoint`, OTLP/HTTP, this interval and these headers), so its
    # `llm_request` span hangs under the request's gpupool.engine span; None: on where gpupool
    # starts the engines. On is refused for static and kubernetes engines (they are started
    # elsewhere: give them `--otlp-traces-endpoint` there)
    engine_traces: bool | None = None
    # read from `headers_env` at load (the document may not set it)
    headers: tuple[tuple[str, str], ...] = dataclasses.field(default=(), repr=False)

    @model_validator(mode="before")
    @classmethod
    def _only_with_an_endpoint(cls, data: Any) -> Any:
        _refuse_derived(data, ("headers",))
        if isinstance(data, Mapping):
            _refuse_idle(
                data,
                "otlp_endpoint",
                [k for k in data if k != "otlp_endpoint"],
                "otlp_endpoint: traces are off, so nothing reads them (set otlp_endpoint, or"
                " remove them)",
            )
        return data

    @field_validator("otlp_endpoint")
    @classmethod
    def _traces_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = _split_url(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                "must be the collector's OTLP/HTTP URL, e.g. http://tempo:4318 (OTLP over"
                " gRPC, port 4317, is not spoken)"
            )
        if parts.path in ("", "/"):
            return value.rstrip("/") + _OTLP_TRACES_PATH
        return value


# ---------------------------------------------------------------------------------------------
# the whole configuration
# ---------------------------------------------------------------------------------------------

_POOLS: TypeAdapter[dict[str, PoolConfig]] = TypeAdapter(dict[str, PoolConfig])
_CLASSES: TypeAdapter[dict[str, ClassConfig]] = TypeAdapter(dict[str, ClassConfig])


@dataclass(frozen=True, slots=True, kw_only=True, config=_STRICT)
class Config:
    model: ModelConfig = Field(default_factory=ModelConfig)
    engines: EnginesConfig = Field(default_factory=EnginesConfig)
    pools: Annotated[  # the document gives a mapping of name -> pool (at least one)
        tuple[PoolConfig, ...],
        WrapValidator(lambda value, handler, info: handler(_named(value, _POOLS, info))),
    ]
    # one per class the pools serve, in the pools' order (the document's mapping of
    # name -> class; a class it does not list gets the defaults)
    classes: Annotated[
        tuple[ClassConfig, ...],
        WrapValidator(lambda value, handler, info: handler(_named(value, _CLASSES, info))),
    ] = ()
    tenants: tuple[TenantConfig, ...] = ()
    classification: ClassificationConfig = Field(default_factory=ClassificationConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    source: str = "<default>"  # where it was read from (set at load; not in the document)
    governance: GovernanceConfig = Field(default_factory=GovernanceConfig)
    rebalancer: RebalancerConfig = Field(default_factory=RebalancerConfig)
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    class_names: tuple[str, ...] = dataclasses.field(init=False, repr=False)  # pools' classes

    def __post_init__(self) -> None:
        names = tuple(c for pool in self.pools for c in pool.classes)
        object.__setattr__(self, "class_names", names)

    @model_validator(mode="before")
    @classmethod
    def _document_defaults(cls, data: Any) -> Any:
        """A document may not set `source`; its absent sections are validated as empty ones;
        its rebalancer's decision log defaults to decisions.sqlite beside router.state_path."""
        if not isinstance(data, Mapping):
            return data
        _refuse_derived(data, ("source",))
        sections = (
            "model",
            "engines",
            "classification",
            "router",
            "governance",
            "rebalancer",
            "store",
            "admission",
        )
        data = _sections_given(data, sections)
        rebalancer, router = data["rebalancer"], data["router"]
        store = data["store"]
        if isinstance(store, Mapping) and (store.get("url") or store.get("url_env")) is not None:
            # with a shared store these name files nothing reads
            for section, key in (("router", "ledger_path"), ("rebalancer", "decision_log_path")):
                given = data[section]
                if isinstance(given, Mapping) and given.get(key) is not None:
                    raise ValueError(
                        f"{section}.{key} names a file of the embedded store; with store.url"
                        " set the ledger and the decision log are in PostgreSQL: remove it"
                    )
        if isinstance(rebalancer, Mapping) and rebalancer.get("decision_log_path") is None:
            rebalancer = {k: v for k, v in rebalancer.items() if k != "decision_log_path"}
            state = router.get("state_path") if isinstance(router, Mapping) else None
            if isinstance(state, str):
                rebalancer["decision_log_path"] = str(Path(state).with_name("decisions.sqlite"))
            data = {**data, "rebalancer": rebalancer}
        return data

    @model_validator(mode="after")
    def _pins_are_unique(self) -> Config:
        owner: dict[str, str] = {}
        for pool in self.pools:
            for instance_id in pool.pinned_instances:
                if instance_id in owner:
                    raise ValueError(
                        f"instance {instance_id!r} is pinned to two pools ({owner[instance_id]!r}"
                        f" and {pool.name!r})"
                    )
                owner[instance_id] = pool.name
        return self

    @model_validator(mode="after")
    def _engine_traces_need_launched_engines(self) -> Config:
        launcher = self.engines.launcher
        if self.observability.engine_traces and launcher not in ("local", "ray"):
            raise ValueError(
                f"observability.engine_traces: on needs launcher 'local' or 'ray' (gpupool does"
                f" not start {launcher!r} engines: give them `--otlp-traces-endpoint` where they"
                " are started)"
            )
        return self

    @model_validator(mode="after")
    def _prefill_slice_engines(self) -> Config:
        tokens = self.admission.prefill_slice_tokens
        if tokens is None:
            return self
        launcher = self.engines.launcher
        if launcher not in ("local", "ray"):
            raise ValueError(
                f"admission.prefill_slice_tokens needs launcher 'local' or 'ray' (gpupool does"
                f" not start {launcher!r} engines: give them `--long-prefill-token-threshold"
                f" {tokens}` where they are started)"
            )
        args = self.engines.local.vllm_args if launcher == "local" else self.engines.ray.vllm_args
        flag = "--long-prefill-token-threshold"
        if any(a == flag or a.startswith(f"{flag}=") for a in args):
            raise ValueError(
                f"admission.prefill_slice_tokens and engines.{launcher}.vllm_args' {flag} both"
                " set the slice: keep one"
            )
        longest = self.model.max_model_len_tokens
        if longest is not None and tokens > longest:
            raise ValueError(
                f"admission.prefill_slice_tokens ({tokens}) is above model.max_model_len_tokens"
                f" ({longest}): vLLM refuses it"
            )
        return self

    @model_validator(mode="after")
    def _engine_priority_needs_the_policy(self) -> Config:
        wanted = [p.name for p in self.pools if p.engine_priority is not None]
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
    def _references(self) -> Config:
        if not self.pools:
            raise ValueError("at least one pool is needed")
        owners: dict[str, str] = {}
        for pool in self.pools:
            for cls in pool.classes:
                if cls in owners:
                    raise ValueError(
                        f"class {cls!r} is served by two pools ({owners[cls]!r} and {pool.name!r})"
                    )
                owners[cls] = pool.name
        for c in self.classes:
            if c.name not in owners:
                raise ValueError(f"classes.{c.name} is not served by any pool")
        seen: set[str] = set()
        tiers = {t.name for t in self.governance.tiers}
        task_types = dict(self.governance.task_types_s)
        for tenant in self.tenants:
            if tenant.name in seen:
                raise ValueError(f"tenant {tenant.name!r} appears twice")
            seen.add(tenant.name)
            if tenant.default_class is not None and tenant.default_class not in owners:
                raise ValueError(
                    f"tenant {tenant.name!r}: default_class {tenant.default_class!r} is not served"
                    " by any pool"
                )
            if tenant.tier is not None and tenant.tier not in tiers:
                raise ValueError(
                    f"tenant {tenant.name!r}: tier {tenant.tier!r} is not a governance tier"
                    f" (known: {', '.join(sorted(tiers))})"
                )
            if tenant.task_type is not None and tenant.task_type not in task_types:
                raise ValueError(
                    f"tenant {tenant.name!r}: task_type {tenant.task_type!r} is not in"
                    f" governance.task_types_s (known: {', '.join(sorted(task_types))})"
                )
        rules = self.classification
        for what, cls in (
            ("tools_class", rules.tools_class),
            ("run_class", rules.run_class),
            ("default_class", rules.default_class),
        ):
            if cls not in owners:
                raise ValueError(
                    f"classification.{what}: class {cls!r} is not served by any pool (pools serve"
                    f" {', '.join(sorted(owners))})"
                )
        # one class per class served, in the pools' order; unlisted ones get the defaults
        listed = {c.name: c for c in self.classes}
        filled = tuple(listed.get(name) or ClassConfig(name) for name in self.class_names)
        object.__setattr__(self, "classes", filled)
        return self

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
        return ClassConfig(name)
