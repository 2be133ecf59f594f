"""Every way gpupool starts engines sets VLLM_ENABLE_RESPONSES_API_STORE=1, without which vLLM
keeps no response for a `previous_response_id` follow-up: the local and Ray launchers (one
command builder) and the Helm chart's engines."""

from __future__ import annotations

from pathlib import Path

from pools.launchers.engine_args import build_engine_command
from tests.unit.test_engine_args import ALL_FLAGS, _configs
from tests.unit.test_helm_chart import CHART, _by_kind, _documents, _render, _values


def test_local_and_ray_engines_store_responses(tmp_path: Path) -> None:
    model, local = _configs(tmp_path)
    for gpu_ids in (None, [0]):
        cmd = build_engine_command(
            model=model, local=local, index=0, gpu_ids=gpu_ids, flags=ALL_FLAGS
        )
        assert cmd.env["VLLM_ENABLE_RESPONSES_API_STORE"] == "1"
    # an operator's explicit choice is kept
    cmd = build_engine_command(
        model=model,
        local=local,
        index=0,
        gpu_ids=None,
        flags=ALL_FLAGS,
        base_env={"VLLM_ENABLE_RESPONSES_API_STORE": "0"},
    )
    assert cmd.env["VLLM_ENABLE_RESPONSES_API_STORE"] == "0"


def test_helm_engines_store_responses() -> None:
    values = _values(CHART / "examples" / "eight-gpu-tp2.yaml")
    (sts,) = _by_kind(list(_documents(_render(values))), "StatefulSet")
    env = {e["name"]: e for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["VLLM_ENABLE_RESPONSES_API_STORE"]["value"] == "1"
