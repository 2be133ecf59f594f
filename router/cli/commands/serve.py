"""`gpupool serve --config FILE`: run only the router, against engines already running
(`engines.static.urls`, or the local launcher's host and ports). The config passes the checks
`check-config` runs first, or nothing starts (exit 2)."""

from __future__ import annotations

import argparse

from router.cli.commands._config import load_checked_or_report, port_number, with_port, with_verbose


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("serve", help="run only the router against running engines")
    p.add_argument("--config", help="YAML config (default: the built-in default)")
    p.add_argument("--port", type=port_number, help="router port (overrides router.port)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = load_checked_or_report(args.config)
    if config is None:
        return 2
    from router.cli.stack import run_blocking

    config = with_verbose(with_port(config, args.port), getattr(args, "verbose", False))
    return run_blocking(config, launch=False)
