"""`admission.prefill_slice_tokens`: the engines gpupool starts get vLLM's long-prefill cap
(pools/launchers/prefill_slice.py), and the config refuses it where it would do nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pools.config import ConfigError, parse_config
from pools.launchers import LocalLauncher, make_launcher
from pools.launchers.engine_plan import HostFacts
from pools.launchers.prefill_slice import prefill_slice_args, with_prefill_slice

_POOLS = {
    "agent": {"classes": ["agent"], "share": {"initial_frac": 0.5}},
    "normal": {"classes": ["normal"], "share": {"initial_frac": 0.5}},
}
_HOST = HostFacts(
    gpu_count=0,
    cpu_flags=frozenset({"avx2"}),
    cpu_ids=frozenset(range(4)),
    available_memory_bytes=16 * 1024**3,
)


def _config(tmp_path: Path, slice_tokens: Any = None, **engines: Any) -> Any:
    doc: dict[str, Any] = {
        "engines": {"local": {"count": 2, "run_dir": str(tmp_path / "run")}, **engines},
        "pools": _POOLS,
    }
    if slice_tokens is not None:
        doc["admission"] = {"prefill_slice_tokens": slice_tokens}
    return parse_config(doc)


def _argv(launcher: Any) -> list[tuple[str, ...]]:
    assert isinstance(launcher, LocalLauncher)
    launcher.prepare(_HOST, frozenset({"--model", "--port", "--dtype"}))
    return [e.command.argv for e in launcher.engines]


def test_every_local_engine_gets_the_cap(tmp_path: Path) -> None:
    for argv in _argv(make_launcher(_config(tmp_path, 256))):
        i = argv.index("--long-prefill-token-threshold")
        assert argv[i + 1] == "256"
    # unset: vLLM's default, no flag
    for argv in _argv(make_launcher(_config(tmp_path))):
        assert "--long-prefill-token-threshold" not in argv


def test_the_users_vllm_args_stay_last() -> None:
    assert with_prefill_slice(("--max-num-seqs", "8"), 512) == (
        "--long-prefill-token-threshold",
        "512",
        "--max-num-seqs",
        "8",
    )
    assert prefill_slice_args(None) == () and with_prefill_slice(("-x",), None) == ("-x",)


def _problem(tmp_path: Path, slice_tokens: Any, **engines: Any) -> str:
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, slice_tokens, **engines)
    (problem,) = info.value.problems
    return problem


@pytest.mark.parametrize("bad", [0, 63, -1, True, "auto", 1.5])
def test_bad_values_are_refused(tmp_path: Path, bad: Any) -> None:
    assert "prefill_slice_tokens" in _problem(tmp_path, bad)


def test_refused_where_gpupool_does_not_start_the_engines(tmp_path: Path) -> None:
    static = {"launcher": "static", "static": {"urls": ["http://127.0.0.1:9000"]}}
    problem = _problem(tmp_path, 256, **static)
    assert "--long-prefill-token-threshold 256" in problem and "'static'" in problem


def test_refused_when_vllm_args_set_the_flag_too(tmp_path: Path) -> None:
    for args in (["--long-prefill-token-threshold", "128"], ["--long-prefill-token-threshold=9"]):
        local = {"count": 1, "run_dir": str(tmp_path / "run"), "vllm_args": args}
        assert "keep one" in _problem(tmp_path, 256, local=local)


def test_refused_above_the_model_length(tmp_path: Path) -> None:
    doc = {
        "model": {"max_model_len_tokens": 1024},
        "pools": _POOLS,
        "admission": {"prefill_slice_tokens": 2048},
    }
    with pytest.raises(ConfigError) as info:
        parse_config(doc)
    assert "max_model_len_tokens" in info.value.problems[0]
