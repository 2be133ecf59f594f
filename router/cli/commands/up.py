"""`gpupool up [--config FILE]`: start the engines and the router; Ctrl-C stops everything.

The config passes the checks `check-config` runs first, or nothing starts (exit 2)."""

from __future__ import annotations

import argparse
import sys

from pools.devmodel import SHAPES, is_dev_model, make_dev_model
from router.cli.commands._config import add_stack_arguments, check_or_report, stack_config


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("up", help="start engines and the router (default: 3 CPU engines)")
    add_stack_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = stack_config(args)
    if config is None:
        return 2
    model = config.model
    if model.load_format == "dummy" and not is_dev_model(model.path) and model.path.name in SHAPES:
        make_dev_model(model.path, model.path.name)
        print(f"gpupool: made the dev model {model.path.name!r} in {model.path}", file=sys.stderr)
    if not check_or_report(config):
        return 2
    from router.cli.stack import run_blocking

    return run_blocking(config, launch=True)
