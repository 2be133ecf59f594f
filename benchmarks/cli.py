"""The benchmark command line, `gpupool-bench` (pyproject.toml's scripts) or
`python -m benchmarks`:

    gpupool-bench --scenario FILE --target URL [--target URL ...] [--target-name NAME ...]
                  [--model tiny] [--api-key K] [--tokenizer tokenizer.json] [--seed N]
                  [--duration-s S] [--rate-scale X] [--pause-s S] [--header K=V ...]
                  [--no-progress] --out DIR

Exit codes: 0 report written, 1 the benchmark could not run (a target unreachable), 2 bad
input (the scenario is invalid, arguments do not match).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from pathlib import Path

from benchmarks.compare import BenchError, run_compare
from benchmarks.runner import Target
from router.simulate.prompts import find_tokenizer
from router.simulate.scenario import ScenarioError, load_scenario, scale_rates

__all__ = ["add_arguments", "main", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", required=True, help="scenario YAML (benchmarks/scenarios/)")
    p.add_argument(
        "--target",
        action="append",
        required=True,
        metavar="URL",
        help="OpenAI-compatible base URL; repeat to compare targets in turn",
    )
    p.add_argument(
        "--target-name",
        action="append",
        default=[],
        metavar="NAME",
        help="a name per --target, in the same order (default: target1, ...)",
    )
    p.add_argument("--model", default=None, help="model name to send (default: the scenario's)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("GPUPOOL_API_KEY"),
        help="bearer key (default: $GPUPOOL_API_KEY)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json for prompt sizing (default: .gpupool/models/MODEL/, "
        "else calibrate tokens/word against the first target)",
    )
    p.add_argument("--seed", type=int, default=None, help="override the scenario's seed")
    p.add_argument(
        "--duration-s", type=float, default=None, help="override the scenario's arrival window"
    )
    p.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        help="multiply every arrival rate (scenarios are sized for 3 CPU engines)",
    )
    p.add_argument("--pause-s", type=float, default=5.0, help="pause between targets")
    p.add_argument(
        "--header", action="append", default=[], metavar="K=V", help="extra header on every request"
    )
    p.add_argument("--notes", default="", help="free text written into the report")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", required=True, help="report folder")


def run(args: argparse.Namespace) -> int:
    try:
        scenario = load_scenario(args.scenario)
    except ScenarioError as err:
        print(f"gpupool-bench: invalid scenario {err.source}:", file=sys.stderr)
        for problem in err.problems:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    if args.rate_scale != 1.0:
        try:
            scenario = scale_rates(scenario, args.rate_scale)
        except ScenarioError as err:
            print(f"gpupool-bench: {err}", file=sys.stderr)
            return 2
    if args.duration_s is not None:
        scenario = dataclasses.replace(scenario, duration_s=args.duration_s)
    names = list(args.target_name)
    if names and len(names) != len(args.target):
        print("gpupool-bench: give one --target-name per --target", file=sys.stderr)
        return 2
    names = names or [f"target{i + 1}" for i in range(len(args.target))]
    headers = []
    for item in args.header:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"gpupool-bench: --header wants K=V, got {item!r}", file=sys.stderr)
            return 2
        headers.append((key.strip(), value.strip()))
    model = args.model or scenario.model
    targets = [
        Target(n, u, model, args.api_key, tuple(headers))
        for n, u in zip(names, args.target, strict=True)
    ]
    tokenizer = find_tokenizer(model, args.tokenizer or scenario.tokenizer_path)
    out = Path(args.out)
    try:
        report = asyncio.run(
            run_compare(
                scenario,
                targets,
                out,
                seed=args.seed,
                tokenizer_path=tokenizer,
                progress=not args.no_progress,
                pause_s=args.pause_s,
                notes=args.notes,
            )
        )
    except BenchError as err:
        print(f"gpupool-bench: {err}", file=sys.stderr)
        return 1
    for t in report["targets"]:
        att = t["slo_attainment_frac"]
        print(
            f"{t['name']}: {t['requests']} requests in {t['wall_s']:.1f} s, goodput "
            f"{t['goodput_rps']:.2f} req/s, SLO attainment "
            f"{'–' if att is None else f'{100 * att:.1f} %'}"
        )
    print(f"report: {out / 'report.md'} ({out / 'report.json'})")
    return 0


def main(argv: list[str] | None = None) -> int:
    import logging

    parser = argparse.ArgumentParser(prog="gpupool-bench", description="gpupool benchmark harness")
    parser.add_argument("-v", "--verbose", action="store_true")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    return run(args)
