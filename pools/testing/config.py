"""The configuration tests and benchmarks start from: gpupool's built-in default (the tiny dev
model, three local engines, pools `agent` and `normal`) with the router's files under a
scratch folder, the engines optionally static URLs, and a test's own settings merged in.

    config = config_for_test(tmp_path, pools=even_pools(), router={"scrape_interval_s": 0.05})

Overrides merge into the default section by section (a mapping into a mapping, key by key; any
other value replaces; `REMOVE` removes the key). `pools` replaces the default pools whole, since
a test's pools are a set: `even_pools()` (agent and normal, half each) and `one_pool()` (one
`normal` pool serving both classes) are the two shapes most tests use; `default_pools(...)`
changes the built-in two.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pools.config import DEFAULT_CPU_CONFIG, Config, parse_config

__all__ = [
    "REMOVE",
    "config_data",
    "config_for_test",
    "deep_merge",
    "default_pools",
    "even_pools",
    "one_pool",
]


class _Remove:
    def __repr__(self) -> str:
        return "REMOVE"


REMOVE: Any = _Remove()  # as an override's value: leave the key out (its schema default holds)


def deep_merge(base: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `changes` merged in: mappings key by key, other values replace (`None`
    too), `REMOVE` removes the key. Neither argument is changed."""
    merged = copy.deepcopy(dict(base))
    for key, value in changes.items():
        if value is REMOVE:
            merged.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def default_pools(**per_pool: Mapping[str, Any]) -> dict[str, Any]:
    """The built-in default's pools (agent 0.34, normal 0.66, with their SLOs and queues);
    `per_pool` merges more into one, e.g. `agent={"share": {"floor_frac": 0.2}}`."""
    return deep_merge(DEFAULT_CPU_CONFIG["pools"], per_pool)


def even_pools(**per_pool: Mapping[str, Any]) -> dict[str, Any]:
    """Pools `agent` (class agent) and `normal` (class normal), half the fleet each, nothing
    else set; `per_pool` merges more into one, e.g. `normal={"queue": {"max_wait_s": 5}}`."""
    pools: dict[str, Any] = {
        "agent": {"classes": ["agent"], "share": {"initial_frac": 0.5}},
        "normal": {"classes": ["normal"], "share": {"initial_frac": 0.5}},
    }
    return deep_merge(pools, per_pool)


def one_pool(**settings: Any) -> dict[str, Any]:
    """One pool, `normal`, serving both classes on the whole fleet; `settings` merge into it,
    e.g. `queue={"order": "run_las"}`."""
    pool = {"classes": ["normal", "agent"], "share": {"initial_frac": 1.0}}
    return {"normal": deep_merge(pool, settings)}


def config_data(
    tmp_dir: Path | None = None,
    *,
    urls: Sequence[str] | None = None,
    pools: Mapping[str, Any] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """The YAML document `config_for_test` parses (for a test that writes it to a file, or
    expects it refused). With `tmp_dir` the ledger is `tmp_dir/l.sqlite` and the SRE state
    `tmp_dir/s.json`; with `urls` the engines are those static URLs."""
    data = copy.deepcopy(DEFAULT_CPU_CONFIG)
    if tmp_dir is not None:
        data["router"] = {
            "ledger_path": str(tmp_dir / "l.sqlite"),
            "state_path": str(tmp_dir / "s.json"),
        }
    if urls is not None:
        data["engines"] = {"launcher": "static", "static": {"urls": list(urls)}}
    if pools is not None:
        data["pools"] = copy.deepcopy(dict(pools))
    return deep_merge(data, overrides)


def config_for_test(
    tmp_dir: Path | None = None,
    *,
    urls: Sequence[str] | None = None,
    pools: Mapping[str, Any] | None = None,
    **overrides: Any,
) -> Config:
    """`config_data(...)` parsed (relative paths resolve against the current directory)."""
    return parse_config(config_data(tmp_dir, urls=urls, pools=pools, **overrides))
