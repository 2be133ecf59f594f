"""Config loading shared by the subcommands: problems printed one per line, exit code 2.

`check-config`, `up` and `serve` run the same checks (`config_problems`): a config that parses
but cannot run is refused by all three before anything starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys

from pools.config import Config, ConfigError, contract_problems, load_config
from pools.launchers.engine_plan import engine_problems, probe_host

__all__ = [
    "add_stack_arguments",
    "check_or_report",
    "config_problems",
    "load_checked_or_report",
    "load_or_report",
    "port_number",
    "replica_count",
    "stack_config",
    "with_port",
    "with_replicas",
    "with_verbose",
]


def load_or_report(path: str | None) -> Config | None:
    """The config at `path` (None: the built-in default), or None after printing why not."""
    try:
        return load_config(path)
    except ConfigError as err:
        print(f"gpupool: invalid config {err.source}:", file=sys.stderr)
        for problem in err.problems:
            print(f"  - {problem}", file=sys.stderr)
        return None


def config_problems(config: Config) -> list[str]:
    """Everything that makes a valid config unable to run as configured; empty when none: the
    contract (`contract_problems`) and, for local engines, what would stop them on this machine
    (`engine_problems`: e.g. a KV cache smaller than one max_model_len sequence)."""
    problems = contract_problems(config)
    if config.engines.launcher == "local":
        problems += engine_problems(config, probe_host())
    if config.engines.launcher == "ray" and importlib.util.find_spec("ray") is None:
        problems.append(
            "engines.launcher: 'ray' needs Ray, which is not installed here"
            " (make install installs it; or pip install 'ray>=2.40')"
        )
    return problems


def check_or_report(config: Config) -> bool:
    """True when `config_problems` finds nothing; else prints the problems and returns False."""
    problems = config_problems(config)
    if problems:
        print(f"gpupool: config {config.source} is valid but inconsistent:", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
    return not problems


def load_checked_or_report(path: str | None) -> Config | None:
    """`load_or_report`, then `check_or_report`: the config, or None after printing why not."""
    config = load_or_report(path)
    if config is None or not check_or_report(config):
        return None
    return config


def _int_between(text: str, low: int, high: int, noun: str) -> int:
    """`text` as an int in [low, high], else argparse's usage error (exit 2), never a
    traceback from the config's validation."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a {noun}: {text!r}") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"a {noun} is {low}-{high}, got {value}")
    return value


def port_number(text: str) -> int:
    """`--port`'s type: a TCP port (1-65535)."""
    return _int_between(text, 1, 65535, "port")


def with_port(config: Config, port: int | None) -> Config:
    if port is None:
        return config
    return dataclasses.replace(config, router=dataclasses.replace(config.router, port=port))


def with_replicas(config: Config, replicas: int | None) -> Config:
    """`--replicas N` wins over `router.replicas`."""
    if replicas is None:
        return config
    router = dataclasses.replace(config.router, replicas=replicas)
    return dataclasses.replace(config, router=router)


def replica_count(text: str) -> int:
    """`--replicas`'s type: 1-64 router processes."""
    return _int_between(text, 1, 64, "router process count")


def with_verbose(config: Config, verbose: bool) -> Config:
    """`gpupool -v` wins over `router.log_level`: the router and uvicorn log at debug."""
    if not verbose:
        return config
    router = dataclasses.replace(config.router, log_level="debug")
    return dataclasses.replace(config, router=router)


def add_stack_arguments(parser: argparse.ArgumentParser) -> None:
    """`--config`, `--port` and `--replicas`, as `serve` and `up` take them."""
    parser.add_argument("--config", help="YAML config (default: the built-in default)")
    parser.add_argument("--port", type=port_number, help="router port (overrides router.port)")
    parser.add_argument(
        "--replicas",
        type=replica_count,
        metavar="N",
        help="router processes on the one port (overrides router.replicas; more than 1 needs"
        " store.url, a PostgreSQL store)",
    )


def stack_config(args: argparse.Namespace) -> Config | None:
    """The config `serve` and `up` run: `--config` loaded (None after printing why not), with
    `--port`, `--replicas` and `-v` applied. The contract checks are the caller's (`up` may
    make the dev model first)."""
    config = load_or_report(args.config)
    if config is None:
        return None
    config = with_replicas(with_port(config, args.port), getattr(args, "replicas", None))
    return with_verbose(config, getattr(args, "verbose", False))
