"""The `gpupool` command line: one entry point, one module per subcommand under
`router/cli/commands/`. Each module exposes `register(subparsers)`, which adds its parser and sets
`func(args) -> int` (the exit code). Exit codes: 0 success, 1 runtime failure, 2 bad input
(usage or configuration). `stack` runs the stack in one process (engines, the router behind
uvicorn, a clean shutdown).

The top of the product: it may import every package of it; nothing imports it. Must not import
`benchmarks` (tests/unit/test_layering.py).
"""

from __future__ import annotations

import argparse
import importlib
import logging

__all__ = ["main"]

# Subcommand modules, in the order `gpupool --help` lists them.
COMMAND_MODULES = (
    "router.cli.commands.up",
    "router.cli.commands.serve",
    "router.cli.commands.check_config",
    "router.cli.commands.dev_model",
    "router.cli.commands.plan",
    "router.cli.commands.probe",
    "router.cli.commands.runs",
    "router.cli.commands.top",
    "router.cli.commands.pools",
    "router.cli.commands.simulate",
    "router.cli.commands.store",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpupool",
        description="GPU inference pool manager: one OpenAI endpoint over many vLLM engines.",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="debug logging (for up and serve it wins over router.log_level)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    code: int = args.func(args)
    return code
