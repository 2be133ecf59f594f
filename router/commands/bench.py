"""`gpupool bench --scenario FILE --target URL [...] --out DIR`: run a benchmark scenario
against one or more OpenAI-compatible targets and write a side-by-side report. The harness
lives in `benchmarks/`; this module only registers the subcommand (see benchmarks/cli.py).
"""

from __future__ import annotations

import argparse

from benchmarks.cli import add_arguments, run


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "bench", help="run a benchmark scenario against targets and write a report"
    )
    add_arguments(p)
    p.set_defaults(func=run)
