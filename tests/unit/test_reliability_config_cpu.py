"""CPU engines as a user configures them: the dtype the CPU runs fast, a KV cache per engine
that leaves room for every engine, and a KV cache too small for one max_model_len sequence
refused by check-config (predicted by kvcache_model from the model's config.json)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvcache_model.geometry import ModelGeometry
from pools.config import default_config
from pools.devmodel import make_dev_model
from pools.launchers import LocalLauncher
from pools.launchers.engine_plan import (
    CPU_ENGINE_BASE_BYTES,
    CPU_KV_FLOOR_BYTES,
    CPU_KV_MEMORY_FRAC,
    HostFacts,
    choose_dtype,
    cpu_flags_from_cpuinfo,
    engine_problems,
    plan_engines,
)
from pools.testing.config import REMOVE, config_data, config_for_test
from router.cli import main

GIB = 1024**3
MIB = 1024**2
AVX2_ONLY = frozenset({"fpu", "sse4_2", "avx", "avx2", "fma"})
AVX512_BF16 = AVX2_ONLY | {"avx512f", "avx512_bf16"}
AMX = AVX2_ONLY | {"avx512f", "amx_bf16", "amx_tile"}
EPYC_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B12
flags\t\t: fpu vme de pse sse4_2 avx avx2 fma

processor\t: 1
flags\t\t: fpu vme de pse sse4_2 avx avx2 fma
"""


def _host(
    flags: frozenset[str] = AVX2_ONLY, available_gib: float = 16.0, gpus: int = 0, cpus: int = 8
) -> HostFacts:
    return HostFacts(
        gpu_count=gpus,
        cpu_flags=flags,
        cpu_ids=frozenset(range(cpus)),
        available_memory_bytes=int(available_gib * GIB),
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dev_model(tmp_path_factory.mktemp("model") / "tiny")


def _config(tiny: Path, **local: Any) -> Any:
    local = {k: REMOVE if v is None else v for k, v in local.items()}
    return config_for_test(model={"path": str(tiny)}, engines={"local": local})


# --- dtype ------------------------------------------------------------------------------------


def test_model_dtype_defaults_to_auto() -> None:
    assert default_config().model.dtype == "auto"


def test_cpu_flags_are_read_from_cpuinfo() -> None:
    assert cpu_flags_from_cpuinfo(EPYC_CPUINFO) == frozenset(
        {"fpu", "vme", "de", "pse", "sse4_2", "avx", "avx2", "fma"}
    )
    assert cpu_flags_from_cpuinfo("") == frozenset()


@pytest.mark.parametrize(
    ("flags", "expected", "reason_has"),
    [
        (AVX2_ONLY, "float32", "neither avx512_bf16 nor amx_bf16"),
        (AVX512_BF16, "bfloat16", "avx512_bf16"),
        (AMX, "bfloat16", "amx_bf16"),
    ],
)
def test_auto_dtype_on_cpu_is_what_the_cpu_runs_fast(
    flags: frozenset[str], expected: str, reason_has: str
) -> None:
    choice = choose_dtype("auto", on_cpu=True, cpu_flags=flags)
    assert choice.dtype == expected and reason_has in choice.reason


def test_explicit_dtype_is_honoured_and_gpu_keeps_vllms_auto() -> None:
    assert choose_dtype("bfloat16", on_cpu=True, cpu_flags=AVX2_ONLY).dtype == "bfloat16"
    assert choose_dtype("float16", on_cpu=False, cpu_flags=AVX2_ONLY).dtype == "float16"
    assert choose_dtype("auto", on_cpu=False, cpu_flags=AVX2_ONLY).dtype == "auto"


def test_engines_are_started_with_the_chosen_dtype(tiny: Path, tmp_path: Path) -> None:
    config = _config(tiny, run_dir=str(tmp_path))
    launcher = LocalLauncher(config.engines.local, config.model, gpu_count=0)
    flags = frozenset({"--dtype", "--kv-cache-memory-bytes"})
    for host, dtype in ((_host(AVX2_ONLY), "float32"), (_host(AMX), "bfloat16")):
        launcher.prepare(host, flags)
        for engine in launcher.engines:
            argv = engine.command.argv
            assert argv[argv.index("--dtype") + 1] == dtype


# --- KV cache size on CPU ---------------------------------------------------------------------


def test_cpu_default_kv_leaves_room_for_every_engine(tiny: Path) -> None:
    """`local: {count: 2}` and no kv_cache_bytes: vLLM's CPU default would reserve 92 % of the
    node's memory in each engine. The default splits a fraction of what is available instead."""
    geometry = ModelGeometry.from_path(tiny, dtype="float32")
    for available_gib in (8.0, 16.0, 64.0, 512.0):
        for count in (1, 2, 3, 8):
            host = _host(available_gib=available_gib)
            config = _config(tiny, count=count, kv_cache_bytes=None)
            plan = plan_engines(config.engines.local, config.model, host)
            kv = plan.kv_cache_bytes
            assert kv is not None and kv % MIB == 0
            per_engine = kv + geometry.weight_bytes + CPU_ENGINE_BASE_BYTES
            if kv > CPU_KV_FLOOR_BYTES:  # above the floor the engines share the fraction
                assert count * per_engine <= CPU_KV_MEMORY_FRAC * host.available_memory_bytes
            assert kv >= CPU_KV_FLOOR_BYTES
            # never more than --max-num-seqs (64 in the default) full-length sequences need
            assert kv <= 64 * 4096 * geometry.kv_bytes_per_token()
            assert "MiB" in plan.kv_reason


def test_explicit_kv_cache_bytes_is_used_as_given(tiny: Path) -> None:
    config = _config(tiny, kv_cache_bytes=96 * MIB)
    plan = plan_engines(config.engines.local, config.model, _host())
    assert plan.kv_cache_bytes == 96 * MIB and "engines.local.kv_cache_bytes" in plan.kv_reason


# --- a KV cache smaller than one sequence -----------------------------------------------------


def test_kv_cache_smaller_than_one_sequence_is_refused(tiny: Path) -> None:
    # tiny at float32: 2 layers x 2 (K, V) x 2 heads x 64 x 4 B = 2048 B/token; a 4096-token
    # sequence is 32 blocks of 128 tokens (8 MiB), plus the null block vLLM holds back: 33
    # blocks, 8650752 B. 4 MiB holds half a sequence.
    config = _config(tiny, kv_cache_bytes=4 * MIB)
    (problem,) = engine_problems(config, _host(AVX2_ONLY))
    assert problem.startswith("engines.local.kv_cache_bytes:")
    assert "4096-token" in problem and "8650752" in problem and "float32" in problem
    # 8 MiB is exactly 32 blocks: one short (measured: vLLM refuses that at start)
    assert engine_problems(_config(tiny, kv_cache_bytes=8 * MIB), _host(AVX2_ONLY)) != []
    assert engine_problems(_config(tiny, kv_cache_bytes=8650752), _host(AVX2_ONLY)) == []
    # at bfloat16 (a CPU with avx512_bf16) a token takes half: 33 blocks are 4325376 B
    assert engine_problems(_config(tiny, kv_cache_bytes=4325376), _host(AVX512_BF16)) == []


def test_default_config_has_no_engine_problems_on_a_small_cpu_box() -> None:
    assert engine_problems(default_config(), _host(AVX2_ONLY, available_gib=8)) == []


def test_cpu_affinity_naming_cpus_this_machine_lacks_is_refused(tiny: Path) -> None:
    config = _config(tiny, cpu_affinity=[[0], [1], [9]])
    (problem,) = engine_problems(config, _host(cpus=4))
    assert problem.startswith("engines.local.cpu_affinity:") and "9" in problem


def test_check_config_refuses_a_kv_cache_smaller_than_one_sequence(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = config_data(
        model={"path": str(tiny), "dtype": "float32"},  # float32: the same answer on every CPU
        engines={"local": {"kv_cache_bytes": 4 * MIB}},
    )
    path = tmp_path / "small-kv.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "engines.local.kv_cache_bytes" in err and "4096-token" in err


def test_launcher_refuses_to_start_what_would_die(tiny: Path, tmp_path: Path) -> None:
    config = _config(tiny, kv_cache_bytes=4 * MIB, run_dir=str(tmp_path))
    model = dataclasses.replace(config.model, dtype="float32")
    launcher = LocalLauncher(config.engines.local, model, gpu_count=0)
    from pools.launchers import LauncherError

    with pytest.raises(LauncherError, match="kv_cache_bytes"):
        launcher.prepare(_host(), frozenset({"--dtype", "--kv-cache-memory-bytes"}))
