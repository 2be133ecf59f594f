"""`gpupool dev-model [--out DIR] [--shape tiny|llama-3.1-8b]`: write the dev model folder."""

from __future__ import annotations

import argparse

from pools.devmodel import SHAPES, dev_model_fingerprint, make_dev_model


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "dev-model", help="write a Llama-shaped model folder for vLLM's --load-format dummy"
    )
    p.add_argument("--out", default=None, help="folder (default ./.gpupool/models/SHAPE)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = args.out or f"./.gpupool/models/{args.shape}"
    folder = make_dev_model(out, args.shape)
    digest = dev_model_fingerprint(folder)[:12]
    print(f"dev model {args.shape!r} written to {folder} (sha256 {digest})")
    return 0
