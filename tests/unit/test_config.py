"""Config validation: errors name the field; the contract check finds inconsistent numbers."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from pools.config import (
    DEFAULT_CPU_CONFIG,
    ConfigError,
    contract_problems,
    default_config,
    load_config,
    max_num_seqs,
    parse_config,
)
from router.cli import main


def _cfg(**changes: Any) -> dict[str, Any]:
    data = copy.deepcopy(DEFAULT_CPU_CONFIG)
    for dotted, value in changes.items():
        node = data
        keys = dotted.split("__")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return data


def _problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value.problems


def test_default_config_is_valid_and_consistent() -> None:
    config = default_config()
    assert config.engines.launcher == "local" and config.engines.local.count == 3
    assert [p.name for p in config.pools] == ["agent", "normal"]
    assert contract_problems(config) == []
    agent = config.pool_for_class("agent")
    assert agent is not None and agent.name == "agent"
    assert config.classification.default_class == "normal"


def test_unknown_field_is_named() -> None:
    problems = _problems(_cfg(engines__local__cuont=3))
    assert problems == ["engines.local.cuont: unknown field (check the spelling)"]


def test_share_order_is_checked() -> None:
    data = _cfg()
    data["pools"]["agent"]["share"] = {"initial_frac": 0.1, "floor_frac": 0.2, "ceiling_frac": 0.5}
    (problem,) = _problems(data)
    assert problem.startswith("pools.agent.share:") and "floor_frac <= initial_frac" in problem


def test_bad_types_and_ranges_name_the_field() -> None:
    problems = _problems(_cfg(engines__local__count=0, router__port="eighty"))
    assert any(p.startswith("engines.local.count:") for p in problems)
    assert any(p.startswith("router.port:") for p in problems)


def test_disable_log_stats_is_refused() -> None:
    (problem,) = _problems(_cfg(engines__local__vllm_args=["--disable-log-stats"]))
    assert "--disable-log-stats" in problem and "metric" in problem


def test_static_launcher_needs_urls() -> None:
    (problem,) = _problems(_cfg(engines__launcher="static"))
    assert "engines.static.urls" in problem
    bad = _problems(_cfg(engines__launcher="static", engines__static={"urls": ["localhost:1"]}))
    assert "http://" in bad[0]


def test_class_served_twice_or_unserved() -> None:
    data = _cfg()
    data["pools"]["agent"]["classes"] = ["agent", "normal"]
    assert "served by two pools" in _problems(data)[0]
    data = _cfg()
    data["classes"]["batch"] = {"timeout_s": 10}
    assert "not served by any pool" in _problems(data)[0]


def test_api_key_env_must_be_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    data = _cfg(tenants=[{"name": "team-a", "api_key_env": "NO_SUCH_KEY_VAR"}])
    (problem,) = _problems(data)
    assert "NO_SUCH_KEY_VAR" in problem
    monkeypatch.setenv("NO_SUCH_KEY_VAR", "secret")
    assert parse_config(data).tenants[0].api_key == "secret"


def test_contract_problems_are_found() -> None:
    data = _cfg()
    data["pools"]["agent"]["share"] = {"initial_frac": 0.5, "floor_frac": 0.5, "ceiling_frac": 0.5}
    data["pools"]["normal"]["share"] = {"initial_frac": 0.6, "floor_frac": 0.6, "ceiling_frac": 0.6}
    problems = contract_problems(parse_config(data))
    assert any("floor_frac values sum to 1.100" in p for p in problems)
    data = _cfg()
    data["classes"]["normal"] = {"timeout_s": 3, "expected_output_tokens": 128}
    (problem,) = contract_problems(parse_config(data))
    assert problem.startswith("classes.normal:") and "exceeds timeout_s 3" in problem
    data = _cfg()
    data["pools"]["agent"]["share"] = {"initial_frac": 0.2, "floor_frac": 0.1, "ceiling_frac": 0.2}
    data["pools"]["normal"]["share"] = {"initial_frac": 0.8, "floor_frac": 0.5, "ceiling_frac": 0.8}
    (problem,) = contract_problems(parse_config(data))
    assert "less than one instance" in problem


def test_check_config_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(DEFAULT_CPU_CONFIG))
    assert main(["check-config", str(good)]) == 0
    broken = tmp_path / "broken.yaml"
    broken.write_text("pools: [unclosed\n")
    assert main(["check-config", str(broken)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    invalid = tmp_path / "invalid.yaml"
    invalid.write_text(yaml.safe_dump(_cfg(engines__local__count=-1)))
    assert main(["check-config", str(invalid)]) == 2
    assert "engines.local.count" in capsys.readouterr().err
    assert main(["check-config", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read the file" in capsys.readouterr().err
    assert load_config(None).source == "<built-in default>"


def test_tenant_limits_are_checked_by_the_contract_check() -> None:
    # tokens_per_minute, max_concurrent_runs and borrow_max_frac are enforced
    # (router/governance); borrowing needs a token budget to be a fraction of
    data = {
        **DEFAULT_CPU_CONFIG,
        "tenants": [
            {
                "name": "a",
                "api_key_env": "HOME",
                "tokens_per_minute": 1000,
                "max_concurrent_runs": 2,
                "borrow_max_frac": 0.5,
            },
            {"name": "b", "api_key_env": "PATH", "borrow_max_frac": 0.5},
        ],
    }
    problems = contract_problems(parse_config(data))
    assert problems == [
        "tenants.b.borrow_max_frac: borrowing extends a token budget; set tokens_per_minute"
        " too (it is the base quota the fraction is of)"
    ]


def test_check_config_names_settings_not_in_effect_yet(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config"]) == 0
    out = capsys.readouterr().out
    # the built-in default runs without the rebalancer: its bounds bind SRE moves only
    assert "share bounds and schedules bind only SRE moves" in out
    assert "router.state_path" not in out  # SRE settings live there now


def test_the_frozen_view_is_the_declaration() -> None:
    """One declaration per section: `dataclasses.replace` validates as loading does, derived
    values follow the fields they come from, and a document may not set what the config
    reads from the environment or derives."""
    config = default_config()
    with pytest.raises(ValueError, match="less than or equal to 65535"):
        dataclasses.replace(config.router, port=70000)
    static = dataclasses.replace(
        config.engines,
        launcher="static",
        static=dataclasses.replace(config.engines.static, urls=("http://a:1/", "http://b:2")),
    )
    assert static.instance_count == 2 and static.static.urls == ("http://a:1", "http://b:2")
    share = dataclasses.replace(config.pools[0].share, floor_frac=0.1)
    assert share.bounds.floor_frac == 0.1
    assert _problems(_cfg(engines__local__api_key="literal")) == [
        "engines.local.api_key: unknown field (check the spelling)"
    ]
    assert _problems(_cfg(pools__agent__name="other")) == [
        "pools.agent.name: unknown field (check the spelling)"
    ]
    assert _problems(_cfg(source="x")) == ["source: unknown field (check the spelling)"]
    assert _problems(_cfg(pools=[{"classes": ["agent"]}])) == [
        "pools: Input should be a valid dictionary"
    ]


def test_paths_resolve_against_the_base_whether_given_or_default(tmp_path: Path) -> None:
    config = parse_config(_cfg(router__state_path="state/s.json"), base_dir=tmp_path)
    assert config.router.state_path == tmp_path / "state" / "s.json"
    assert config.router.ledger_path == tmp_path / ".gpupool" / "ledger.sqlite"  # the default
    assert config.rebalancer.decision_log_path == tmp_path / "state" / "decisions.sqlite"
    assert config.engines.local.run_dir == tmp_path / ".gpupool" / "run"


def test_max_num_seqs_one_reading_for_every_caller() -> None:
    assert max_num_seqs(["--max-num-seqs", "64"]) == 64
    assert max_num_seqs(["--max-num-seqs=8", "--max-num-seqs", "16"]) == 16  # last wins
    assert max_num_seqs([]) == 256 and max_num_seqs([], default=128) == 128
    assert max_num_seqs(["--max-num-seqs", "many"]) == 256  # vLLM refuses it; not a crash
    assert default_config().engines.max_num_seqs == 64
    data = _cfg(engines__launcher="ray", engines__ray={"vllm_args": ["--max-num-seqs=8"]})
    assert parse_config(data).engines.max_num_seqs == 8  # the launcher's own arguments
