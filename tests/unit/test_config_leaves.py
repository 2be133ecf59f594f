"""Every leaf setting of the config schema is read by some module outside `pools/config/`.

A setting nobody reads does nothing: a user who sets it is misled. The walk goes through
every section of `Config` (and the sections inside lists and mappings of sections, and the
shapes a document gives where the program reads another: schedule windows, tenant run guard
overrides); a leaf counts as read when the source of pools/, router/, gpu_probe/ or
kvcache_model/ (outside pools/config/) has `.<field name>` in it, or `.<alias>` for a setting
the config turns into another attribute at load (a key's env var becomes the key).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any

from pools.config import (
    Config,
    RunGuardsConfig,
    ShareConfig,
    ShareWindow,
    TenantConfig,
)

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pools", "router", "gpu_probe", "kvcache_model")

# settings the document gives in one shape and the program reads in another
DOCUMENT_SHAPES: dict[tuple[type[Any], str], type[Any]] = {
    (ShareConfig, "schedule"): ShareWindow,  # read as pools.rebalance.ScheduleWindow
    (TenantConfig, "run_guards"): RunGuardsConfig,  # read as (field, value) overrides
}
# what the program reads in place of a setting (the config reads the setting at load)
ALIASES: dict[str, tuple[str, ...]] = {
    "api_key_env": ("api_key",),  # the env var's value, the key
    "admin_api_key_env": ("admin_api_key_sha256",),
    "metrics_api_key_env": ("metrics_api_key_sha256",),
    "headers_env": ("headers",),  # the collector's headers, read from it
    "password_env": ("password",),  # the store's PostgreSQL password, read from it
    "url_env": ("url",),  # the store's URL, read from it at load
    "start": ("start_min",),  # ShareWindow -> ScheduleWindow
    "end": ("end_min",),
    "floor_frac": ("floor_frac", "bounds"),
    "ceiling_frac": ("ceiling_frac", "bounds"),
}


def _sections(tp: Any) -> list[type[Any]]:
    """The dataclass sections inside a field's type (through tuples, unions, Annotated)."""
    if dataclasses.is_dataclass(tp):
        return [typing.cast(type[Any], tp)]
    found: list[type[Any]] = []
    for arg in typing.get_args(tp):
        if arg is not Ellipsis and not isinstance(arg, str | int | float):
            found += _sections(arg)
    return found


def leaves(section: type[Any], path: str = "") -> list[str]:
    """Dotted paths of every leaf setting under `section` (fields set at load or derived
    from others, which no document gives, are not settings)."""
    hints = {name: info.annotation for name, info in section.__pydantic_fields__.items()}
    out: list[str] = []
    for f in dataclasses.fields(section):
        if not f.init:
            continue  # derived in __post_init__
        where = f"{path}.{f.name}" if path else f.name
        inner = DOCUMENT_SHAPES.get((section, f.name))
        subs = [inner] if inner is not None else _sections(hints[f.name])
        if subs:
            for sub in subs:
                out += leaves(sub, where)
        else:
            out.append(where)
    return out


def _source() -> str:
    texts = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if (ROOT / "pools" / "config") in path.parents:
                continue
            texts.append(path.read_text())
    return "\n".join(texts)


def test_the_walk_sees_every_section() -> None:
    found = set(leaves(Config))
    for expected in (
        "pools.share.schedule.start",
        "pools.queue.run_las_max_slowdown",
        "tenants.run_guards.loop_repeats",
        "classes.run_guards.max_steps",
        "governance.tiers.queue_weight",
        "engines.kubernetes.services.port",
        "rebalancer.hysteresis_frac",
        "router.kv_margin_frac",
    ):
        assert expected in found
    assert not isinstance(Config, types.ModuleType)


def test_every_leaf_setting_is_read_outside_the_config_package() -> None:
    source = _source()
    unread = []
    for path in leaves(Config):
        name = path.rsplit(".", 1)[-1]
        names = ALIASES.get(name, (name,))
        if not any(re.search(rf"\.{re.escape(n)}\b", source) for n in names):
            unread.append(path)
    assert unread == [], f"settings nothing outside pools/config reads: {unread}"
