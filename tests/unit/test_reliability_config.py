"""Configs that parse but cannot run are refused the same way by `check-config`, `up` and
`serve`: exit 2, one line per problem, no traceback and nothing started."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pools.config import DEFAULT_CPU_CONFIG, ConfigError, contract_problems, parse_config

REPO = Path(__file__).resolve().parents[2]
GPUPOOL = str(Path(sys.executable).parent / "gpupool")
COMMANDS = (["check-config"], ["up", "--config"], ["serve", "--config"])


def _write(tmp_path: Path, data: dict[str, Any]) -> Path:
    data.setdefault("router", {}).update(
        ledger_path=str(tmp_path / "ledger.sqlite"), state_path=str(tmp_path / "state.json")
    )
    data["engines"].setdefault("local", {})["run_dir"] = str(tmp_path / "run")
    path = tmp_path / "gpupool.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _run_every_command(path: Path) -> list[subprocess.CompletedProcess[str]]:
    """Each command on `path`; a command that starts serving instead of refusing times out."""
    results = []
    for command in COMMANDS:
        try:
            result = subprocess.run(
                [GPUPOOL, *command, str(path)],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=60,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired as err:
            raise AssertionError(
                f"{command[0]} did not refuse the config: {err.stderr!r}"
            ) from None
        results.append(result)
    return results


def _assert_refused(path: Path, *needles: str) -> None:
    for command, result in zip(COMMANDS, _run_every_command(path), strict=True):
        assert result.returncode == 2, (command, result.returncode, result.stderr)
        assert "Traceback" not in result.stderr, (command, result.stderr)
        for needle in needles:
            assert needle in result.stderr, (command, needle, result.stderr)


def test_inconsistent_contract_is_refused_by_up_and_serve_too(tmp_path: Path) -> None:
    data = copy.deepcopy(DEFAULT_CPU_CONFIG)
    data["pools"]["agent"]["share"] = {"initial_frac": 0.5, "floor_frac": 0.5, "ceiling_frac": 0.5}
    data["pools"]["normal"]["share"] = {"initial_frac": 0.6, "floor_frac": 0.6, "ceiling_frac": 0.6}
    _assert_refused(_write(tmp_path, data), "floor_frac values sum to 1.100")


def test_short_cpu_affinity_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    data = copy.deepcopy(DEFAULT_CPU_CONFIG)
    data["engines"]["local"]["cpu_affinity"] = [[0], [1]]  # three engines
    _assert_refused(
        _write(tmp_path, data), "engines.local.cpu_affinity", "2 CPU lists for 3 engines"
    )


def test_ray_launcher_is_a_ray_config_not_run_as_local() -> None:
    data = copy.deepcopy(DEFAULT_CPU_CONFIG)
    data["engines"]["launcher"] = "ray"
    data["engines"]["ray"] = {
        "count": 2,
        "gpus_per_instance": 0,
        "vllm_args": ["--max-num-seqs", "8"],
    }
    config = parse_config(data)
    assert config.engines.instance_count == 2  # engines.ray.count, not engines.local.count
    assert config.engines.vllm_args == ("--max-num-seqs", "8")
    from pools.launchers import make_launcher
    from pools.launchers.ray import RayLauncher

    assert isinstance(make_launcher(config), RayLauncher)


def test_ray_launcher_refuses_disable_log_stats() -> None:
    data = copy.deepcopy(DEFAULT_CPU_CONFIG)
    data["engines"]["launcher"] = "ray"
    data["engines"]["ray"] = {"vllm_args": ["--disable-log-stats"]}
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    (problem,) = info.value.problems
    assert problem.startswith("engines.ray:") and "--disable-log-stats" in problem


def test_cpu_affinity_of_the_right_length_passes() -> None:
    data = copy.deepcopy(DEFAULT_CPU_CONFIG)
    data["engines"]["local"]["cpu_affinity"] = [[0], [1], [1]]
    assert contract_problems(parse_config(data)) == []
