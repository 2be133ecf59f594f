"""`gpupool check-config FILE`: validate a config file and check its contract is consistent.

Exit 0 when valid and consistent, 2 otherwise, with one line per problem naming the field.
`up` and `serve` run the same checks before they start anything.
"""

from __future__ import annotations

import argparse

from pools.config import Config, not_yet_in_effect
from router.cli.commands._config import load_checked_or_report


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("check-config", help="validate a config file and its contract")
    p.add_argument("file", nargs="?", help="YAML config (default: the built-in default)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = load_checked_or_report(args.file)
    if config is None:
        return 2
    pools = ", ".join(
        f"{p.name} ({'/'.join(p.classes)}: {p.share.initial_frac:.0%} in "
        f"[{p.share.floor_frac:.0%}, {p.share.ceiling_frac:.0%}])"
        for p in config.pools
    )
    print(
        f"{config.source}: ok; {config.engines.instance_count} instances "
        f"({config.engines.launcher}); pools: {pools}"
    )
    for note in not_yet_in_effect(config):
        print(f"  note: {note}")
    for warning in kv_capacity_warnings(config):
        print(f"  warning: {warning}")
    return 0


def kv_capacity_warnings(config: Config) -> list[str]:
    """Engines gpupool does not launch may not report their KV capacity (an older vLLM, a
    proxy, another OpenAI server): say what admission does then. The local and Ray launchers
    start the installed vLLM, which reports it (`vllm:cache_config_info`)."""
    if config.engines.launcher != "static":
        return []
    return [
        "engines.static: an engine whose /metrics lacks vllm:cache_config_info (an older vLLM,"
        " a proxy, another OpenAI server) has an unknown KV capacity: it gets no KV headroom"
        " check and runs at most router.unknown_kv_max_concurrency"
        f" ({config.router.unknown_kv_max_concurrency}) sequences at once (fewer if its"
        " operating point says so); /admin/pools shows it as kv_capacity: unknown"
    ]
