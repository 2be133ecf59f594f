"""Whether real vLLM engines would start, from the command lines gpupool builds, at the cost of
one import of vLLM: `python -m pools.testing.engine_init ARGV_JSON...`.

Each argument is one engine's argv as `build_engine_command` makes it (`python -m
vllm.entrypoints.openai.api_server --model ...`). The flags go through the OpenAI server's own
parser and engine-argument conversion (as `vllm.entrypoints.launchers.api_server.entry` does),
then vLLM's `EngineCore` is built in a child forked after the import: the same constructor the
server's `EngineCore` process runs (model load, KV cache sizing and vLLM's check that the cache
holds one `max_model_len` sequence, warm-up). What is skipped is only the HTTP server around
it and the second import of vLLM the server's spawned `EngineCore` process makes (the two
imports are ~20 of a CPU engine's ~30 s start-up).

Prints one line per argv, in order, after `RESULT_PREFIX` (vLLM logs on stdout too): the JSON
`{"started": true}`, or `{"started": false, "error": "<the exception vLLM raised>"}`. The
environment is the caller's: give it the engine's (`engine_environ`). Engines start in
parallel, each in its own forked child (vLLM keeps process-wide state such as its distributed
group, so one process builds one engine).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from typing import Any

__all__ = ["RESULT_PREFIX", "main"]

RESULT_PREFIX = "gpupool-engine-init: "

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def _server_flags(argv: list[str]) -> list[str]:
    """The flags after `python -m vllm.entrypoints.openai.api_server`."""
    if SERVER_MODULE not in argv:
        raise ValueError(f"not an engine command line (no {SERVER_MODULE}): {argv[:4]}")
    return argv[argv.index(SERVER_MODULE) + 1 :]


def _build_engine(flags: list[str]) -> None:
    """Build (and shut down) vLLM's EngineCore for the server flags `flags`; raises what vLLM
    raises when it would refuse to start."""
    argparse_utils: Any = importlib.import_module("vllm.utils.argparse_utils")
    cli_args: Any = importlib.import_module("vllm.entrypoints.launchers.cli_args")
    arg_utils: Any = importlib.import_module("vllm.engine.arg_utils")
    usage_lib: Any = importlib.import_module("vllm.usage.usage_lib")
    core: Any = importlib.import_module("vllm.v1.engine.core")
    abstract: Any = importlib.import_module("vllm.v1.executor.abstract")
    parser = cli_args.make_arg_parser(argparse_utils.FlexibleArgumentParser())
    args = parser.parse_args(flags)
    cli_args.validate_parsed_serve_args(args)
    engine_args = arg_utils.AsyncEngineArgs.from_cli_args(args)
    config = engine_args.create_engine_config(
        usage_context=usage_lib.UsageContext.OPENAI_API_SERVER
    )
    engine = core.EngineCore(config, abstract.Executor.get_class(config), log_stats=True)
    engine.shutdown()


def _child(flags: list[str], write_fd: int) -> None:
    try:
        _build_engine(flags)
        result: dict[str, Any] = {"started": True}
    except Exception as err:  # what vLLM raised is the answer
        traceback.print_exc()
        result = {"started": False, "error": f"{type(err).__name__}: {err}"}
    with os.fdopen(write_fd, "w") as out:
        out.write(json.dumps(result))


def main(argvs: list[list[str]]) -> list[dict[str, Any]]:
    importlib.import_module("vllm.v1.engine.core")  # once, before the forks share it
    importlib.import_module("vllm.entrypoints.launchers.cli_args")
    children: list[tuple[int, int]] = []
    for argv in argvs:
        flags = _server_flags(argv)
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: build one engine, report, and leave without cleanup
            os.close(read_fd)
            code = 0
            try:
                _child(flags, write_fd)
            except BaseException:  # the parent reports a silent child
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(write_fd)
        children.append((pid, read_fd))
    results = []
    for pid, read_fd in children:
        with os.fdopen(read_fd) as answer:
            text = answer.read()
        _, status = os.waitpid(pid, 0)
        results.append(
            json.loads(text)
            if text
            else {"started": False, "error": f"the child exited with status {status} silently"}
        )
    return results


if __name__ == "__main__":
    for line in main([json.loads(a) for a in sys.argv[1:]]):
        print(RESULT_PREFIX + json.dumps(line), flush=True)
