"""Scenario validation: shipped scenarios load; bad ones fail with messages naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from router.simulate.arrivals import RenewalArrivals, TraceArrivals
from router.simulate.distributions import Fixed, LogNormal
from router.simulate.scenario import ScenarioError, load_scenario, parse_scenario

SCENARIOS = Path(__file__).resolve().parents[2] / "benchmarks" / "scenarios"


def base() -> dict[str, Any]:
    return {
        "name": "t",
        "duration_s": 10,
        "classes": {
            "chat": {
                "kind": "chat",
                "arrivals": {"process": "poisson", "rate_per_s": 1},
                "prompt_tokens": {"dist": "fixed", "value": 100},
                "output_tokens": {"dist": "lognormal", "median": 20, "sigma": 0.5},
                "slo": {"ttft_ms": 500},
            },
            "agent": {
                "kind": "agent",
                "arrivals": {"process": "gamma", "rate_per_s": 0.5, "cv": 2},
                "steps": {"dist": "empirical", "values": [2, 4], "weights": [1, 1]},
                "prompt_tokens": {"dist": "fixed", "value": 300},
                "output_tokens": {"dist": "fixed", "value": 20},
                "tool_result_tokens": {"dist": "uniform", "low": 10, "high": 50},
                "tool_wait_ms": {"dist": "exponential", "mean": 300},
            },
        },
    }


def problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(data)
    return info.value.problems


@pytest.mark.parametrize(
    "name", ["smoke", "agent-flood", "agent-flood-gpu", "day-night", "agreement", "trace-replay"]
)
def test_shipped_scenarios_load(name: str) -> None:
    scenario = load_scenario(SCENARIOS / f"{name}.yaml")
    assert scenario.name == name
    assert scenario.classes


def test_parse_builds_frozen_scenario() -> None:
    scenario = parse_scenario(base())
    chat, agent = scenario.classes
    assert chat.name == "chat" and chat.kind == "chat"
    assert isinstance(chat.arrivals, RenewalArrivals) and chat.arrivals.cv == 1.0
    assert chat.prompt_tokens == Fixed(100)
    assert isinstance(chat.output_tokens, LogNormal)
    assert chat.slo.as_dict() == {"ttft_ms": 500}
    assert isinstance(agent.arrivals, RenewalArrivals) and agent.arrivals.cv == 2
    assert agent.tools == 3 and agent.max_context_tokens == 3500


def test_unknown_key_is_named() -> None:
    data = base()
    data["classes"]["chat"]["slo"]["ttft"] = 5
    assert any(p.startswith("classes.chat.slo.ttft:") for p in problems(data))


def test_bad_value_is_named() -> None:
    data = base()
    data["classes"]["chat"]["arrivals"]["rate_per_s"] = 0
    assert any(
        "classes.chat.arrivals.poisson.rate_per_s" in p and "greater than 0" in p
        for p in problems(data)
    )


def test_unknown_distribution_is_named() -> None:
    data = base()
    data["classes"]["chat"]["prompt_tokens"] = {"dist": "zipf", "a": 2}
    assert any(p.startswith("classes.chat.prompt_tokens") for p in problems(data))


def test_agent_needs_its_fields() -> None:
    data = base()
    del data["classes"]["agent"]["steps"]
    (msg,) = [p for p in problems(data) if p.startswith("classes.agent")]
    assert "missing steps" in msg


def test_chat_rejects_agent_fields() -> None:
    data = base()
    data["classes"]["chat"]["steps"] = {"dist": "fixed", "value": 2}
    assert any("classes.chat" in p and "kind: agent" in p for p in problems(data))


def test_sizes_required_without_trace() -> None:
    data = base()
    del data["classes"]["chat"]["output_tokens"]
    assert any("missing output_tokens" in p for p in problems(data))


def test_schedule_must_start_at_zero_and_increase() -> None:
    data = base()
    data["classes"]["chat"]["arrivals"] = {
        "process": "schedule",
        "segments": [{"start_s": 5, "rate_per_s": 1}],
    }
    assert any("start at start_s: 0" in p for p in problems(data))
    data["classes"]["chat"]["arrivals"]["segments"] = [
        {"start_s": 0, "rate_per_s": 1},
        {"start_s": 0, "rate_per_s": 2},
    ]
    assert any("increasing start_s" in p for p in problems(data))


def test_empirical_weights_must_match() -> None:
    data = base()
    data["classes"]["agent"]["steps"] = {"dist": "empirical", "values": [1, 2], "weights": [1]}
    assert any(
        p.startswith("classes.agent.steps") and "one entry per value" in p for p in problems(data)
    )


def test_missing_top_level_fields() -> None:
    msgs = problems({"name": "x"})
    assert any(p.startswith("duration_s:") for p in msgs)
    assert any(p.startswith("classes:") for p in msgs)


def test_trace_path_is_relative_to_the_file(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text(
        '{"timestamp": 0, "input_length": 50, "output_length": 5}\n'
        '{"timestamp": 500, "input_length": 60, "output_length": 6}\n'
    )
    data: dict[str, Any] = {
        "name": "tr",
        "duration_s": 5,
        "classes": {
            "c": {
                "kind": "chat",
                "arrivals": {"process": "trace", "path": "t.jsonl", "format": "mooncake"},
            }
        },
    }
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    scenario = load_scenario(path)
    assert isinstance(scenario.classes[0].arrivals, TraceArrivals)
    assert scenario.classes[0].prompt_tokens is None  # from the trace
    data["classes"]["c"]["arrivals"]["path"] = "missing.jsonl"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert info.value.problems[0].startswith("classes.c.arrivals.path:")


def test_unreadable_and_invalid_yaml(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_scenario(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ScenarioError, match="mapping"):
        load_scenario(bad)


def test_scale_rates_multiplies_every_arrival_rate(tmp_path: Path) -> None:
    from router.simulate.scenario import scale_rates

    scenario = load_scenario(SCENARIOS / "agent-flood.yaml")
    scaled = scale_rates(scenario, 10.0)
    for before, after in zip(scenario.classes, scaled.classes, strict=True):
        assert after.arrivals.expected_count(180) == pytest.approx(
            10 * before.arrivals.expected_count(180)
        )
        assert after.slo == before.slo and after.prompt_tokens == before.prompt_tokens
    replay = scale_rates(load_scenario(SCENARIOS / "trace-replay.yaml"), 2.0)
    assert isinstance(replay.classes[0].arrivals, TraceArrivals)
    assert replay.classes[0].arrivals.speedup == 4.0
    with pytest.raises(ScenarioError):
        scale_rates(scenario, 0)
