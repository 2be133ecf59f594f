"""`gpupool serve --config FILE`: run only the router, against engines already running
(`engines.static.urls`, or the local launcher's host and ports). The config passes the checks
`check-config` runs first, or nothing starts (exit 2)."""

from __future__ import annotations

import argparse

from router.cli.commands._config import add_stack_arguments, check_or_report, stack_config


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("serve", help="run only the router against running engines")
    add_stack_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = stack_config(args)
    if config is None or not check_or_report(config):
        return 2
    from router.cli.stack import run_blocking

    return run_blocking(config, launch=False)
