"""Config loading shared by the subcommands: problems printed one per line, exit code 2."""

from __future__ import annotations

import dataclasses
import sys

from pools.config import Config, ConfigError, load_config

__all__ = ["load_or_report", "with_port"]


def load_or_report(path: str | None) -> Config | None:
    """The config at `path` (None: the built-in default), or None after printing why not."""
    try:
        return load_config(path)
    except ConfigError as err:
        print(f"gpupool: invalid config {err.source}:", file=sys.stderr)
        for problem in err.problems:
            print(f"  - {problem}", file=sys.stderr)
        return None


def with_port(config: Config, port: int | None) -> Config:
    if port is None:
        return config
    return dataclasses.replace(config, router=dataclasses.replace(config.router, port=port))
