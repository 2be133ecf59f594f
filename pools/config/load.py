"""Reading a configuration: YAML (or an already parsed document) -> a validated `Config`.

`parse_config` validates the document against the declarations in `schema.py` once, then
reads the keys the document names by environment variable, hashes every key, and refuses
one key held twice. `ConfigError.problems` holds one message per offending field, each led
by its dotted path (`pools.normal.share.initial_frac: ...`); a message never holds a key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import urllib.parse
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from pools.config.schema import Config, ObservabilityConfig, TenantConfig

__all__ = [
    "DEFAULT_CPU_CONFIG",
    "ConfigError",
    "default_config",
    "load_config",
    "parse_config",
    "validation_problems",
]

_log = logging.getLogger(__name__)

_CONFIG: TypeAdapter[Config] = TypeAdapter(Config)


class ConfigError(Exception):
    """The configuration is invalid. `problems` lists one message per offending field."""

    def __init__(self, problems: list[str], source: str = "config") -> None:
        self.problems = problems
        self.source = source
        super().__init__(f"{source}: " + "; ".join(problems))


def validation_problems(err: ValidationError) -> list[str]:
    """One line per problem, `where: what` (the dotted path in the document, then pydantic's
    message, plainer for unknown and missing fields); the simulator's scenarios use it too."""
    problems = []
    for item in err.errors():
        where = ".".join(str(p) for p in item["loc"]) or "(top level)"
        message = item["msg"]
        if item["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            message = "unknown field (check the spelling)"
        elif item["type"] in ("missing_argument", "missing_keyword_only_argument"):
            message = "Field required"
        elif message.startswith("Value error, "):
            message = message[len("Value error, ") :]
        problems.append(f"{where}: {message}")
    return problems


def _env_key(var: str, where: str, problems: list[str]) -> str | None:
    key = os.environ.get(var)
    if not key:
        problems.append(f"{where}: environment variable {var!r} is not set or empty")
    return key or None


def _key_sha256(key: str | None) -> str | None:
    return None if key is None else hashlib.sha256(key.encode()).hexdigest()


def _with_keys(config: Config, problems: list[str]) -> Config:
    """`config` with every key read from the environment variable the document names, each
    key hashed, and `secret_env` (every `*api_key_env` named) on the engine sections.

    Appends to `problems`: an unset env var, one key shared by two tenants (or by a tenant and
    the admin or metrics key). Warns about literal keys. Messages name tenants and variables,
    never a key or its hash.
    """
    tenants: list[TenantConfig] = []
    holder: dict[str, str] = {}  # key digest -> who holds it, as a message names it
    for t in config.tenants:
        key = t.api_key
        if t.api_key_env is not None:
            key = _env_key(t.api_key_env, f"tenants.{t.name}.api_key_env", problems)
        elif key is not None:
            _log.warning(
                "%s: tenant %r has a literal api_key; prefer api_key_env (the name of an"
                " environment variable holding the key) or api_key_sha256 (the key's hash)",
                config.source,
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
        tenants.append(dataclasses.replace(t, api_key=key, api_key_sha256=digest))
    r = config.router
    operators: dict[str, str | None] = {}
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
        operators[who] = operator_digest
    e = config.engines
    keys = {
        which: _env_key(var, f"engines.{which}.api_key_env", problems) if var else None
        for which, var in (
            ("local", e.local.api_key_env),
            ("static", e.static.api_key_env),
            ("kubernetes", e.kubernetes.api_key_env),
            ("ray", e.ray.api_key_env),
        )
    }
    secret_env = _secret_env_names(config)
    if config.observability.headers_env is not None:  # the collector's token
        secret_env |= {config.observability.headers_env}
    store = config.store
    if store.password_env is not None:
        password = _env_key(store.password_env, "store.password_env", problems)
        store = dataclasses.replace(store, password=password)
    return dataclasses.replace(
        config,
        observability=_with_headers(config.observability, problems),
        store=store,
        tenants=tuple(tenants),
        router=dataclasses.replace(
            r,
            admin_api_key_sha256=operators["admin"],
            metrics_api_key_sha256=operators["metrics"],
        ),
        engines=dataclasses.replace(
            e,
            local=dataclasses.replace(e.local, api_key=keys["local"], secret_env=secret_env),
            static=dataclasses.replace(e.static, api_key=keys["static"]),
            kubernetes=dataclasses.replace(e.kubernetes, api_key=keys["kubernetes"]),
            ray=dataclasses.replace(e.ray, api_key=keys["ray"], secret_env=secret_env),
        ),
    )


def _with_headers(obs: ObservabilityConfig, problems: list[str]) -> ObservabilityConfig:
    """`obs` with the collector's headers read from `headers_env` (`key=value,...`, values
    percent-decoded as OTEL_EXPORTER_OTLP_HEADERS' are). Problems name the variable, never a
    value."""
    if obs.headers_env is None:
        return obs
    where = "observability.headers_env"
    raw = _env_key(obs.headers_env, where, problems)
    if raw is None:
        return obs
    headers: list[tuple[str, str]] = []
    for item in raw.split(","):
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            problems.append(
                f"{where}: the value of {obs.headers_env!r} is not `key=value,key2=value2`"
                " (an item has no key or no value)"
            )
            return obs
        headers.append((name.strip().lower(), urllib.parse.unquote(value.strip())))
    return dataclasses.replace(obs, headers=tuple(headers))


def _secret_env_names(node: Any) -> frozenset[str]:
    """Every env var name the config gives in a field called `api_key_env`, `*_api_key_env` or
    `password_env`, anywhere in the tree: the variables engines must not inherit."""
    names: set[str] = set()
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            secret = f.name.endswith("api_key_env") or f.name == "password_env"
            if secret and isinstance(value, str):
                names.add(value)
            elif f.init:
                names |= _secret_env_names(value)
    elif isinstance(node, list | tuple):
        for item in node:
            names |= _secret_env_names(item)
    return frozenset(names)


def parse_config(data: Any, *, base_dir: Path | None = None, source: str = "config") -> Config:
    """Validate a parsed YAML document (relative paths in it resolve against `base_dir`, the
    current directory by default). Raises `ConfigError`."""
    if not isinstance(data, dict):
        raise ConfigError(["(top level): expected a mapping of sections"], source)
    try:
        config = _CONFIG.validate_python(data, context={"base_dir": base_dir or Path.cwd()})
    except ValidationError as err:
        raise ConfigError(validation_problems(err), source) from None
    problems: list[str] = []
    config = _with_keys(dataclasses.replace(config, source=source), problems)
    if problems:
        raise ConfigError(problems, source)
    return config


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
