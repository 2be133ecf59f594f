"""`gpupool plan` and `gpupool probe`, through their own argparse registration."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import pytest

from gpu_probe.fake_nvml import FakeGpu, FakeNvml
from router.cli.commands import plan, probe


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpupool")
    sub = p.add_subparsers(dest="command")
    plan.register(sub)
    probe.register(sub)
    return p


def run_plan(*argv: str) -> tuple[int, str, str]:
    args = parser().parse_args(["plan", *argv])
    out, err = io.StringIO(), io.StringIO()
    code = plan.run(args, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def plan_json(*argv: str) -> dict[str, Any]:
    code, out, err = run_plan(*argv, "--json")
    assert code == 0, err
    data: dict[str, Any] = json.loads(out)
    return data


def test_plan_json_for_known_model() -> None:
    data = plan_json("--model-config", "llama-3.1-8b", "--gpu", "H100")
    assert data["kv_bytes_per_token"] == 131072
    assert data["block_size_tokens"] == 16
    assert data["num_blocks"] > 0 and data["kv_tokens"] == data["num_blocks"] * 16
    assert data["fits"] and data["fits_max_model_len"]
    contexts = [c["context_tokens"] for c in data["contexts"]]
    assert contexts == [1024, 4096, 8192, 32768, 131072]
    concurrent = [c["max_concurrent_sequences"] for c in data["contexts"]]
    assert concurrent == sorted(concurrent, reverse=True)
    rows = data["latency"]["rows"]
    assert [r["batch_size"] for r in rows] == [1, 8, 32, 64, 128, 256]
    assert rows[0]["tpot_ms"] == pytest.approx(6.1, abs=0.5)
    op = data["operating_point"]
    assert op["max_batch"] == min(op["max_batch_for_tpot"], op["max_concurrent_by_kv"])


def test_plan_options() -> None:
    data = plan_json(
        "--model-config",
        "llama-3.1-70b",
        "--gpu",
        "h200",
        "--tp",
        "2",
        "--max-model-len",
        "32768",
        "--gpu-memory-utilization",
        "0.85",
        "--kv-cache-dtype",
        "fp8",
    )
    assert data["kv_bytes_per_token"] == 327680 // 2  # fp8
    assert data["kv_bytes_per_token_per_gpu"] == 327680 // 4  # fp8 and tp 2
    assert data["tensor_parallel_size"] == 2 and data["max_model_len"] == 32768
    assert data["contexts"][-1]["context_tokens"] == 32768
    assert data["gpu"]["name"] == "H200"


def test_plan_text_table() -> None:
    code, out, _ = run_plan("--model-config", "deepseek-v3", "--gpu", "H200", "--tp", "8")
    assert code == 0
    assert "KV bytes per token        70272" in out
    assert "MLA" in out and "max_concurrent_seqs" in out and "tpot_ms" in out
    assert "operating point" in out


def test_plan_dev_model_folder(tmp_path: Path) -> None:
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "num_hidden_layers": 2,
                "max_position_embeddings": 8192,
                "vocab_size": 4096,
                "torch_dtype": "bfloat16",
            }
        )
    )
    data = plan_json("--model-config", str(folder), "--gpu", "L40S", "--block-size", "128")
    assert data["kv_bytes_per_token"] == 1024
    assert data["model"]["name"] == "tiny"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model-config", "gpt-17", "--gpu", "H100"], "neither a known model"),
        (["--model-config", "llama-3.1-8b", "--gpu", "TPU"], "unknown GPU 'TPU'"),
        (["--model-config", "llama-3.1-8b", "--gpu", "H100", "--tp", "0"], "--tp"),
        (
            ["--model-config", "llama-3.1-8b", "--gpu", "H100", "--gpu-memory-utilization", "2"],
            "gpu_memory_utilization",
        ),
    ],
)
def test_plan_bad_input_exits_2(argv: list[str], message: str) -> None:
    code, out, err = run_plan(*argv)
    assert code == 2
    assert message in err and out == ""


def test_plan_model_that_does_not_fit_exits_2() -> None:
    code, _, err = run_plan("--model-config", "llama-3.1-70b", "--gpu", "H100")
    assert code == 2 and "does not fit" in err


def test_plan_context_too_long_exits_2() -> None:
    code, _, err = run_plan("--model-config", "llama-3.1-70b", "--gpu", "H100", "--tp", "2")
    assert code == 2 and "lower --max-model-len" in err


def test_plan_bad_config_file_exits_2(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "rwkv"}))
    code, _, err = run_plan("--model-config", str(tmp_path), "--gpu", "H100")
    assert code == 2 and "unsupported model family 'rwkv'" in err


def test_plan_missing_required_argument_is_usage_error() -> None:
    with pytest.raises(SystemExit) as info:
        parser().parse_args(["plan", "--gpu", "H100"])
    assert info.value.code == 2


# -- probe ------------------------------------------------------------------------------


def run_probe(nvml: FakeNvml | None, *argv: str) -> tuple[int, str]:
    args = parser().parse_args(["probe", *argv])
    out = io.StringIO()
    code = probe.run(args, nvml=nvml, out=out)
    return code, out.getvalue()


def test_probe_table_with_fake_gpus() -> None:
    nvml = FakeNvml([FakeGpu.h100(0, memory_used_bytes=8 * 2**30, processes=[(99, 2**30)])])
    code, out = run_probe(nvml)
    assert code == 0
    assert "NVIDIA H100 80GB HBM3" in out and "H100" in out
    assert "8.0/79.6" in out and "pid 99" in out


def test_probe_json_with_fake_gpus() -> None:
    code, out = run_probe(FakeNvml([FakeGpu.h100(), FakeGpu.l40s(1)]), "--json")
    data = json.loads(out)
    assert code == 0 and data["has_gpu"] and len(data["devices"]) == 2


def test_probe_without_gpu_exits_0_with_reason() -> None:
    code, out = run_probe(FakeNvml.without_driver())
    assert code == 0 and out.startswith("no GPU: ")
    code, out = run_probe(FakeNvml.without_driver(), "--json")
    data = json.loads(out)
    assert code == 0 and data["has_gpu"] is False and data["no_gpu_reason"]


def test_probe_on_this_machine_never_fails() -> None:
    args = parser().parse_args(["probe"])
    out = io.StringIO()
    assert probe.run(args, out=out) == 0
    assert out.getvalue()
